"""asyncroll.update_check: an update is checked against the checkpoint before any engine pauses.

No engine: the schema comes from a tiny model's safetensors headers, the update from its tensors.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncroll.errors import InvalidRequestError
from asyncroll.testing import make_tiny_model
from asyncroll.update_check import Schema, TensorSpec, check_update, read_checkpoint_schema

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("update-check"), seed=0)


@pytest.fixture(scope="module")
def schema(model: Path) -> Schema:
    read = read_checkpoint_schema(model)
    assert read is not None
    return read


@pytest.fixture
def weights(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def _rejected(tensors: dict[str, torch.Tensor], schema: Schema | None, **options: bool) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        check_update(tensors, schema, served_dtype=BF16, **options)
    return str(caught.value)


def _untied_copy(model: Path, folder: Path, *, tie: bool | None) -> Path:
    """The tiny model without ``lm_head.weight``, its config saying ``tie`` (None: no key)."""
    folder.mkdir()
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config.pop("tie_word_embeddings")
    if tie is not None:
        config["tie_word_embeddings"] = tie
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- the schema ------------------------------------------------------------------------------


def test_schema_holds_every_checkpoint_tensor(
    schema: Schema, weights: dict[str, torch.Tensor]
) -> None:
    assert set(schema.tensors) == set(weights)
    assert schema.tensors[Q_PROJ] == TensorSpec(shape=(128, 128), dtype=BF16)
    assert schema.tensors[NORM] == TensorSpec(shape=(128,), dtype=BF16)
    assert schema.tied_embeddings is False


def test_a_folder_without_safetensors_has_no_schema(model: Path, tmp_path: Path) -> None:
    shutil.copy(model / "config.json", tmp_path / "config.json")  # as for load_format="dummy"
    assert read_checkpoint_schema(tmp_path) is None
    assert read_checkpoint_schema(tmp_path / "missing") is None
    assert read_checkpoint_schema("Qwen/Qwen2-0.5B") is None  # a hub id is no local folder


def test_sharded_checkpoint_is_read_from_the_files_its_index_names(
    model: Path, tmp_path: Path, weights: dict[str, torch.Tensor]
) -> None:
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[:10],
        "model-00002-of-00002.safetensors": names[10:],
    }
    for shard, members in shards.items():
        save_file({name: weights[name] for name in members}, str(tmp_path / shard))
    shutil.copy(model / "config.json", tmp_path / "config.json")
    without_index = read_checkpoint_schema(tmp_path)
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    weight_map = {name: shard for shard, members in shards.items() for name in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    with_index = read_checkpoint_schema(tmp_path)

    assert without_index is not None and with_index is not None
    assert set(without_index.tensors) == set(with_index.tensors) == set(weights)
    check_update(weights, with_index, served_dtype=BF16)
    message = _rejected({"stray.weight": torch.zeros(2)}, with_index)
    assert "'stray.weight': unknown tensor name" in message


# -- updates that pass -----------------------------------------------------------------------


def test_full_update_passes(schema: Schema, weights: dict[str, torch.Tensor]) -> None:
    check_update(weights, schema, served_dtype=BF16)


def test_partial_update_passes(schema: Schema, weights: dict[str, torch.Tensor]) -> None:
    check_update({Q_PROJ: weights[Q_PROJ], NORM: weights[NORM]}, schema, served_dtype=BF16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_float_of_another_width_passes_unless_strict(
    schema: Schema, weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    update = {Q_PROJ: weights[Q_PROJ].to(dtype)}
    check_update(update, schema, served_dtype=BF16)
    message = _rejected(update, schema, strict_dtype=True)
    assert f"{Q_PROJ!r}: dtype {dtype} given, torch.bfloat16 served (strict_dtype)" in message


def test_strict_dtype_passes_the_served_dtype(
    schema: Schema, weights: dict[str, torch.Tensor]
) -> None:
    check_update(weights, schema, served_dtype=BF16, strict_dtype=True)
    with pytest.raises(InvalidRequestError, match=r"torch\.float32 served"):
        check_update({NORM: weights[NORM]}, schema, served_dtype=torch.float32, strict_dtype=True)


@pytest.mark.parametrize(("dtype", "value"), [(torch.bfloat16, 3.0e38), (torch.float16, 60000.0)])
def test_huge_but_finite_values_pass(schema: Schema, dtype: torch.dtype, value: float) -> None:
    huge = torch.full((512, 128), value, dtype=dtype)
    assert not torch.isfinite(torch.sum(huge))  # a sum would overflow
    check_update({EMBED: huge}, schema, served_dtype=BF16)


def test_empty_and_strided_tensors_are_checked(schema: Schema) -> None:
    check_update({"empty": torch.empty(0, 4)}, None, served_dtype=BF16)
    strided = torch.zeros(128, 128, dtype=BF16).t()
    strided[3, 7] = float("nan")
    assert not strided.is_contiguous()
    assert Q_PROJ in _rejected({Q_PROJ: strided}, schema)


# -- updates that are rejected ---------------------------------------------------------------


def test_unknown_name_lists_close_names(schema: Schema, weights: dict[str, torch.Tensor]) -> None:
    typo = "model.layers.0.self_attn.q_proj.weigth"
    message = _rejected({typo: weights[Q_PROJ], NORM: weights[NORM]}, schema)
    assert message.startswith("weight update rejected, 1 problem: ")
    assert f"{typo!r}: unknown tensor name (closest: {Q_PROJ!r}" in message


def test_unknown_name_far_from_any(schema: Schema) -> None:
    message = _rejected({"optimizer.step": torch.zeros(1)}, schema)
    assert "'optimizer.step': unknown tensor name (none close)" in message


def test_wrong_shapes_of_a_fused_group_member_and_a_norm(
    schema: Schema, weights: dict[str, torch.Tensor]
) -> None:
    update = {
        **weights,
        Q_PROJ: torch.zeros(64, 128, dtype=BF16),
        NORM: torch.ones(256, dtype=BF16),
    }
    message = _rejected(update, schema)
    assert "2 problems" in message
    assert f"{Q_PROJ!r}: shape (64, 128) given, (128, 128) expected" in message
    assert f"{NORM!r}: shape (256,) given, (128,) expected" in message


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64, torch.complex64])
def test_non_floating_tensor_for_a_floating_parameter(
    schema: Schema, weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    update = {Q_PROJ: weights[Q_PROJ], NORM: torch.ones(128, dtype=dtype)}
    message = _rejected(update, schema)
    assert (
        f"{NORM!r}: dtype {dtype} given, torch.bfloat16 expected (a floating parameter)" in message
    )
    assert Q_PROJ not in message


def test_a_non_floating_parameter_takes_only_its_dtype(tmp_path: Path) -> None:
    save_file({"position_ids": torch.arange(8)}, str(tmp_path / "model.safetensors"))
    schema = read_checkpoint_schema(tmp_path)
    check_update({"position_ids": torch.arange(8)}, schema, served_dtype=BF16, strict_dtype=True)
    message = _rejected({"position_ids": torch.arange(8.0)}, schema)
    assert "'position_ids': dtype torch.float32 given, torch.int64 expected" in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values(
    schema: Schema, weights: dict[str, torch.Tensor], dtype: torch.dtype, bad: float
) -> None:
    poisoned = weights[Q_PROJ].to(dtype)
    poisoned[77, 5] = bad
    message = _rejected({NORM: weights[NORM], Q_PROJ: poisoned}, schema)
    assert message == f"weight update rejected, 1 problem: {Q_PROJ!r}: has NaN or inf values"


def test_non_finite_values_pass_without_check_finite(schema: Schema) -> None:
    check_update(
        {NORM: torch.full((128,), float("nan"), dtype=BF16)},
        schema,
        served_dtype=BF16,
        check_finite=False,
    )


def test_fp8_values_are_checked_too() -> None:
    update = {"w": torch.tensor([1.0, 2.0, float("nan")]).to(torch.float8_e4m3fn)}
    assert "'w': has NaN or inf values" in _rejected(update, None)


def test_every_problem_is_counted_and_the_first_five_listed(
    schema: Schema, weights: dict[str, torch.Tensor]
) -> None:
    update = {f"module.{name}": tensor for name, tensor in weights.items()}
    message = _rejected(update, schema)
    assert f"weight update rejected, {len(weights)} problems: " in message
    assert message.count("unknown tensor name") == 5
    assert message.endswith(f"; and {len(weights) - 5} more")
    first = next(iter(weights))
    assert f"'module.{first}': unknown tensor name (closest: {first!r}" in message


# -- no schema -------------------------------------------------------------------------------


def test_without_a_schema_only_dtype_kind_and_finiteness_are_checked() -> None:
    check_update(
        {"anything": torch.zeros(3, 5), "other": torch.ones(2, dtype=torch.float16)},
        None,
        served_dtype=BF16,
    )
    message = _rejected(
        {"ids": torch.zeros(3, dtype=torch.int32), "nan": torch.tensor([float("nan")])}, None
    )
    assert "2 problems" in message
    assert (
        "'ids': dtype torch.int32 given, torch.bfloat16 expected (a floating parameter)" in message
    )
    assert "'nan': has NaN or inf values" in message


# -- tied embeddings -------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, None])
def test_tied_embeddings_accept_lm_head_of_the_embedding_shape(
    model: Path, tmp_path: Path, weights: dict[str, torch.Tensor], tie: bool | None
) -> None:
    schema = read_checkpoint_schema(_untied_copy(model, tmp_path / "tied", tie=tie))
    assert schema is not None and schema.tied_embeddings
    assert "lm_head.weight" not in schema.tensors
    check_update(weights, schema, served_dtype=BF16)
    message = _rejected({"lm_head.weight": torch.zeros(512, 64, dtype=BF16)}, schema)
    assert "'lm_head.weight': shape (512, 64) given, (512, 128) expected" in message


def test_untied_checkpoint_without_lm_head_rejects_it(
    model: Path, tmp_path: Path, weights: dict[str, torch.Tensor]
) -> None:
    schema = read_checkpoint_schema(_untied_copy(model, tmp_path / "headless", tie=False))
    assert schema is not None and not schema.tied_embeddings
    message = _rejected({"lm_head.weight": weights["lm_head.weight"]}, schema)
    assert "'lm_head.weight': unknown tensor name" in message


# -- devices and dtypes ----------------------------------------------------------------------

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
SWEPT = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]


def _sweep(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of many sizes (across the chunks of a multi-tensor kernel), some with one bad
    value at a random place, one strided, one huge but finite."""
    generator = torch.Generator().manual_seed(0)
    update: dict[str, torch.Tensor] = {}
    for size in (1, 7, 65535, 65536, 65537, 300_001, 2_000_003):
        for kind, value in (("ok", 0.0), ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):
            values = torch.randn(size, generator=generator)
            if kind != "ok":
                values[int(torch.randint(size, (1,), generator=generator))] = value
            update[f"{kind}.{size}"] = values.to(device, dtype)
    strided = torch.zeros(64, 64)
    strided[3, 6] = math.nan
    update["strided"] = strided.to(device, dtype)[:, ::2]
    update["huge"] = torch.full((1000,), 448.0 if dtype.itemsize == 1 else 6e4).to(device, dtype)
    return update


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SWEPT)
def test_every_bad_tensor_is_found(device: str, dtype: torch.dtype) -> None:
    update = _sweep(device, dtype)
    bad = {name for name, t in update.items() if not torch.isfinite(t.cpu().double()).all()}
    # e4m3 has no inf: casting one gives NaN or saturates, by torch version and device.
    assert len(bad) == 22 or (dtype == torch.float8_e4m3fn and len(bad) >= 8)
    message = _rejected(update, None)
    assert f"rejected, {len(bad)} problems: " in message
    for name, tensor in update.items():
        if name in bad:
            assert repr(name) in _rejected({name: tensor}, None)
        else:
            check_update({name: tensor}, None, served_dtype=BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_tensors_mixed_with_cpu_ones(
    schema: Schema, weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    update = {name: tensor.to("cuda", dtype) for name, tensor in weights.items()}
    update[NORM] = weights[NORM]  # stays on the CPU
    check_update(update, schema, served_dtype=BF16)
    update[Q_PROJ][1, 2] = float("nan")
    message = _rejected(update, schema)
    assert message == f"weight update rejected, 1 problem: {Q_PROJ!r}: has NaN or inf values"


async def test_the_values_are_read_against_the_first_live_engine_when_an_earlier_one_died(
    tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """A channel over engines of two checkpoints: once the engine of the first one it read
    has died, the values are still read for NaN and inf (against the live engine's model),
    and ``values_read`` says so; ``finite=False`` reads none."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from asyncroll.weights import SenderChannel

    def stub(name: str, path: Path) -> Any:
        return SimpleNamespace(name=name, model_path=str(path), is_dead=False,
                               weights=SimpleNamespace(served_dtype=torch.float32))

    first, second = stub("a", tiny_model_a), stub("b", tiny_model_b)
    channel = SenderChannel([first, second], load="layerwise")
    tensors = load_file(str(tiny_model_b / "model.safetensors"))
    await channel.check(tensors)  # both checkpoints read, in this order
    assert channel.values_read
    first.is_dead = True
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    with pytest.raises(InvalidRequestError, match="NaN or inf"):
        await channel.check(bad)
    await channel.check(bad, finite=False)  # (an earlier group read them: prechecked)
    assert not channel.values_read
