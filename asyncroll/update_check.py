"""Checks a weight update against what the engine serves, before any engine pauses.

The schema is read once from the headers of the ``*.safetensors`` files of the model folder the
engine was started from (never the tensor data). Each tensor of an update is checked for:

- name: one of the checkpoint's; with tied embeddings also ``lm_head.weight``, which vLLM's
  loaders skip, when it has the embedding's shape;
- shape: exactly the checkpoint's;
- dtype: a floating parameter takes any floating tensor (vLLM casts on load) but no integer,
  bool or complex one; a non-floating parameter takes only its own dtype; with ``strict_dtype``
  only the dtype the engine serves in passes;
- values: finite (no NaN, no inf), when ``check_finite``.

Without a schema (no safetensors in the folder, e.g. ``load_format="dummy"``) only the dtype kind
and finiteness are checked. A partial update (a subset of the names) is fine.

Invariants: pure and synchronous, the tensors are only read; every problem is reported in one
``InvalidRequestError`` (the first few listed, with a count); the finite check reads each tensor
once with no tensor-sized temporary (fp8 aside: widened first), exact whatever the magnitudes,
and syncs with each device once.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open

from asyncroll.errors import InvalidRequestError

__all__ = ["Schema", "TensorSpec", "check_update", "nonfinite", "read_checkpoint_schema"]

MAX_LISTED = 5
"""Problems spelled out in the error; the rest are only counted."""

_SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}
"""Header dtype names torch reads; any other (packed formats) leaves the dtype unchecked."""

_TIED_HEADS: Sequence[tuple[str, str]] = (
    ("lm_head.weight", "model.embed_tokens.weight"),
    ("lm_head.weight", "model.language_model.embed_tokens.weight"),
    ("lm_head.weight", "transformer.wte.weight"),
    ("language_model.lm_head.weight", "language_model.model.embed_tokens.weight"),
)
"""(output head, the embedding it is tied to) in the Hugging Face layouts vLLM loads."""

_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes ``torch.aminmax`` reduces in place."""

_WIDENED = frozenset(
    {
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    }
)
"""fp8 dtypes, which ``aminmax`` lacks: widened to bf16 (exact) first. Packed fp4 has no NaN."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """What the engine expects of one named tensor (``dtype`` None: a format torch lacks)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Schema:
    """The tensors of an engine's checkpoint, by Hugging Face name."""

    tensors: Mapping[str, TensorSpec]
    tied_embeddings: bool


def read_checkpoint_schema(model_path: str | Path) -> Schema | None:
    """Read the names, shapes and dtypes of a local checkpoint from its safetensors headers.

    Args:
        model_path: The model folder the engine was started from.

    Returns:
        The schema, or None where the folder holds no safetensors (a hub id, a dummy-format
        folder with only ``config.json``).

    Raises:
        OSError: a listed file is missing or unreadable.
        safetensors.SafetensorError: a header is corrupt.
    """
    folder = Path(model_path)
    files = _checkpoint_files(folder) if folder.is_dir() else []
    if not files:
        return None
    tensors: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                tensors[name] = TensorSpec(shape=tuple(view.get_shape()), dtype=dtype)
    tied = _tied_embeddings(_read_config(folder), tensors)
    return Schema(tensors=MappingProxyType(tensors), tied_embeddings=tied)


def check_update(
    tensors: Mapping[str, torch.Tensor],
    schema: Schema | None,
    *,
    served_dtype: torch.dtype,
    strict_dtype: bool = False,
    check_finite: bool = True,
) -> None:
    """Raise if any tensor of an update does not fit the engine; return None if all do.

    Args:
        tensors: The update, by Hugging Face name (any subset of the checkpoint's names).
        schema: From ``read_checkpoint_schema``; None checks only dtype kind and finiteness.
        served_dtype: The dtype the engine serves in (its model config's dtype).
        strict_dtype: Accept only ``served_dtype`` instead of any floating dtype.
        check_finite: Reject NaN and inf values (reads every tensor once).

    Raises:
        InvalidRequestError: naming each bad tensor with the expected and given shape/dtype.
    """
    problems: list[tuple[str, str]] = []
    for name, tensor in tensors.items():
        texts = _tensor_problems(
            name, tensor, schema, served_dtype=served_dtype, strict_dtype=strict_dtype
        )
        problems += [(name, text) for text in texts]
    if check_finite:
        problems += [(name, "has NaN or inf values") for name in nonfinite(tensors)]
    if problems:
        raise InvalidRequestError(_describe(problems, schema))


# -- reading -------------------------------------------------------------------------------


