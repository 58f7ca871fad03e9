"""Moving bytes between named tensors and a staging buffer, following a plan. Sync, no I/O.

The sender packs a ``Bucket`` into a flat uint8 buffer; the receiver turns the same layout back
into named tensors: zero-copy views for slots of whole groups, owned tensors reassembled from
pieces for spanning groups (``SpanAssembler``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Final

import torch

from asyncroll.transport.plan import Bucket, Slot, align

__all__ = [
    "FUSE_BYTES",
    "LAUNCH_BOUND_BYTES",
    "LAUNCH_BOUND_COPIES",
    "CopySplit",
    "Span",
    "SpanAssembler",
    "bucket_spans",
    "copy_many",
    "fuse_limit",
    "fused_slots",
    "dtype_by_name",
    "pack_bucket",
    "run_copies",
    "slot_view",
    "split_copies",
]

_DTYPES: Final = {
    name: value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)
}


FUSE_BYTES: Final = 1 << 20
"""Copies of at most this many bytes, between destinations known not to overlap, go in one
fused launch (``split_copies``): a 7B model's norms and biases."""

LAUNCH_BOUND_BYTES: Final = int(os.environ.get("ASYNCROLL_FUSE_BYTES") or 16 << 20)
"""In a batch bound by its launches (``fuse_limit``), every copy up to this many bytes is fused
too (``split_copies``, ``fused_slots``). A ``copy_`` costs 10-14 us of host time (an H100
machine), in which an H200 copies about 25 MB. A mixture of experts is thousands of such
copies (the 30B-A3B: 18,867 tensors of 3 MiB; its one-copy push took 297 ms with 1 MiB, 134
ms with this, 2026-11-29 on an H200). Fused copies run at about 80% of a memcpy's rate
(``_foreach_copy_``'s kernel), so the bigger ones keep their own copy. ``ASYNCROLL_FUSE_BYTES``
sets it for a benchmark's A/B (read at import, in every process; 1048576: as before
2026-11-29)."""

LAUNCH_BOUND_COPIES: Final = 64
"""A batch of at least this many copies, averaging less than ``LAUNCH_BOUND_BYTES``, is bound
by its launches: a copy's 10-14 us of host time moves 20-30 MB on an H200, so a batch of
smaller copies spends more time issuing them than the device spends copying (a mixture's
18,867 expert tensors; a 0.5B's 290 tensors of 3.4 MB on average: its inflight commit spent
4.7-5.7 ms issuing about 1 ms of copies, 2026-11-30). A dense 7B's copies average 44 MB:
their launches overlap the device's work, and keep the path measured for them (11.4 ms
fused up to 1 MiB, 11.9 ms fused up to 16 MiB, the same run). Below this count the
launches are too few to matter. (Until 2026-11-30: 1024, which left the 0.5B unfused.)"""


SENDER_LAUNCH_BOUND_COPIES: Final = 1024
"""``LAUNCH_BOUND_COPIES`` for the sender's packing (``fused_slots``), whose unfused copies are
the driver's (about 1 us of host time each, not ``copy_``'s 10-14): a staged bucket of a 0.5B
(about 150 slots of 3.4 MB) stays unfused there, as measured before 2026-11-30."""


def fuse_limit(sizes: Sequence[int], *, copies: int | None = None) -> int:
    """The largest copy to fuse in a batch of copies of ``sizes`` bytes: ``FUSE_BYTES``, or
    ``LAUNCH_BOUND_BYTES`` where the batch is bound by its launches (``copies`` or more,
    by default ``LAUNCH_BOUND_COPIES``, averaging less than it)."""
    least = LAUNCH_BOUND_COPIES if copies is None else copies
    if len(sizes) >= least and sum(sizes) < LAUNCH_BOUND_BYTES * len(sizes):
        return max(LAUNCH_BOUND_BYTES, FUSE_BYTES)
    return FUSE_BYTES


CopySplit = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
"""(destinations, sources) copied one ``copy_`` each, in order; then (destinations, sources)
copied in one ``torch._foreach_copy_``."""


