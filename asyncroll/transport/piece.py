"""Pushing a piece of a tensor: the rows a receiver reads, not the whole tensor.

A tensor-parallel worker loads only its shard of most tensors (q, k, v, gate, up, the
embedding: a range of rows). When the sender holds exactly those rows already (an FSDP rank
whose ``Shard(0)`` rows are the shard of the worker on its GPU), it can push them as a
``Piece``: the bytes travel and land as a tensor of the piece's shape, and the receiver is told
where the piece sits in the whole tensor (``plan.Part``), so its loader (``LoadPlan``, which
knows the element range each name's load reads) copies from it as it would from the whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncroll.transport.lazy import LazyTensor
from asyncroll.transport.plan import Part

__all__ = ["Piece", "split_pieces"]


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements of a contiguous tensor of shape ``whole`` from element ``offset`` on,
    as many as ``tensor`` holds (``tensor`` is contiguous, or a ``LazyTensor``; its dtype is
    the whole tensor's). With ``columns``: only those columns of each row, from the row at
    ``offset`` on (``plan.Part``)."""

    tensor: torch.Tensor | LazyTensor
    whole: tuple[int, ...]
    offset: int
    columns: tuple[int, int] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the piece (what travels)."""
        return self.tensor.numel() * self.tensor.element_size()

    def part(self) -> Part:
        """What travels to the receiver; ``ValueError`` if the piece does not fit the whole."""
        count = self.tensor.numel()
        if self.columns is not None:
            self._check_columns(count)
        elif self.offset < 0 or self.offset + count > math.prod(self.whole):
            raise ValueError(
                f"a piece of {count} elements at {self.offset} does not fit {self.whole}"
            )
        if isinstance(self.tensor, torch.Tensor) and not self.tensor.is_contiguous():
            raise ValueError("a piece's tensor must be contiguous")
        return Part(whole=tuple(self.whole), offset=self.offset, columns=self.columns)

    def _check_columns(self, count: int) -> None:
        assert self.columns is not None
        first, end = self.columns
        row = math.prod(self.whole[1:]) if len(self.whole) > 1 else 0
        width = end - first
        if not 0 <= first < end <= row or count % width or self.offset < 0 or self.offset % row:
            raise ValueError(
                f"columns [{first}, {end}) of {count} elements at {self.offset} do not fit"
                f" {self.whole} (rows of {row})"
            )
        if self.offset + count // width * row > math.prod(self.whole):
            raise ValueError(f"{count // width} rows at {self.offset} do not fit {self.whole}")


def split_pieces(
    tensors: Mapping[str, torch.Tensor | LazyTensor | Piece],
) -> tuple[dict[str, torch.Tensor | LazyTensor], dict[str, Part]]:
    """The tensors to pack (a piece's own), and the parts of those that are pieces."""
    plain: dict[str, torch.Tensor | LazyTensor] = {}
    parts: dict[str, Part] = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, Piece):
            try:
                parts[name] = tensor.part()
            except ValueError as exc:
                raise ValueError(f"{name!r}: {exc}") from None
            plain[name] = tensor.tensor
        else:
            plain[name] = tensor
    return plain, parts