def _checkpoint_files(folder: Path) -> list[Path]:
    """The shards vLLM loads: those of the index where there is one (other safetensors in the
    folder may hold the same weights in another layout), else every safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / shard for shard in weight_map.values()})
    return sorted(folder.glob("*.safetensors"))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    return config


def _tied_embeddings(config: Mapping[str, Any], tensors: Mapping[str, TensorSpec]) -> bool:
    """From the config (or its ``text_config``); where neither says, a checkpoint with an
    embedding and no output head is tied (``save_pretrained`` omits a class default)."""
    text_config = config.get("text_config") or {}
    tied = config.get("tie_word_embeddings", text_config.get("tie_word_embeddings"))
    if tied is not None:
        return bool(tied)
    return any(head not in tensors and embedding in tensors for head, embedding in _TIED_HEADS)


# -- checking ------------------------------------------------------------------------------


_UNKNOWN = "unknown tensor name"


def _expected(name: str, schema: Schema) -> TensorSpec | None:
    spec = schema.tensors.get(name)
    if spec is None and schema.tied_embeddings:
        for head, embedding in _TIED_HEADS:
            if head == name and embedding in schema.tensors:
                return schema.tensors[embedding]
    return spec


def _tensor_problems(
    name: str,
    tensor: torch.Tensor,
    schema: Schema | None,
    *,
    served_dtype: torch.dtype,
    strict_dtype: bool,
) -> list[str]:
    spec = None if schema is None else _expected(name, schema)
    if schema is not None and spec is None:
        return [_UNKNOWN]
    shape = tuple(tensor.shape)
    problems: list[str] = []
    if spec is not None and shape != spec.shape:
        problems.append(f"shape {shape} given, {spec.shape} expected")
    expected = served_dtype if spec is None else spec.dtype
    return problems + _dtype_problems(
        tensor.dtype, expected, served_dtype=served_dtype, strict_dtype=strict_dtype
    )


def _dtype_problems(
    given: torch.dtype,
    expected: torch.dtype | None,
    *,
    served_dtype: torch.dtype,
    strict_dtype: bool,
) -> list[str]:
    """vLLM casts whatever it is given to its parameter's dtype, an integer tensor as silently
    as a float one: a floating parameter takes any floating tensor (only the served dtype where
    ``strict_dtype``), any other parameter only its own dtype."""
    if expected is None:
        return []
    if not expected.is_floating_point:
        return [] if given == expected else [f"dtype {given} given, {expected} expected"]
    if strict_dtype:
        ok = given == served_dtype
        return [] if ok else [f"dtype {given} given, {served_dtype} served (strict_dtype)"]
    if given.is_floating_point:
        return []
    return [f"dtype {given} given, {expected} expected (a floating parameter)"]


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or an inf, one host sync per device."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.dtype in _REDUCIBLE | _WIDENED and tensor.numel() > 0:
            groups.setdefault((tensor.device, tensor.dtype), []).append(name)
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for (device, _), names in groups.items():
            listed, bounds = by_device.setdefault(device, ([], []))
            listed += names
            bounds += _bounds([tensors[name] for name in names], device)
        return [name for names, bounds in by_device.values() for name in _failing(names, bounds)]


def _bounds(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """0-d tensors, the same number for each tensor, all finite exactly when it is.

    Both reductions propagate NaN and cannot overflow, unlike a sum (a finite bf16 or fp16
    tensor may sum to inf), read each tensor once and allocate nothing tensor-sized. On CPU
    ``aminmax`` runs at memcpy speed (a max-abs norm is over ten times slower); on CUDA, where one
    launch per tensor would cost more than reading it, the max-abs norms of a whole group come
    from one multi-tensor kernel.
    """
    tensors = [t.to(torch.bfloat16) if t.dtype in _WIDENED else t for t in tensors]
    if device.type == "cuda":
        return list(torch._foreach_norm(tensors, ord=math.inf))
    return [bound for tensor in tensors for bound in torch.aminmax(tensor)]


def _failing(names: list[str], bounds: list[torch.Tensor]) -> list[str]:
    rows = torch.stack(bounds).view(len(names), -1).tolist()
    return [name for name, row in zip(names, rows, strict=True) if not _finite(row)]


def _finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(value) for value in values)


def _describe(problems: Sequence[tuple[str, str]], schema: Schema | None) -> str:
    listed = [_line(name, text, schema) for name, text in problems[:MAX_LISTED]]
    more = len(problems) - len(listed)
    tail = f"; and {more} more" if more else ""
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"weight update rejected, {count}: " + "; ".join(listed) + tail


def _line(name: str, text: str, schema: Schema | None) -> str:
    """One problem; an unknown name lists the closest known ones (computed only for the listed
    few: a wrongly prefixed state dict has hundreds of unknown names)."""
    if text != _UNKNOWN or schema is None:
        return f"{name!r}: {text}"
    close = difflib.get_close_matches(name, list(schema.tensors), n=3, cutoff=0.6)
    hint = f" (closest: {', '.join(map(repr, close))})" if close else " (none close)"
    return f"{name!r}: {text}{hint}"