def split_copies(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    *,
    disjoint: bool,
    coalesce: bool = False,
) -> CopySplit:
    """Sort copies for ``run_copies``: with ``disjoint`` destinations (order does not matter),
    the small ones (at most ``fuse_limit``, same dtype and device on both sides) go last, in
    one fused launch: a 7B model's ~170 norms and biases cost one launch instead of one each,
    a mixture's thousands of experts one launch instead of thousands.
    Otherwise every copy is a ``copy_``, in order.

    ``coalesce`` (with ``disjoint``): first merge each run of consecutive copies whose
    destinations and sources both lie end to end in one storage (``q``, ``k`` and ``v`` from
    consecutive staging slots into ``qkv_proj.weight``) into one copy. Worth its cost where the
    split is made once and replayed (``LoadPlan``).

    (Measured on an H100, 339 copies of a 7B model: 3.4 ms to issue and 11.1 ms on the device
    one ``copy_`` each; 1.6 ms and 10.7 ms split; 1.9 ms and 13.4 ms all in one
    ``_foreach_copy_``, whose kernel copies big tensors slower than ``copy_``'s memcpy.)"""
    if not disjoint:
        return list(dsts), list(srcs), [], []
    if coalesce:
        dsts, srcs = _coalesced(dsts, srcs)
    split: CopySplit = ([], [], [], [])
    limit = fuse_limit([dst.numel() * dst.element_size() for dst in dsts])
    for dst, src in zip(dsts, srcs, strict=True):
        small = (
            dst.dtype == src.dtype
            and dst.device == src.device
            and dst.numel() * dst.element_size() <= limit
        )
        split[2 if small else 0].append(dst)
        split[3 if small else 1].append(src)
    if len(split[2]) == 1:  # nothing to fuse
        split[0].append(split[2].pop())
        split[1].append(split[3].pop())
    return split


def _coalesced(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Consecutive copies that continue each other on both sides, merged (``split_copies``)."""
    out_dsts: list[torch.Tensor] = []
    out_srcs: list[torch.Tensor] = []
    for dst, src in zip(dsts, srcs, strict=True):
        if (
            out_dsts
            # neither a broadcast: element i of each source lands at element i of its
            # destination, so the merged copy does too
            and dst.numel() == src.numel()
            and out_dsts[-1].numel() == out_srcs[-1].numel()
            and _continues(out_dsts[-1], dst)
            and _continues(out_srcs[-1], src)
        ):
            total = out_dsts[-1].numel() + dst.numel()
            out_dsts[-1] = _flat(out_dsts[-1], total)
            out_srcs[-1] = _flat(out_srcs[-1], total)
        else:
            out_dsts.append(dst)
            out_srcs.append(src)
    return out_dsts, out_srcs


def _continues(before: torch.Tensor, after: torch.Tensor) -> bool:
    """``after`` starts where ``before`` ends, in the same storage, both dense, one dtype."""
    return (
        before.dtype == after.dtype
        and before.device == after.device
        and before.is_contiguous()
        and after.is_contiguous()
        and before.numel() > 0
        and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
        and before.storage_offset() + before.numel() == after.storage_offset()
    )


def _flat(first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of ``first``'s storage from ``first``'s start, as one flat tensor."""
    return first.as_strided((numel,), (1,), first.storage_offset())


def run_copies(split: CopySplit) -> None:
    """The copies of ``split_copies``."""
    dsts, srcs, fused_dsts, fused_srcs = split
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)
    if fused_dsts:
        torch._foreach_copy_(fused_dsts, fused_srcs)


def copy_many(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, disjoint: bool = False
) -> None:
    """``dst.copy_(src)`` for each pair: in order, or (``disjoint``: no two destinations
    overlap) the small ones fused (``split_copies``)."""
    run_copies(split_copies(dsts, srcs, disjoint=disjoint))


def dtype_by_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; only real torch dtypes resolve."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy only if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def slot_view(
    buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A typed view of ``nbytes`` at ``offset`` of a flat uint8 buffer."""
    return buffer[offset : offset + nbytes].view(dtype).view(tuple(shape))


_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose addresses are their bytes (no subclass with its own layout)."""

Span = tuple[int, int, int]
"""One copy as addresses: (destination, source, bytes)."""


def fused_slots(bucket: Bucket) -> tuple[Bucket, Bucket | None]:
    """``bucket`` split into the slots to copy one by one (as the driver's copies: about 1 us
    of host time each) and, where the bucket is bound by its launches (``fuse_limit``), those of
    at most ``LAUNCH_BOUND_BYTES`` (whole tensors, two or more) to copy in one fused launch
    (``pack_bucket``); None for the second where there is nothing to fuse."""
    limit = fuse_limit([s.nbytes for s in bucket.slots if s.nbytes],
                       copies=SENDER_LAUNCH_BOUND_COPIES)
    if limit == FUSE_BYTES:
        return bucket, None
    small = [s for s in bucket.slots if 0 < s.nbytes <= limit and not s.spanning]
    if len(small) < 2:
        return bucket, None
    ids = {id(s) for s in small}
    rest = tuple(s for s in bucket.slots if id(s) not in ids)
    return dataclasses.replace(bucket, slots=rest), dataclasses.replace(bucket, slots=tuple(small))


