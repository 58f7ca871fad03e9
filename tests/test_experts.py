"""``asyncroll.experts``: a transformers-5 mixture's fused experts under the checkpoint's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncroll.errors import InvalidRequestError
from asyncroll.experts import expert_parts, unfused_experts, unfusing
from asyncroll.testing.tiny_model import MOE_FAMILIES, make_tiny_model, tiny_module
from asyncroll.transport import LazyTensor


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_fused_experts_become_the_checkpoints_tensors_as_views(
    tmp_path: Path, family: str
) -> None:
    """The state_dict of the transformers model ``make_tiny_model`` writes, unfused against
    the checkpoint's names, is the checkpoint, tensor for tensor (Mixtral's router moved under
    ``block_sparse_moe`` too); each expert a view of its fused tensor, not a copy."""
    checkpoint = load_file(str(make_tiny_model(tmp_path, seed=2, family=family) /
                               "model.safetensors"))
    state = {n: t.detach().to(torch.bfloat16) for n, t in
             tiny_module(seed=2, family=family).state_dict().items()}
    assert any(n.endswith("experts.gate_up_proj") for n in state)
    unfused = unfused_experts(state, set(checkpoint))
    assert set(unfused) == set(checkpoint)
    assert all(torch.equal(unfused[n], checkpoint[n]) for n in checkpoint)
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    up = "w3" if family == "mixtral" else "up_proj"
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    view = unfused[f"model.layers.1.{moe}.experts.5.{up}.weight"]
    assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert view.is_contiguous()


def test_names_the_checkpoint_lacks_and_other_tensors_stay_as_they_are() -> None:
    fused = torch.zeros(4, 6, 3)
    flat = torch.zeros(6, 3)
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": fused,
               "model.layers.0.mlp.experts.down_proj": flat,  # not 3-dimensional
               "model.norm.weight": torch.ones(3)}
    assert unfused_experts(tensors, {"model.norm.weight"}) == tensors  # no per-expert names
    known = {"model.layers.0.mlp.experts.0.gate_proj.weight"}
    out = unfused_experts(tensors, known)
    assert out["model.layers.0.mlp.experts.down_proj"] is flat
    assert [n for n in out if ".experts.3." in n] == [
        "model.layers.0.mlp.experts.3.gate_proj.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight",
    ]
    assert out["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (3, 3)


def test_a_fused_tensor_that_is_not_whole_and_local_or_a_name_given_twice_is_refused() -> None:
    known = {"model.layers.0.mlp.experts.0.gate_proj.weight"}
    fused = torch.zeros(2, 4, 3)
    with pytest.raises(InvalidRequestError, match="given twice"):
        unfused_experts({"model.layers.0.mlp.experts.gate_up_proj": fused,
                         "model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(2, 3)}, known)
    lazy = LazyTensor(shape=(2, 4, 3), dtype=torch.float32, device=torch.device("cpu"),
                      make=lambda: fused)
    with pytest.raises(InvalidRequestError, match=r"whole local tensor.*per expert"):
        unfused_experts({"model.layers.0.mlp.experts.gate_up_proj": lazy}, known)


def test_the_plan_from_names_alone_gives_each_experts_rows_and_moves_the_router() -> None:
    """What a sharded trainer's ranks follow (``unfusing``, names only): each fused name's
    block and projections in the checkpoint, and Mixtral's router under its checkpoint name;
    ``expert_parts`` gives each expert's rows of the fused tensor."""
    known = {"m.layers.0.block_sparse_moe.experts.0.w1.weight",
             "m.layers.0.block_sparse_moe.gate.weight"}
    names = ["m.layers.0.mlp.experts.gate_up_proj", "m.layers.0.mlp.experts.down_proj",
             "m.layers.0.mlp.gate.weight", "m.layers.1.mlp.experts.down_proj"]
    plan = unfusing(names, known)
    assert plan.blocks == {
        "m.layers.0.mlp.experts.gate_up_proj":
            ("gate_up_proj", "m.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2")),
        "m.layers.0.mlp.experts.down_proj":
            ("down_proj", "m.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2")),
    }  # layer 1's experts: not in the checkpoint, left for the update's check to name
    assert plan.renames == {"m.layers.0.mlp.gate.weight": "m.layers.0.block_sparse_moe.gate.weight"}
    assert not unfusing(["m.layers.0.mlp.experts.down_proj"], set())
    block = "m.layers.0.block_sparse_moe.experts"
    assert expert_parts(block, "gate_up_proj", (2, 6, 4), ("w1", "w3", "w2")) == [
        (f"{block}.0.w1.weight", 0, slice(0, 3)), (f"{block}.0.w3.weight", 0, slice(3, 6)),
        (f"{block}.1.w1.weight", 1, slice(0, 3)), (f"{block}.1.w3.weight", 1, slice(3, 6)),
    ]
    with pytest.raises(InvalidRequestError, match="an even count"):
        expert_parts(block, "gate_up_proj", (2, 5, 4), ("w1", "w3", "w2"))
    assert expert_parts(block, "down_proj", (2, 4, 3), ("w1", "w3", "w2")) == [
        (f"{block}.0.w2.weight", 0, slice(0, 4)), (f"{block}.1.w2.weight", 1, slice(0, 4)),
    ]
