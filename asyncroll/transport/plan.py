"""Bucket planning: where every tensor's bytes sit in the fixed-size staging buffers.

Pure and synchronous: no I/O, no torch kernels, nothing but arithmetic on metadata.

Invariants of ``plan_buckets``:

* tensors keep their order; members of a fused group are gathered at the place of the group's first
  member, kind by kind (by the last part of their names: ``bias``, then ``weight``; numbers in
  numeric order), in input order within a kind: the order the fused parameter holds them in,
  so that a receiver's copies of ``q, k, v`` into ``qkv_proj.weight`` read one contiguous range
  and coalesce into one copy;
* every slot starts at a multiple of ``ALIGN`` bytes inside its bucket, so a view of any dtype
  is legal, and no bucket uses more than ``bucket_bytes`` (the staging buffers are fixed);
* a group (a lone tensor is a group of one) that fits in a bucket is never split: it goes whole
  into the current bucket or opens the next one, so the receiver hands out zero-copy views;
* a group larger than a bucket "spans": its bytes are streamed across consecutive buckets
  (a tensor may be cut anywhere), the receiver copies the pieces into a scratch buffer it owns
  and hands the whole group to its loader in the callback of the bucket that completes it
  (``Bucket.completes``). So a loader never sees half a group or half a tensor, and no memory is
  needed beyond the two staging buffers plus, on the receiver, the largest spanning group.
  (Raising instead would make any embedding larger than a bucket unpushable; an oversized
  bucket is impossible since the buffers are fixed.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN",
    "Bucket",
    "Part",
    "Slot",
    "TensorMeta",
    "default_group",
    "plan_buckets",
]

ALIGN = 256
"""Byte alignment of every slot (covers every dtype and the usual DMA alignment)."""

GroupOf = Callable[[str], "str | None"]

_FUSED = (
    (re.compile(r"^(?P<p>.*)\.(?:q_proj|k_proj|v_proj)\.[^.]+$"), "qkv_proj"),
    (re.compile(r"^(?P<p>.*)\.(?:gate_proj|up_proj)\.[^.]+$"), "gate_up_proj"),
    (re.compile(r"^(?P<p>.*)\.(?:w1|w3)\.[^.]+$"), "w13"),
)


def default_group(name: str) -> str | None:
    """Fused-group key of a Hugging Face parameter name, or None for a tensor on its own.

    ``model.layers.3.self_attn.{q,k,v}_proj.{weight,bias,...}`` share ``...self_attn.qkv_proj``,
    ``mlp.{gate,up}_proj.*`` (also per MoE expert) share ``...mlp.gate_up_proj``, and Mixtral's
    ``experts.N.{w1,w3}.*`` share ``...experts.N.w13``.
    """
    for pattern, fused in _FUSED:
        match = pattern.match(name)
        if match is not None:
            return f"{match['p']}.{fused}"
    return None


@dataclass(frozen=True, slots=True)
class Part:
    """Where a pushed tensor sits in the tensor it is a piece of: a receiver that reads only
    some rows of a tensor (a tensor-parallel worker, its shard), or only some columns of every
    row (a row-parallel shard: ``o_proj``, ``down_proj``), may be pushed just those."""

    whole: tuple[int, ...]
    """The shape of the whole tensor."""
    offset: int
    """Element offset of the piece's first element in the whole (contiguous) tensor."""
    columns: tuple[int, int] | None = None
    """Set: the piece holds columns ``[first, end)`` of the whole seen as rows of
    ``prod(whole[1:])`` elements, row after row, from the row at ``offset`` on (a column
    block: ``whole[:, first:end]``, contiguous); ``offset`` is then a row's first element."""

    @property
    def row_length(self) -> int:
        """Elements in a row of the whole tensor (seen as rows x the rest)."""
        return math.prod(self.whole[1:])

    def source_view(
        self, size: tuple[int, ...], stride: tuple[int, ...], offset: int, count: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """A read of the whole tensor (``size``, ``stride`` and element ``offset``, as
        ``Tensor.as_strided`` takes them) as the same read of a piece of ``count`` elements;
        None where it reads elements the piece lacks, or reads in a way this cannot map (a
        column block maps runs within a row, and row-major blocks of whole rows' columns)."""
        if self.columns is None:
            if offset < self.offset or _last_read(size, stride, offset) >= self.offset + count:
                return None
            return size, stride, offset - self.offset
        first, end = self.columns
        width, row = end - first, self.row_length
        top, left = divmod(offset - self.offset, row)
        if top < 0 or left < first or not all(size):
            return None
        moved: tuple[int, ...]
        if len(size) == 1 and (size[0] == 1 or stride[0] == 1):  # a run within one row
            rows, across, moved = 1, size[0], (1,)
        elif len(size) == 2 and (size[1] == 1 or stride[1] == 1) and (
            size[0] == 1 or stride[0] == row
        ):
            rows, across, moved = size[0], size[1], (width, 1)
        else:
            return None
        if left + across > end or (top + rows) * width > count:
            return None
        return size, moved, top * width + left - first


def _last_read(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """The last element a strided read touches (``offset`` for an empty one)."""
    return offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """What the planner needs to know about one named tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    part: Part | None = None
    """Set if the tensor pushed is a piece of a larger one (``shape`` is the piece's)."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_size(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One tensor, or one piece of a spanning tensor, inside a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the piece inside the bucket (a multiple of ALIGN)."""
    nbytes: int
    """Bytes of this piece."""
    start: int = 0
    """Byte offset of the piece inside the tensor."""
    total: int
    """Bytes of the whole tensor."""
    spanning: bool = False
    """The tensor belongs to a group that spans buckets: the receiver copies it out."""
    part: Part | None = None
    """The tensor is a piece of a larger one (``TensorMeta.part``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """The contents of one staging buffer for one step of a push."""

    index: int
    nbytes: int
    """Bytes used, counted up to the end of the last slot."""
    slots: tuple[Slot, ...]
    completes: tuple[str, ...] = ()
    """Spanning tensors whose group is complete once this bucket is loaded."""


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def group_metas(
    metas: Sequence[TensorMeta], group_of: GroupOf = default_group
) -> list[list[TensorMeta]]:
    """Gather fused groups at the place of their first member, kind by kind (see the module's
    invariants); keep everything else in order."""
    groups: list[list[TensorMeta]] = []
    by_key: dict[str, list[TensorMeta]] = {}
    for meta in metas:
        key = group_of(meta.name)
        if key is None:
            groups.append([meta])
        elif key in by_key:
            by_key[key].append(meta)
        else:
            by_key[key] = [meta]
            groups.append(by_key[key])
    for group in by_key.values():
        group.sort(key=_kind)  # stable: input order within a kind
    return groups


def _kind(meta: TensorMeta) -> tuple[int, int, str]:
    """The sort key of a fused group's member: the last part of its name, a number compared as
    a number (a custom ``group_of`` may group ``experts.2`` with ``experts.10``)."""
    last = meta.name.rpartition(".")[2]
    return (0, int(last), "") if last.isdigit() else (1, 0, last)


def group_nbytes(group: Sequence[TensorMeta]) -> int:
    """Bytes a group needs when it starts at offset 0 of a bucket."""
    end = 0
    for meta in group:
        end = align(end) + meta.nbytes
    return end


def plan_buckets(
    metas: Sequence[TensorMeta], *, bucket_bytes: int, group_of: GroupOf = default_group
) -> list[Bucket]:
    """Pack named tensors in order into buckets of at most ``bucket_bytes``.

    Args:
        metas: The tensors, in the order they should travel. Names must be unique.
        bucket_bytes: Size of one staging buffer; a positive multiple of ALIGN.
        group_of: Maps a name to its fused-group key (None: a group of its own).

    Returns:
        The buckets, indexed from 0. An empty input gives an empty plan.

    Raises:
        ValueError: bucket_bytes is not a positive multiple of ALIGN, or a name repeats.
    """
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    names = [meta.name for meta in metas]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    builder = _Builder(bucket_bytes)
    for group in group_metas(metas, group_of):
        if group_nbytes(group) <= bucket_bytes:
            builder.place_whole(group)
        else:
            builder.place_spanning(group)
    return builder.finish()


class _Builder:
    """Accumulates slots into buckets; the only mutable state of the planner."""

    def __init__(self, bucket_bytes: int) -> None:
        self.size = bucket_bytes
        self.done: list[Bucket] = []
        self.slots: list[Slot] = []
        self.completes: list[str] = []
        self.end = 0

    def place_whole(self, group: Sequence[TensorMeta]) -> None:
        start = align(self.end)
        if start + group_nbytes(group) > self.size:
            self.flush()
            start = 0
        for meta in group:
            start = align(start)
            self.slots.append(_slot(meta, offset=start, nbytes=meta.nbytes, start=0))
            start += meta.nbytes
        self.end = start

    def place_spanning(self, group: Sequence[TensorMeta]) -> None:
        for meta in group:
            done = 0
            while True:
                offset = align(self.end)
                if offset >= self.size:
                    self.flush()
                    offset = 0
                piece = min(meta.nbytes - done, self.size - offset)
                self.slots.append(
                    _slot(meta, offset=offset, nbytes=piece, start=done, spanning=True)
                )
                self.end = offset + piece
                done += piece
                if done >= meta.nbytes:
                    break
        self.completes.extend(meta.name for meta in group)

    def flush(self) -> None:
        if self.slots:
            self.done.append(
                Bucket(
                    index=len(self.done),
                    nbytes=self.end,
                    slots=tuple(self.slots),
                    completes=tuple(self.completes),
                )
            )
        self.slots, self.completes, self.end = [], [], 0

    def finish(self) -> list[Bucket]:
        self.flush()
        return self.done


def _slot(
    meta: TensorMeta, *, offset: int, nbytes: int, start: int, spanning: bool = False
) -> Slot:
    return Slot(
        name=meta.name,
        dtype=meta.dtype,
        shape=meta.shape,
        offset=offset,
        nbytes=nbytes,
        start=start,
        total=meta.nbytes,
        spanning=spanning,
        part=meta.part,
    )
