"""An adapter push, received whole into memory of its own: one worker's side, without vLLM.

A full-weight push loads into the served parameters; an adapter push loads into nothing that
serves. It arrives packed (``asyncroll.adapters.pack_adapter``: one flat chunk per dtype) and is
copied out of the transport's buffers (which the next bucket reuses, or which are the trainer's
own storages in a one-copy push) into memory the revision owns, one copy per bucket, then each
of its tensors is checked against the sender's fingerprints. The caller (the vLLM adapter)
registers the revision only once every tensor arrived and matched, so a push that fails
leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from asyncroll.adapters import Placement, split_adapter
from asyncroll.errors import WeightSyncError
from asyncroll.fingerprints import packed_fingerprints
from asyncroll.transport.receiver import ReceiveReport

__all__ = ["AdapterTake"]

Batch = Sequence[tuple[str, torch.Tensor]]


class AdapterTake:
    """Collects one adapter push (``load`` per bucket, then ``check``); ``chunks`` holds it.

    Args:
        device: Where the revision's tensors live (the worker's device).
        layout: Where each tensor lies in the pushed chunks (``asyncroll.adapters.placements``).
    """

    def __init__(self, device: torch.device | str, layout: tuple[Placement, ...]) -> None:
        self.device = torch.device(device)
        self.layout = layout
        self.chunks: dict[str, torch.Tensor] = {}
        """The pushed chunks, in memory of the revision's own."""
        self.pieces: dict[str, tuple[torch.Tensor, ...]] = {}
        """Each chunk's tensors, flat, in the layout's order (``split_adapter``), once
        checked."""
        self.verified = (0, 0)
        """Tensors checked against the sender's fingerprints, and those the push sent none for."""
        self.check_seconds = 0.0
        self.seconds: dict[str, float] = {}
        """Where the check went (benchmarks)."""

    def load(self, batch: Batch) -> None:
        """Copy one bucket out of the transport's memory (valid only during the call)."""
        self.chunks.update(_copied(batch, self.device))

    def check(self, report: ReceiveReport) -> None:
        """Everything that arrived is whole and as the trainer fingerprinted it.

        Raises:
            WeightSyncError: nothing arrived, chunks the layout does not tile, or a tensor that
                differs from what was pushed.
        """
        started = time.perf_counter()
        try:
            self._check(report)
        finally:
            self.check_seconds = time.perf_counter() - started

    def _check(self, report: ReceiveReport) -> None:
        if not self.chunks or not self.layout:
            raise WeightSyncError(f"push {report.push}: the adapter push delivered no tensor")
        began = time.perf_counter()
        pieces = split_adapter(self.chunks, self.layout)
        unpacked = time.perf_counter()
        pushed = report.fingerprints or {}
        found = packed_fingerprints(self.chunks, self.layout) if pushed else {}
        printed = time.perf_counter()
        checked = [name for name in found if name in pushed]
        wrong = [name for name in checked if found[name] != pushed[name]]
        self.seconds = {"split": unpacked - began, "fingerprints": printed - unpacked,
                        "compare": time.perf_counter() - printed}
        self.verified = (len(checked), len(self.layout) - len(checked))
        if wrong:
            raise WeightSyncError(
                f"push {report.push}: {len(wrong)} adapter tensors differ from what was pushed"
                f" (fingerprints): {sorted(wrong)[:5]}"
            )
        self.pieces = pieces


def _copied(batch: Batch, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The batch's tensors in new memory on ``device``: one copy of the span they share in
    one storage (a staging slot, or a one-copy push's storage), else a copy each."""
    if not batch:
        return []
    storages = {t.untyped_storage().data_ptr() for _, t in batch}
    if len(storages) != 1 or not all(t.is_contiguous() for _, t in batch):
        return [(name, t.to(device, copy=True)) for name, t in batch]
    try:
        return _span_copied(batch, device)
    except RuntimeError:  # a view the span cannot give (an odd alignment): one copy each
        return [(name, t.to(device, copy=True)) for name, t in batch]


def _span_copied(batch: Batch, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    first = batch[0][1]
    start = min(t.storage_offset() * t.element_size() for _, t in batch)
    end = max((t.storage_offset() + t.numel()) * t.element_size() for _, t in batch)
    whole = torch.empty(0, dtype=torch.uint8, device=first.device)
    whole.set_(first.untyped_storage())
    span = torch.empty(end - start, dtype=torch.uint8, device=device)
    span.copy_(whole[start:end], non_blocking=False)
    view: Callable[[torch.Tensor], torch.Tensor] = lambda t: (  # noqa: E731
        span[t.storage_offset() * t.element_size() - start:][: t.numel() * t.element_size()]
        .view(t.dtype).view(t.shape)
    )
    return [(name, view(t)) for name, t in batch]
