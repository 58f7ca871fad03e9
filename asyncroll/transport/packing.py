"""Moving bytes between named tensors and a staging buffer, following a plan. Sync, no I/O.

The sender packs a ``Bucket`` into a flat uint8 buffer; the receiver turns the same layout back
into named tensors: zero-copy views for slots of whole groups, owned tensors reassembled from
pieces for spanning groups (``SpanAssembler``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import torch

from asyncroll.transport.plan import Bucket, Slot

__all__ = ["SpanAssembler", "dtype_by_name", "pack_bucket", "slot_view"]

_DTYPES: Final = {
    name: value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)
}


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


def pack_bucket(bucket: Bucket, buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every slot of ``bucket`` from ``tensors`` into ``buffer`` (strided sources welcome)."""
    flat_cache: tuple[str, torch.Tensor] | None = None
    for slot in bucket.slots:
        if slot.nbytes == 0:
            continue
        source = tensors[slot.name]
        if not slot.spanning:
            slot_view(buffer, slot.offset, slot.nbytes, slot.dtype, slot.shape).copy_(source)
            continue
        if flat_cache is None or flat_cache[0] != slot.name:
            flat_cache = (slot.name, as_bytes(source))
        piece = flat_cache[1][slot.start : slot.start + slot.nbytes]
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(piece)


class SpanAssembler:
    """Receiver side of spanning groups: collects pieces into tensors it owns."""

    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def add(self, slot: Slot, buffer: torch.Tensor) -> None:
        target = self._partial.get(slot.name)
        if target is None:
            target = torch.empty(slot.shape, dtype=slot.dtype, device=buffer.device)
            self._partial[slot.name] = target
        if slot.nbytes:
            piece = buffer[slot.offset : slot.offset + slot.nbytes]
            target.reshape(-1).view(torch.uint8)[slot.start : slot.start + slot.nbytes].copy_(piece)

    def take(self, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
        """Hand over completed tensors (and forget them)."""
        return [(name, self._partial.pop(name)) for name in names]

    def clear(self) -> None:
        self._partial.clear()