def bucket_spans(
    bucket: Bucket, buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor]
) -> list[Span] | None:
    """``pack_bucket``'s copies as address ranges into ``buffer``, for a backend that queues
    them itself (``Backend.queue_spans``: one driver call a copy, where torch's ``copy_``
    costs 10-14 us of host time a copy on an H100 machine); None unless every source is a
    contiguous tensor of its slot's dtype and shape on the buffer's device (``pack_bucket``
    then: it also takes strided sources and casts)."""
    base, device, size = buffer.data_ptr(), buffer.get_device(), buffer.nbytes
    spans: list[Span] = []
    for slot in bucket.slots:
        if slot.nbytes == 0:
            continue
        source = tensors[slot.name]
        if (
            type(source) not in _PLAIN
            or source.dtype != slot.dtype
            or source.get_device() != device
            or not source.is_contiguous()
            or source.is_conj()  # lazy views: their bytes are not their values
            or source.is_neg()
            or not source.data_ptr()  # (a zero tensor has no bytes)
            or slot.offset + slot.nbytes > size
        ):
            return None
        if slot.spanning:
            if slot.start + slot.nbytes > source.numel() * source.element_size():
                return None
            address = source.data_ptr() + slot.start
        else:
            if tuple(source.shape) != slot.shape:
                return None
            address = source.data_ptr()
        spans.append((base + slot.offset, address, slot.nbytes))
    return spans


def pack_bucket(
    bucket: Bucket,
    buffer: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    views: dict[tuple[int, int, torch.dtype, tuple[int, ...]], torch.Tensor] | None = None,
) -> None:
    """Copy every slot of ``bucket`` from ``tensors`` into ``buffer`` (strided sources welcome;
    a source of another dtype than its slot's is cast).

    ``views``, if given, keeps the typed views of ``buffer`` made for the slots, to reuse on the
    next push of the same layout (a view is three tensor ops; a bucket can hold hundreds)."""
    flat_cache: tuple[str, torch.Tensor] | None = None
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for slot in bucket.slots:
        if slot.nbytes == 0:
            continue
        source = tensors[slot.name]
        if not slot.spanning:
            key = (slot.offset, slot.nbytes, slot.dtype, slot.shape)
            view = views.get(key) if views is not None else None
            if view is None:
                view = slot_view(buffer, slot.offset, slot.nbytes, slot.dtype, slot.shape)
                if views is not None:
                    views[key] = view
            dsts.append(view)
            srcs.append(source)
            continue
        if flat_cache is None or flat_cache[0] != slot.name:
            if source.dtype != slot.dtype:  # a lazy tensor made in another dtype
                source = source.to(slot.dtype)
            flat_cache = (slot.name, as_bytes(source))
        dsts.append(buffer[slot.offset : slot.offset + slot.nbytes])
        srcs.append(flat_cache[1][slot.start : slot.start + slot.nbytes])
    copy_many(dsts, srcs, disjoint=True)  # slots of one buffer never overlap


class SpanAssembler:
    """Receiver side of spanning groups: reassembles them in one reusable scratch buffer.

    The scratch buffer only grows (to the largest spanning group seen) and lives until
    ``release``; so a push allocates nothing once the first push is done. Tensors from ``take``
    are views into it, valid until the next ``add`` (that is, during the loader's call).
    """

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None
        self._members: dict[str, tuple[int, Slot]] = {}
        self._end = 0

    def __len__(self) -> int:
        return len(self._members)

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.numel()

    def add(self, slot: Slot, buffer: torch.Tensor) -> None:
        member = self._members.get(slot.name)
        if member is None:
            offset = align(self._end)
            self._grow(offset + slot.total, buffer.device)
            self._end = offset + slot.total
            member = self._members[slot.name] = (offset, slot)
        if slot.nbytes:
            assert self._scratch is not None
            at = member[0] + slot.start
            piece = buffer[slot.offset : slot.offset + slot.nbytes]
            self._scratch[at : at + slot.nbytes].copy_(piece)

    def _grow(self, nbytes: int, device: torch.device) -> None:
        old = self._scratch
        if old is not None and old.numel() >= nbytes and old.device == device:
            return
        new = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if old is not None and self._end:
            new[: self._end].copy_(old[: self._end])
        self._scratch = new

    def take(self, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
        """Views of completed tensors (their group is complete); forgets them."""
        taken = []
        for name in names:
            offset, slot = self._members.pop(name)
            assert self._scratch is not None
            taken.append(
                (name, slot_view(self._scratch, offset, slot.total, slot.dtype, slot.shape))
            )
        if not self._members:
            self._end = 0
        return taken

    def clear(self) -> None:
        """Forget partial groups (keep the scratch buffer)."""
        self._members.clear()
        self._end = 0

    def release(self) -> None:
        self.clear()
        self._scratch = None
