"""Nothing is left behind: engine, manager and push set up and torn down again and again leave
the process's descriptors, threads and children where the first round left them (vLLM's and
torch's one-time singletons), no zombie, and no shared-memory segment."""

from __future__ import annotations

import glob
import os
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
from engine_helpers import load_weights

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.vllm.sockets import private_rpc_directory

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def census() -> dict[str, object]:
    me = psutil.Process()
    children = me.children(recursive=True)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        # (the loop's default executor grows its pool of worker threads as it needs them)
        "threads": sorted(t.name for t in threading.enumerate()
                          if not t.name.startswith("asyncio_")),
        "children": sorted(c.pid for c in children if c.status() != psutil.STATUS_ZOMBIE),
        "zombies": [c.pid for c in children if c.status() == psutil.STATUS_ZOMBIE],
        "segments": sorted(glob.glob(f"/dev/shm/asyncroll-*-p{os.getpid()}")),
    }


def rendezvous_stores() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))


async def test_rounds_of_engine_manager_and_push_leave_nothing_behind(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """Two rounds: the first leaves what it sets up once (vLLM's and torch's singletons), the
    second nothing more. (The shared engine stays up throughout: in every census alike.)"""
    rounds = []
    stores = rendezvous_stores()
    for i in range(2):
        async with (
            VLLMEngine.launch(tiny_model_a, name=f"round-{i}", max_model_len=256,
                              skip_tokenizer_init=True, enforce_eager=True) as started,
            AsyncServerManager([started]) as manager,
        ):
            await manager.update_weights(load_weights(tiny_model_a), global_steps=1)
            await manager.generate(f"r{i}", prompt_ids=[5, 6], sampling_params={"max_tokens": 2})
        rounds.append(census())
    # vLLM 0.32 meets its workers in a file store in the temp directory, and leaves it there.
    assert rendezvous_stores() <= stores
    first, *later = rounds
    assert first["zombies"] == [] and first["segments"] == []
    assert all(r == first for r in later), rounds
    # vLLM's socket files went to this process's own directory, which it removes at exit
    # (tests/test_rpc_sockets.py), not to the temp directory, where vLLM leaves them.
    directory = private_rpc_directory()
    assert directory is not None and os.environ["VLLM_RPC_BASE_PATH"] == str(directory)
    assert any(path.is_socket() for path in directory.iterdir())
