"""What an update is given: tensors it cannot push are refused before any pause, and an update
said to change the weights warns when they equal the previous update's, however that one was
called."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from engine_helpers import load_weights

from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    UnchangedWeightsWarning,
    VLLMEngine,
    WeightPusher,
)
from asyncroll.testing import FakeEngine
from asyncroll.testing.fake_engine import FakeWeightUpdater


@pytest.mark.parametrize(
    "tensor",
    [torch.empty(4, 4, device="meta"), torch.eye(4).to_sparse()],
    ids=["meta", "sparse"],
)
async def test_a_tensor_without_dense_values_is_refused_before_any_pause(
    tensor: torch.Tensor,
) -> None:
    engine = FakeEngine(name="a")
    async with AsyncServerManager([engine], weights=FakeWeightUpdater([engine])) as manager:
        with pytest.raises(InvalidRequestError, match=r"'w' is a .* tensor on the .* device"):
            await manager.update_weights([("w", tensor)], global_steps=1)
        assert not engine.statistics().paused and manager.global_steps == 0


@pytest.mark.engine
async def test_changed_warns_after_an_update_that_did_not_ask(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """The previous update's fingerprints are the ones its verification took, where it was
    not itself called with ``changed=True``."""
    pusher = WeightPusher([engine])
    try:
        steps = (engine.global_steps or 0) + 1
        await pusher.update(load_weights(tiny_model_a), global_steps=steps)
        with pytest.warns(UnchangedWeightsWarning, match="equal the previous update's"):
            await pusher.update(load_weights(tiny_model_a), global_steps=steps + 1, changed=True)
        moved = load_weights(tiny_model_a)
        moved["model.norm.weight"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnchangedWeightsWarning)
            await pusher.update(moved, global_steps=steps + 2, changed=True)
        await pusher.update(load_weights(tiny_model_a), global_steps=steps + 3)
    finally:
        await pusher.aclose()
