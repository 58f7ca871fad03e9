"""Pieces of tensors put together into whole tensors, for a loader that takes whole tensors only.

A worker fed by every rank of a sharded trainer (``DistributedWeightPusher`` with ``fan_in``)
takes each rank's own rows of each sharded tensor as a piece (``plan.Part``). A load plan
loads a piece where it lands (``asyncroll.receive.load_plan``); vLLM's layerwise reload (the CPU
build's) and a model's own loader take whole tensors only, so the pieces of a tensor are
copied into one buffer of its whole shape, which is handed on once every element has arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from asyncroll.transport.plan import Part

__all__ = ["Assembly"]


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
        keep: Callable[[str], bool] | None = None,
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Part]]:
        """``batch`` with each piece put into its tensor, and each tensor completed by it in its
        place (whole, no longer a piece); pieces ``keep`` says the loader takes as they are stay
        pieces. Returns the batch to load and the parts of the pieces left in it.

        Raises:
            ValueError: a piece that does not fit its tensor, or more elements than it holds.
        """
        out: list[tuple[str, torch.Tensor]] = []
        left: dict[str, Part] = {}
        for name, tensor in batch:
            part = parts.get(name)
            if part is None:
                out.append((name, tensor))
            elif keep is not None and keep(name):
                out.append((name, tensor))
                left[name] = part
            else:
                whole = self._add(name, tensor, part)
                if whole is not None:
                    out.append((name, whole))
        return out, left

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
