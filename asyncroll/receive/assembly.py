"""Pieces of tensors put together into whole tensors, for a loader that takes whole tensors only.

A worker fed by every rank of a sharded trainer (``DistributedWeightPusher`` with ``fan_in``)
takes each rank's own rows of each sharded tensor as a piece (``plan.Part``). A load plan
loads a piece where it lands (``asyncroll.receive.load_plan``); vLLM's layerwise reload (the CPU
build's) and a model's own loader take whole tensors only, so the pieces of a tensor are
copied into one buffer of its whole shape, which is handed on once every element has arrived.

Where a load plan is known, each piece is routed on its own (``LoadPlan.piece_route``): the
plan loads it (it holds every element the worker reads), it is not needed (it holds none of
them, and another rank's piece holds them all: a tensor-parallel worker's rows come from one
rank), or it is put together with the others. A tensor's pieces arrive through several push
groups, in no fixed order and in buckets of their own; routing each piece by what it holds, not
by what else its bucket holds, never leaves a tensor half put together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch

from asyncroll.transport.plan import Part

__all__ = ["Assembly", "Route", "Taken"]

Route = Literal["load", "skip", "assemble"]
"""Where a piece goes: loaded as it is, not needed here, or put together into its tensor."""


class Taken(NamedTuple):
    """What ``Assembly.take`` hands back."""

    batch: list[tuple[str, torch.Tensor]]
    """To load: the tensors that were whole, those completed, and the pieces left pieces."""
    parts: dict[str, Part]
    """The parts of the pieces left in ``batch``."""
    skipped: list[tuple[str, torch.dtype, tuple[int, ...]]]
    """Pieces not needed here (name, dtype, whole shape): delivered, nothing to load."""


class Assembly:
    """The tensors of one push whose pieces are still arriving."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[torch.Tensor, int]] = {}

    def __repr__(self) -> str:
        return f"<Assembly {len(self._open)} tensors incomplete>"

    @property
    def incomplete(self) -> list[str]:
        """Tensors some of whose pieces arrived, not all."""
        return sorted(self._open)

    def take(
        self,
        batch: Sequence[tuple[str, torch.Tensor]],
        parts: dict[str, Part],
        *,
        route: Callable[[str, torch.Tensor, Part], Route] | None = None,
    ) -> Taken:
        """``batch`` with each piece put into its tensor, and each tensor completed by it in its
        place (whole, no longer a piece); pieces ``route`` says the loader takes as they are
        (``load``) stay pieces, those it says are not needed here (``skip``) leave the batch.

        Raises:
            ValueError: a piece that does not fit its tensor, or more elements than it holds.
        """
        out: list[tuple[str, torch.Tensor]] = []
        left: dict[str, Part] = {}
        skipped: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, tensor in batch:
            part = parts.get(name)
            if part is None:
                out.append((name, tensor))
                continue
            where = "assemble" if route is None else route(name, tensor, part)
            if where == "load":
                out.append((name, tensor))
                left[name] = part
            elif where == "skip":
                skipped.append((name, tensor.dtype, part.whole))
            else:
                whole = self._add(name, tensor, part)
                if whole is not None:
                    out.append((name, whole))
        return Taken(out, left, skipped)

    def _add(self, name: str, piece: torch.Tensor, part: Part) -> torch.Tensor | None:
        buffer, filled = self._open.get(name) or (
            torch.empty(part.whole, dtype=piece.dtype, device=piece.device), 0
        )
        count = piece.numel()
        if part.columns is None:
            if part.offset + count > buffer.numel():
                raise ValueError(f"{name!r}: a piece of {count} at {part.offset} does not fit")
            buffer.view(-1)[part.offset : part.offset + count].copy_(piece.reshape(-1))
        else:
            first, end = part.columns
            row = math.prod(part.whole[1:])
            rows = count // (end - first)
            start = part.offset // row
            if start + rows > buffer.numel() // row:
                raise ValueError(f"{name!r}: {rows} rows at {start} do not fit {part.whole}")
            buffer.view(-1, row)[start : start + rows, first:end].copy_(
                piece.reshape(rows, end - first)
            )
        filled += count
        if filled > buffer.numel():
            raise ValueError(f"{name!r}: its pieces hold more than its {buffer.numel()} elements")
        if filled == buffer.numel():
            self._open.pop(name, None)
            return buffer
        self._open[name] = (buffer, filled)
        return None
