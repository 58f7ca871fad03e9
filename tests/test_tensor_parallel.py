"""An engine with ``tensor_parallel_size=2`` takes pushes (the CPU build: two worker processes):
every worker reads the same staging buffers and loads its own shard through vLLM's loaders, and
a push either lands in both workers or in neither."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_helpers import ENGINE_ARGS, greedy, inject_fault, load_weights

from asyncroll import VLLMEngine, WeightPusher, WeightSyncError

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
async def tp_engine(tiny_model_b: Path) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine.launch(
        tiny_model_b, name="tp2", tensor_parallel_size=2, **ENGINE_ARGS
    ) as started:
        yield started


async def test_a_tensor_parallel_engine_takes_pushes_token_exact(
    tp_engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """Pushing A then B back: B's outputs equal what this engine served fresh on B (a fresh
    tensor-parallel engine on B), token for token; A's differ from them."""
    assert tp_engine.weights.num_workers == 2
    fresh_b = await greedy(tp_engine, "tp-fresh-b")
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    pusher = WeightPusher([tp_engine])
    try:
        report = await pusher.update(weights_a, global_steps=1)
        delivery = report.deliveries[tp_engine.name]
        assert (delivery.workers, delivery.tensors) == (2, 2 * len(weights_a))  # each worker all
        on_a = await greedy(tp_engine, "tp-a")
        assert on_a != fresh_b
        await pusher.update(weights_b, global_steps=2)
        assert await greedy(tp_engine, "tp-b") == fresh_b
        assert tp_engine.global_steps == 2
        await pusher.update(weights_a, global_steps=3)
        assert await greedy(tp_engine, "tp-a-again") == on_a
    finally:
        await pusher.update(weights_b, global_steps=4)
        await pusher.aclose()


async def test_a_push_failing_in_one_worker_rolls_both_back(
    tp_engine: VLLMEngine, tiny_model_a: Path
) -> None:
    fresh = await greedy(tp_engine, "tp-before")  # B (the test above leaves B)
    steps = tp_engine.global_steps or 0
    pusher = WeightPusher([tp_engine])
    try:
        # Worker 1 fails, worker 0 loads everything: both must end on B.
        async with inject_fault(tp_engine, "load", tensor="model.norm.weight", rank=1):
            with pytest.raises(WeightSyncError, match="previous weights") as failed:
                await pusher.update(load_weights(tiny_model_a), global_steps=steps + 1)
        assert "rank1" in str(failed.value)  # the failing worker is named
        assert tp_engine.global_steps == steps
        assert await greedy(tp_engine, "tp-after-failed") == fresh
        await pusher.update(load_weights(tiny_model_a), global_steps=steps + 1)  # goes on
        assert await greedy(tp_engine, "tp-after-retry") != fresh
    finally:
        await pusher.aclose()
