"""An update's pause leaves vLLM's cache alone (its clear walks the whole block pool) and still
lets no request reuse the old weights' KV: requests admitted before the gate closed reach vLLM
before the pause, so an abort pause ends them all."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import load_weights, update_weights

from asyncroll import VLLMEngine
from asyncroll.testing import vllm_client
from asyncroll.vllm import compat

pytestmark = pytest.mark.engine

PROMPT = [30 + i % 400 for i in range(300)]  # more than two of the CPU build's 128-token blocks
PARAMS = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
"""The request in transit: 200 tokens (300 + 200 fit the context of 512), so it is still
running when the update's pause reaches the engine, however slow the machine."""


class _WaitSpy(asyncio.Event):
    """The engine's "every admitted request has landed" event, telling when someone waits."""

    def __init__(self, waiting: asyncio.Event) -> None:
        super().__init__()
        self.waiting = waiting

    async def wait(self) -> bool:  # type: ignore[override]
        self.waiting.set()
        return await super().wait()


async def test_a_request_admitted_before_an_abort_update_never_reuses_the_old_cache(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request passes the gate, then its hand-off to the EngineCore is held until the
    update is under way: until the pause went out (where the pause would not wait for it) or
    the engine waits for it to land (where it does). Either way it must not run at the resume
    on KV cached by the old weights."""
    await engine.generate("transit-warm", prompt_ids=PROMPT, sampling_params=PARAMS)
    warm = await engine.generate("transit-warm-2", prompt_ids=PROMPT, sampling_params=PARAMS)
    assert warm.num_cached_tokens >= 128, "the prompt's prefix must be cached to begin with"

    core = vllm_client(engine).engine_core
    release, arrived, under_way = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real_add, real_pause = core.add_request_async, core.pause_scheduler_async
    pauses: list[dict[str, Any]] = []

    async def held_add(request: Any) -> None:
        arrived.set()
        await release.wait()
        await real_add(request)

    async def spied_pause(*args: Any, **kwargs: Any) -> None:
        pauses.append(kwargs)
        under_way.set()
        await real_pause(*args, **kwargs)

    monkeypatch.setattr(core, "add_request_async", held_add)
    monkeypatch.setattr(core, "pause_scheduler_async", spied_pause)
    monkeypatch.setattr(engine, "_landed", _WaitSpy(under_way))
    in_transit = asyncio.create_task(
        engine.generate("transit-x", prompt_ids=PROMPT, sampling_params=LONG)
    )
    await arrived.wait()
    monkeypatch.setattr(core, "add_request_async", real_add)
    update = asyncio.create_task(update_weights(
        engine, load_weights(tiny_model_a), global_steps=(engine.global_steps or 0) + 1,
        mode="abort",
    ))
    await under_way.wait()
    release.set()
    report = await update
    segment = await in_transit
    assert pauses and pauses[0] == {"mode": "abort", "clear_cache": False}, pauses
    assert segment.finish_reason == "abort" or segment.num_cached_tokens == 0, segment
    after = await engine.generate("transit-after", prompt_ids=PROMPT, sampling_params=PARAMS)
    assert after.num_cached_tokens == 0  # the new weights compute their own KV
    assert report.global_steps == engine.global_steps


async def test_recompute_still_clears_vllms_cache(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recompute`` needs vLLM's clear (it preempts the kept requests, so the new weights
    compute their KV again); ``abort`` and ``keep`` skip it."""
    seen: list[tuple[str, bool]] = []
    real = compat.pause_generation

    async def spy(llm: Any, *, mode: str, clear_cache: bool) -> None:
        seen.append((mode, clear_cache))
        await real(llm, mode=mode, clear_cache=clear_cache)

    monkeypatch.setattr(compat, "pause_generation", spy)
    for mode in ("abort", "keep", "recompute"):
        await update_weights(
            engine, load_weights(tiny_model_a), global_steps=(engine.global_steps or 0) + 1,
        mode=mode,
        )
    assert seen == [("abort", False), ("keep", False), ("keep", True)]
