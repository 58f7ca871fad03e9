"""The pure side of LoRA adapters: names, checks against a layout, the revision table."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from asyncroll import InvalidRequestError
from asyncroll.adapters import (
    AdapterConfig,
    AdapterLayout,
    AdapterRevision,
    Revisions,
    adapter_tensors,
    check_adapter,
    check_adapter_name,
    check_finite,
    decoder_shapes,
)

LAYOUT = AdapterLayout(
    max_rank=8, slots=2, resident=3, modules=frozenset({"q_proj", "down_proj"}),
    shapes={"model.layers.0.self_attn.q_proj": (64, 32), "model.layers.0.mlp.down_proj": (32, 96)},
)
CONFIG = AdapterConfig(rank=4, alpha=8)


def lora(
    module: str, out_features: int, in_features: int, rank: int = 4
) -> dict[str, torch.Tensor]:
    return {
        f"base_model.model.{module}.lora_A.weight": torch.ones(rank, in_features),
        f"base_model.model.{module}.lora_B.weight": torch.ones(out_features, rank),
    }


def test_peft_names_with_or_without_the_prefix_and_adapter_name_come_out_as_peft_names() -> None:
    a, b = torch.ones(4, 32), torch.ones(64, 4)
    for given in (
        {"model.layers.0.self_attn.q_proj.lora_A.weight": a,
         "model.layers.0.self_attn.q_proj.lora_B.weight": b},
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": a,
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": b},
    ):
        assert sorted(adapter_tensors(given)) == [
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        ]


@pytest.mark.parametrize("tensors", [
    {},
    {"model.layers.0.self_attn.q_proj.weight": torch.ones(64, 32)},
    {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32)},
    {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32, dtype=torch.int64),
     "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4)},
    {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4),
     "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4)},
    [("model.x.lora_A.weight", torch.ones(4, 3)), ("base_model.model.model.x.lora_A.weight",
                                                   torch.ones(4, 3))],
], ids=["none", "not-lora", "a-without-b", "integers", "not-a-matrix", "twice"])
def test_tensors_that_are_no_lora_are_refused(tensors: object) -> None:
    with pytest.raises(InvalidRequestError):
        adapter_tensors(tensors)  # type: ignore[arg-type]


def test_an_adapter_that_fits_the_layout_passes() -> None:
    tensors = {**lora("model.layers.0.self_attn.q_proj", 64, 32),
               **lora("model.layers.0.mlp.down_proj", 32, 96)}
    check_adapter(tensors, CONFIG, LAYOUT, engine="e")


@pytest.mark.parametrize(("tensors", "config", "match"), [
    (lora("model.layers.0.self_attn.q_proj", 64, 32, rank=16), AdapterConfig(rank=16, alpha=1),
     "max_lora_rank"),
    (lora("model.layers.0.self_attn.q_proj", 64, 32, rank=2), CONFIG, "not of rank 4"),
    (lora("model.layers.0.self_attn.k_proj", 64, 32), CONFIG, "does not cover"),
    (lora("model.layers.9.self_attn.q_proj", 64, 32), CONFIG, "no such module"),
    (lora("model.layers.0.self_attn.q_proj", 32, 64), CONFIG, "do not fit"),
])
def test_an_adapter_that_does_not_fit_is_refused(
    tensors: dict[str, torch.Tensor], config: AdapterConfig, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        check_adapter(tensors, config, LAYOUT, engine="e")


def test_non_finite_values_are_refused() -> None:
    tensors = lora("model.layers.0.self_attn.q_proj", 64, 32)
    next(iter(tensors.values()))[0, 0] = float("inf")
    with pytest.raises(InvalidRequestError, match="non-finite"):
        check_finite(tensors)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_ranks_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequestError):
        AdapterConfig(rank=bad, alpha=8)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "has space", "x" * 65, None, "a/b"])
def test_bad_adapter_names_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequestError):
        check_adapter_name(bad)


def test_revisions_have_names_of_their_own_for_the_prefix_cache() -> None:
    one, two = AdapterRevision.next("math", 1), AdapterRevision.next("math", 1)
    assert one.revision != two.revision and one.lora_name != two.lora_name


async def test_a_pinned_revision_is_never_droppable_and_its_last_call_wakes_a_waiting_update(
) -> None:
    table = Revisions()
    first = AdapterRevision.next("a", 1)
    table.add(first)
    with table.pinned("a") as pinned:
        assert pinned == first
        second = AdapterRevision.next("a", 2)
        table.add(second)
        assert table.droppable() == []  # the first is pinned, the second is the newest
        waiting = asyncio.ensure_future(table.unpinned())
        await asyncio.sleep(0)
        assert not waiting.done()
    await waiting  # the call ended
    assert table.droppable() == [first]
    with table.pinned("a") as pinned:
        assert pinned == second  # new calls start on the newest


def test_a_call_on_an_adapter_never_pushed_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="no revision"), Revisions().pinned("x"):
        pass


def test_decoder_shapes_from_a_config_match_the_checkpoint_of_the_same_config(
    tmp_path: Path,
) -> None:
    from asyncroll.testing import TINY_CONFIG, make_tiny_model
    from asyncroll.update_check import read_checkpoint_schema

    for family in ("qwen2", "qwen3", "llama"):
        model = make_tiny_model(tmp_path / family, family=family)
        config = json.loads((model / "config.json").read_text())
        schema = read_checkpoint_schema(model)
        assert schema is not None
        from_checkpoint = {
            n.removesuffix(".weight"): tuple(spec.shape)
            for n, spec in schema.tensors.items() if n.endswith("_proj.weight")
        }
        assert decoder_shapes(config) == from_checkpoint, family
    assert decoder_shapes({"hidden_size": 8}) == {}
    assert TINY_CONFIG["num_hidden_layers"] * 7 == len(from_checkpoint)
