"""GPU check: calls in flight when a vLLM EngineCore dies fail at once with EngineDeadError.

vLLM's client never fails a utility call (``collective_rpc``, ``resume_generation``, ...) sent
to a core that exits before it answers; ``VLLMEngine`` watches the core's process and fails
them (tests/test_update_failures.py proves it on the CPU build, ordered by events). This runs
the same sequence on the vLLM of a GPU machine: stop the core, send two calls, kill the core.

    python bench/gpu_engine_death.py     # prints "ok after ... s" per call, or FAIL
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

from gpu_e2e import engine_args

from asyncroll import EngineDeadError, VLLMEngine
from asyncroll.testing import vllm_client
from asyncroll.testing.tiny_model import make_tiny_model
from asyncroll.vllm import compat


async def main() -> None:
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "m")
    engine = await VLLMEngine.start(
        path, name="core-dies", skip_tokenizer_init=True,
        **engine_args(max_model_len=512, gpu_memory_utilization=0.1),
    )
    t = time.perf_counter()
    for _ in range(20):
        await engine.weights.read_ranges()
    print(f"read_ranges round trip {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")
    processes = compat.engine_core_processes(vllm_client(engine))
    print("engine core processes:", [p.pid for p in processes])
    os.kill(processes[0].pid, signal.SIGSTOP)  # it can no longer answer
    calls = [
        asyncio.ensure_future(engine.resume()),
        asyncio.ensure_future(engine.weights.read_ranges()),
    ]
    await asyncio.sleep(0.5)  # a check, not a test: time for both calls to be sent
    os.kill(processes[0].pid, signal.SIGKILL)
    t = time.perf_counter()
    for call in calls:
        try:
            await asyncio.wait_for(call, 60)
            print("FAIL: answered")
        except EngineDeadError as exc:
            print(f"ok after {time.perf_counter() - t:.3f} s: {exc}")
        except TimeoutError:
            print("FAIL: still waiting after 60 s")
    await engine.aclose()


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    asyncio.run(main())
