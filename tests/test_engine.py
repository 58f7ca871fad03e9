"""The engine adapter against a real vLLM CPU engine (tiny random model)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_helpers import ENGINE_ARGS

from asyncroll import (
    EngineDeadError,
    EngineStartError,
    VLLMEngine,
)
from asyncroll.testing import vllm_client
from asyncroll.vllm import compat

PROMPT = [5, 6, 7, 8]


def _params(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, **extra}


# The generation contract (concurrency, seeds, abort, pause, bad input, duplicate ids,
# cancellation) is asyncroll.testing.contract, run on this engine in tests/test_contract.py.


def _engine_cores() -> set[int]:
    cores = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited while we looked
            if "EngineCore" in " ".join(child.cmdline()):
                cores.add(child.pid)
    return cores


async def test_a_missing_model_folder_fails_before_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that does not exist would otherwise become a Hugging Face hub lookup."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("vLLM was asked to start")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", must_not_run)
    for path in (tmp_path / "no-such-model", "./no-such-model"):
        with pytest.raises(EngineStartError, match=r"no-such-model.*does not exist"):
            await VLLMEngine.start(path)


@pytest.mark.engine
async def test_bad_engine_arguments_raise_engine_start_error_and_leave_no_process(
    tiny_model_a: Path,
) -> None:
    before = _engine_cores()
    with pytest.raises(EngineStartError, match=r"bad engine arguments.*max_modle_len"):
        await VLLMEngine.start(tiny_model_a, max_modle_len=64)  # a typo
    with pytest.raises(EngineStartError, match=r"could not start.*max_model_len") as refused:
        await VLLMEngine.start(tiny_model_a, max_model_len=10**7)  # beyond the model's context
    assert isinstance(refused.value.__cause__, ValueError)  # vLLM's own error, kept as the cause
    assert _engine_cores() == before


async def test_statistics_and_repr(engine: VLLMEngine) -> None:
    stats = engine.statistics()
    assert stats.in_flight == 0 and not stats.paused and not stats.dead
    assert stats.num_requests > 0
    assert "VLLMEngine shared running" in repr(engine)


async def test_pause_clears_vllm_caches_by_mode_unless_told(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default ``abort`` and ``wait`` clear vLLM's caches in the pause; ``keep`` does not
    (vLLM's clear preempts running requests: a bare keep would recompute their KV).
    ``clear_cache`` overrides either way."""
    from asyncroll.vllm import compat

    seen: list[tuple[str, bool]] = []
    real = compat.pause_generation

    async def spy(llm: Any, *, mode: str, clear_cache: bool) -> None:
        seen.append((mode, clear_cache))
        await real(llm, mode=mode, clear_cache=clear_cache)

    monkeypatch.setattr(compat, "pause_generation", spy)
    calls: list[tuple[Any, dict[str, bool]]] = [
        ("abort", {}), ("wait", {}), ("keep", {}), ("keep", {"clear_cache": True}),
        ("abort", {"clear_cache": False}),
    ]
    for mode, options in calls:
        await engine.pause(mode, **options)
        await engine.resume()
    assert seen == [
        ("abort", True), ("wait", True), ("keep", False), ("keep", True), ("abort", False)
    ]
    segment = await engine.generate("after-pauses", prompt_ids=PROMPT, sampling_params=_params(4))
    assert len(segment.token_ids) == 4


@pytest.mark.engine
async def test_dead_engine_raises_and_aclose_leaves_no_process(tiny_model_a: Path) -> None:
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # shared engines
    # Eager: nothing it serves is compared, and compiling is a third of a start.
    engine = await VLLMEngine.start(
        tiny_model_a, name="doomed", max_model_len=256, enforce_eager=True
    )
    # multiprocessing's resource tracker is per parent process, not per engine: it stays.
    children = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in others and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert children, "vLLM runs its EngineCore in child processes"
    # The close waits for vLLM's monitor of the EngineCore (tests/test_engine_reap.py): found.
    (monitor,) = compat.engine_monitor_threads(vllm_client(engine))
    try:
        first = await engine.generate("x", prompt_ids=PROMPT, sampling_params=_params(4))
        assert len(first.token_ids) == 4
        names = {p.pid: f"{p.name()} {' '.join(p.cmdline())}" for p in children}
        cores = [pid for pid, name in names.items() if "EngineCore" in name]
        assert len(cores) == 1, names
        os.kill(cores[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(60):
                await engine.generate("y", prompt_ids=PROMPT, sampling_params=_params(200))
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.generate("z", prompt_ids=PROMPT, sampling_params=_params(4))
    finally:
        await engine.aclose()
        await engine.aclose()  # idempotent
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {alive}"
    assert engine.statistics().in_flight == 0
    await asyncio.to_thread(monitor.join)  # it ends (the close waited for it, or soon after)


async def test_engines_run_at_vllms_offline_batch_limits(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """A rollout is a batch job: an engine started without batch limits gets those of
    ``vllm.LLM`` (``UsageContext.LLM_CLASS``), not ``AsyncLLM``'s bare fallbacks, which
    halve what a GPU engine runs at once."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from asyncroll.vllm.engine import _engine_args_with_defaults

    def limits(context: UsageContext) -> tuple[int, int]:
        args = AsyncEngineArgs(**_engine_args_with_defaults(tiny_model_a, ENGINE_ARGS))
        scheduler = args.create_engine_config(context).scheduler_config
        return scheduler.max_num_seqs, scheduler.max_num_batched_tokens

    offline, bare = limits(UsageContext.LLM_CLASS), limits(UsageContext.ENGINE_CONTEXT)
    assert offline != bare  # else this test could not tell them apart
    scheduler = vllm_client(engine).vllm_config.scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == offline
