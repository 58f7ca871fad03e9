"""Weights into real vLLM engines through asyncroll's backend of vLLM's native protocol."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest
import torch
from engine_helpers import FRESH_GREEDY, PROMPT_PARAMS, greedy, load_weights

from asyncroll import EngineSleepingError, InvalidRequestError, VLLMEngine, WeightSyncError
from asyncroll.weights import WeightPusher

pytestmark = pytest.mark.engine


async def _next_steps(engine: VLLMEngine) -> int:
    return (engine.global_steps or 0) + 1


async def test_push_is_token_exact_and_reversible(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    assert FRESH_GREEDY["a"] != FRESH_GREEDY["b"], "the two models must differ"
    steps = await _next_steps(engine)
    report = await engine.update_weights(weights_b, global_steps=steps)
    assert report.push is not None and report.push.tensors == len(weights_b)
    assert await greedy(engine, "pushed-b") == FRESH_GREEDY["b"]
    await engine.update_weights(weights_a, global_steps=steps + 1)
    assert await greedy(engine, "pushed-a") == FRESH_GREEDY["a"]


async def test_tokens_after_update_carry_its_global_steps(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    steps = max(7, await _next_steps(engine))
    await engine.update_weights(load_weights(tiny_model_a), global_steps=steps)
    segments = await asyncio.gather(
        *(
            engine.generate(f"v{i}", prompt_ids=[3, 4, i + 5], sampling_params=PROMPT_PARAMS)
            for i in range(4)
        )
    )
    for segment in segments:
        assert segment.global_steps == (steps,) * len(segment.token_ids)
    assert engine.statistics().global_steps == steps


async def test_keep_mode_request_spans_both_versions(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    before = engine.global_steps
    assert before is not None
    long = asyncio.create_task(
        engine.generate(
            "spanning",
            prompt_ids=[5, 6, 7],
            sampling_params={"max_tokens": 300, "ignore_eos": True},
        )
    )
    await engine.generate("clock", prompt_ids=[9, 9], sampling_params=PROMPT_PARAMS)
    await engine.update_weights(load_weights(tiny_model_a), global_steps=before + 1, mode="keep")
    segment = await long
    assert segment.finish_reason == "length" and len(segment.token_ids) == 300
    switch = segment.global_steps.index(before + 1)
    assert 0 < switch < 300
    assert segment.global_steps == (before,) * switch + (before + 1,) * (300 - switch)


async def test_lower_version_is_refused(engine: VLLMEngine, tiny_model_a: Path) -> None:
    current = engine.global_steps
    assert current is not None and current > 0
    with pytest.raises(InvalidRequestError, match="backwards"):
        await engine.update_weights(load_weights(tiny_model_a), global_steps=current - 1)
    assert engine.global_steps == current


async def test_push_while_asleep_is_refused(engine: VLLMEngine, tiny_model_a: Path) -> None:
    await engine.sleep(1)
    try:
        with pytest.raises(EngineSleepingError):
            await engine.update_weights(
                load_weights(tiny_model_a), global_steps=await _next_steps(engine)
            )
    finally:
        await engine.wake_up()
    assert await greedy(engine, "after-sleep") == FRESH_GREEDY["a"]


async def test_receiver_failure_keeps_old_weights_and_version(
    engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    before = engine_b.global_steps
    served_before = await greedy(engine_b, "before-failure")  # whatever it serves now
    pusher = WeightPusher([engine_b], fail_on="model.layers.1.mlp.down_proj.weight")
    try:
        with pytest.raises(WeightSyncError, match="down_proj"):
            # push the model it does not serve, so a partial load would change its outputs
            other = tiny_model_a if served_before == FRESH_GREEDY["b"] else tiny_model_b
            await pusher.update(load_weights(other), global_steps=(before or 0) + 5)
    finally:
        await pusher.aclose()
    assert engine_b.global_steps == before
    assert not engine_b.is_dead and not engine_b.is_paused
    assert await greedy(engine_b, "after-failure") == served_before


def _rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20


async def test_thirty_pushes_keep_memory_bounded(engine: VLLMEngine, tiny_model_a: Path) -> None:
    weights = load_weights(tiny_model_a)
    steps = await _next_steps(engine)
    for i in range(5):  # warm up allocators and caches
        await engine.update_weights(weights, global_steps=steps + i)
    baseline = _rss_mib(psutil.Process().pid)
    for i in range(30):
        await engine.update_weights(weights, global_steps=steps + 5 + i)
    growth = _rss_mib(psutil.Process().pid) - baseline
    assert growth < 64, f"trainer + engine resident memory grew {growth:.0f} MiB over 30 pushes"
    assert await greedy(engine, "after-30") == FRESH_GREEDY["a"]


async def test_bad_tensors_are_rejected_before_any_push(engine: VLLMEngine) -> None:
    with pytest.raises(InvalidRequestError):
        await engine.update_weights({}, global_steps=None)
    with pytest.raises(InvalidRequestError):
        await engine.update_weights([("x", [1, 2])], global_steps=None)  # type: ignore[list-item]
    assert torch.is_tensor(torch.zeros(1))
