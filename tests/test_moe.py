"""Pushes into mixtures of experts: a tiny Qwen3-MoE and a tiny Mixtral (8 experts, 2 a token,
random weights at real architectures), on real vLLM CPU engines, the Mixtral one tensor-parallel
over two workers. Each push is token-exact: pushing the weights an engine started on gives back
what it served fresh, and each pushed model serves its own tokens.

The CPU build keeps expert weights prepacked for its grouped GEMM, and vLLM 0.32's reload skips
that prepack (``asyncroll.vllm.compat.repacking_experts``): without the fix, a reloaded layer is
served unpacked and these tests fail."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
import torch
from engine_helpers import ENGINE_ARGS, greedy, load_weights

from asyncroll import InvalidRequestError, VLLMEngine, WeightPusher, WeightSyncError
from asyncroll.testing import make_tiny_model
from asyncroll.testing.tiny_model import tiny_module

pytestmark = pytest.mark.engine

FAMILIES = {"qwen3_moe": 1, "mixtral": 2}
"""Each family and the tensor-parallel size of its engine (on a GPU machine, at most its GPUs)."""


Models = dict[tuple[str, int], Path]
"""(family, seed) -> a tiny model of that family."""
Engines = dict[str, tuple[VLLMEngine, list[tuple[int, ...]]]]
"""family -> an engine started on seed 1, and its greedy outputs fresh."""


def _steps_after(engine: VLLMEngine) -> Iterator[int]:
    """``global_steps`` for a test's pushes: the module's engines are shared, and versions
    never go back."""
    return itertools.count((engine.global_steps or 0) + 1)


def _tensor_parallel(family: str) -> int:
    if torch.cuda.is_available():
        return min(FAMILIES[family], torch.cuda.device_count())
    return FAMILIES[family]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """(family, seed) -> a tiny model; each engine starts on seed 1 and takes seed 0's weights."""
    return {
        (family, seed): make_tiny_model(
            tmp_path_factory.mktemp(f"{family}-{seed}"), seed=seed, family=family
        )
        for family in FAMILIES
        for seed in (0, 1)
    }


@pytest.fixture(scope="module")
async def moe_engines(
    moe_models: Models,
) -> AsyncIterator[Engines]:
    """family -> (an engine on seed 1, its greedy outputs fresh); started together."""

    async def start(family: str) -> VLLMEngine:
        return await VLLMEngine.start(
            moe_models[family, 1], name=f"moe-{family}",
            tensor_parallel_size=_tensor_parallel(family), **ENGINE_ARGS,
        )

    started = await asyncio.gather(*(start(family) for family in FAMILIES), return_exceptions=True)
    engines = [engine for engine in started if isinstance(engine, VLLMEngine)]
    try:
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        yield {
            family: (engine, await greedy(engine, f"fresh-{family}"))
            for family, engine in zip(FAMILIES, engines, strict=True)
        }
    finally:
        await asyncio.gather(*(engine.aclose() for engine in engines))


