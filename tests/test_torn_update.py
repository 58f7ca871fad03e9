"""Tensors that change while ``update_weights`` reads them fail the update: the engine keeps
its old weights under its old label, never a mix of the two under the new one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import FRESH_GREEDY, greedy, load_weights, update_weights

from asyncroll import VLLMEngine, WeightSyncError

pytestmark = pytest.mark.engine

FUSED = "model.layers.0.self_attn.q_proj.weight"
"""vLLM fuses it into qkv_proj: its loaded bytes cannot be found whole in the model."""


async def test_a_tensor_changed_during_the_update_fails_it_and_the_old_weights_stay(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = load_weights(tiny_model_a)
    steps = (engine.global_steps or 0) + 1
    await update_weights(engine, weights, global_steps=steps)
    served = await greedy(engine, "torn-before")
    assert served == FRESH_GREEDY["a"]
    real_pause = engine.pause

    async def pause(*args: Any, **kwargs: Any) -> None:
        weights[FUSED].mul_(-1.0)  # the trainer's tensor moves after the update began
        await real_pause(*args, **kwargs)

    monkeypatch.setattr(engine, "pause", pause)
    with pytest.raises(WeightSyncError, match="changed while update_weights read") as failed:
        await update_weights(engine, weights, global_steps=steps + 1)
    assert FUSED in str(failed.value)
    monkeypatch.undo()
    assert engine.global_steps == steps
    assert await greedy(engine, "torn-after") == served
    report = await update_weights(engine, load_weights(tiny_model_a), global_steps=steps + 1)
    assert report.verified == len(weights)  # every tensor checked, the fused ones too