@pytest.mark.parametrize("family", FAMILIES)
async def test_pushes_into_experts_are_token_exact(
    family: str,
    moe_engines: Engines,
    moe_models: Models,
) -> None:
    """Seed 0's weights, then seed 1's back (what the engine served fresh, token for token),
    then seed 0's experts alone (a third model), then all of seed 0 again (its first outputs)."""
    engine, fresh = moe_engines[family]
    weights_0, weights_1 = load_weights(moe_models[family, 0]), load_weights(moe_models[family, 1])
    experts_0 = {name: tensor for name, tensor in weights_0.items() if ".experts." in name}
    assert len(experts_0) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    steps = _steps_after(engine)
    async with aclosing(WeightPusher([engine])) as pusher:
        report = await pusher.update(weights_0, global_steps=next(steps))
        delivery = report.deliveries[engine.name]
        workers = _tensor_parallel(family)
        assert (delivery.workers, delivery.tensors) == (workers, workers * len(weights_0))
        on_0 = await greedy(engine, f"{family}-0")
        assert on_0 != fresh
        await pusher.update(weights_1, global_steps=next(steps))
        assert await greedy(engine, f"{family}-1") == fresh
        await pusher.update(experts_0, global_steps=next(steps))
        mixed = await greedy(engine, f"{family}-experts-0")
        assert mixed not in (fresh, on_0)
        await pusher.update(weights_0, global_steps=next(steps))
        assert await greedy(engine, f"{family}-0-again") == on_0
        await pusher.update(weights_1, global_steps=next(steps))
    assert await greedy(engine, f"{family}-1-again") == fresh


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_transformers_state_dict_with_fused_experts_pushes_as_the_checkpoint(
    family: str,
    moe_engines: Engines,
    moe_models: Models,
) -> None:
    """transformers 5 fuses a mixture's experts in memory (``mlp.experts.gate_up_proj``):
    its ``state_dict`` pushed as it is serves what seed 0's checkpoint serves, token for token
    (``asyncroll.experts``: views under the checkpoint's names, on every vLLM)."""
    engine, fresh = moe_engines[family]
    state = {n: t.detach().to(torch.bfloat16) for n, t in
             tiny_module(seed=0, family=family).state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    steps = _steps_after(engine)
    async with aclosing(WeightPusher([engine])) as pusher:
        await pusher.update(load_weights(moe_models[family, 0]), global_steps=next(steps))
        on_0 = await greedy(engine, f"{family}-checkpoint-0")
        await pusher.update(load_weights(moe_models[family, 1]), global_steps=next(steps))
        report = await pusher.update(state, global_steps=next(steps))
        assert report.deliveries[engine.name].tensors == _tensor_parallel(family) * (
            len(state) - 2 * 2 + 2 * 8 * 3)  # each layer's 2 fused tensors: 8 experts x 3
        assert await greedy(engine, f"{family}-fused-0") == on_0
        await pusher.update(load_weights(moe_models[family, 1]), global_steps=next(steps))
    assert await greedy(engine, f"{family}-fused-undone") == fresh


async def test_one_expert_pushed_alone_lands_as_in_a_whole_push(
    moe_engines: Engines,
    moe_models: Models,
) -> None:
    """A push of one expert of one layer (part of a fused parameter) serves what a whole push
    of the same weights serves: the rest of the layer's experts are kept."""
    engine, fresh = moe_engines["qwen3_moe"]
    weights_0 = load_weights(moe_models["qwen3_moe", 0])
    weights_1 = load_weights(moe_models["qwen3_moe", 1])
    one = {
        name: weights_0[name]
        for name in weights_0
        if name.startswith(("model.layers.0.mlp.experts.0.", "model.layers.0.mlp.experts.5."))
    }
    assert len(one) == 6
    steps = _steps_after(engine)
    async with aclosing(WeightPusher([engine])) as pusher:
        await pusher.update(one, global_steps=next(steps))
        alone = await greedy(engine, "one-expert-alone")
        await pusher.update(weights_1 | one, global_steps=next(steps))
        assert await greedy(engine, "one-expert-whole") == alone
        await pusher.update(weights_1, global_steps=next(steps))
    assert await greedy(engine, "one-expert-undone") == fresh
    assert alone != fresh


async def test_a_direct_load_lands_or_is_refused_where_experts_are_prepacked(
    moe_engines: Engines,
    moe_models: Models,
) -> None:
    """On the CPU build, ``load="direct"`` would copy checkpoint rows into the kernel's packed
    layout: refused with a typed error naming the layer before anything reaches the engine (the
    pusher never attached), and the engine serves what it served.
    On a GPU (its experts in checkpoint layout) the direct load, through the load plan, is
    token-exact."""
    engine, fresh = moe_engines["qwen3_moe"]
    steps = _steps_after(engine)
    weights_0 = load_weights(moe_models["qwen3_moe", 0])
    weights_1 = load_weights(moe_models["qwen3_moe", 1])
    async with aclosing(WeightPusher([engine], load="direct")) as pusher:
        if not torch.cuda.is_available():
            with pytest.raises(InvalidRequestError, match=r"mlp\.experts.*layerwise"):
                await pusher.update(weights_0, global_steps=next(steps))
            assert engine.weights.attached_to is None
            # The workers refuse it too, should a sender not ask first; the engine goes on.
            known, engine.weights.prepacked_experts = engine.weights.prepacked_experts, ()
            try:
                with pytest.raises(WeightSyncError, match=r"mlp\.experts.*layerwise"):
                    await pusher.update(weights_0, global_steps=next(steps))
            finally:
                engine.weights.prepacked_experts = known
            assert await greedy(engine, "after-direct") == fresh
            return
        await pusher.update(weights_0, global_steps=next(steps))
        await pusher.update(weights_1, global_steps=next(steps))
        await pusher.update(weights_1, global_steps=next(steps))  # replayed by the plan
        assert await greedy(engine, "direct-1") == fresh


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two GPUs: vLLM 0.32's CPU build segfaults serving a mixture with expert"
    " parallelism (docs/performance.md, 'Four GPUs')",
)
async def test_pushes_into_an_expert_parallel_engine_are_token_exact(moe_models: Models) -> None:
    """Expert parallelism (``enable_expert_parallel``, TP=2): each worker holds half of each
    layer's experts and loads only those of a whole push. Seed 0's weights, then seed 1's back
    (what the engine served fresh, token for token), then seed 0's again (its first outputs).
    The engine must really split its experts: each worker's fused expert parameters hold
    half of them (``asyncroll_parameter_shapes``)."""
    model_1 = moe_models["qwen3_moe", 1]
    config = json.loads((model_1 / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]  # (transformers 5's)
    async with VLLMEngine.launch(model_1, name="moe-ep", tensor_parallel_size=2,
                                 enable_expert_parallel=True, **ENGINE_ARGS) as engine:
        shapes = await engine.collective_rpc("asyncroll_parameter_shapes")
        held = [{n: s[0] for n, s in worker.items() if n.endswith("experts.w13_weight")}
                for worker in shapes]
        assert len(held) == 2 and all(held), shapes
        assert all(n == experts // 2 for worker in held for n in worker.values()), held
        fresh = await greedy(engine, "ep-fresh")
        steps = _steps_after(engine)
        async with aclosing(WeightPusher([engine])) as pusher:
            await pusher.update(load_weights(moe_models["qwen3_moe", 0]), global_steps=next(steps))
            on_0 = await greedy(engine, "ep-0")
            assert on_0 != fresh
            await pusher.update(load_weights(model_1), global_steps=next(steps))
            assert await greedy(engine, "ep-1") == fresh
            await pusher.update(load_weights(moe_models["qwen3_moe", 0]), global_steps=next(steps))
            assert await greedy(engine, "ep-0-again") == on_0
