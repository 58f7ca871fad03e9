"""An adapter push, received whole into memory of its own: one worker's side, without vLLM.

A full-weight push loads into the served parameters; an adapter push loads into nothing that
serves. It arrives packed (``asyncroll.adapters.pack_adapter``: one flat chunk per dtype) and is
copied out of the transport's buffers (which the next bucket reuses, or which are the trainer's
own storages in a one-copy push) into memory the revision owns, one copy per bucket, then each
of its tensors is checked against the sender's fingerprints. The caller (the vLLM adapter)
registers the revision only once every tensor arrived and matched, so a push that fails
leaves nothing behind.

The memory a revision owns can be a ``Landing``: the chunks of an earlier revision of the same
layout that is gone, with the views made of them once (the chunks' split into tensors, and the
sources a slot's replay reads). A 7B rank-64 adapter is 392 tensors, and making their views
again for every revision cost about a millisecond of Python on an H200 host.

``Landings`` receives pushes on a thread of the worker's own, while its engine steps: the
bytes land, are checked, and the sender hears the verdict, with no engine step in the way;
the registration that follows (vLLM's, between two steps) finds them there. Its receiver is
its own (the worker's weight receiver stays the step loop's), and on a GPU its copies run on a
stream of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from asyncroll.adapters import Placement, split_adapter
from asyncroll.errors import WeightSyncError
from asyncroll.fingerprints import PackedPrints
from asyncroll.receive.landing import ReceivingThread
from asyncroll.transport.receiver import ReceiveReport, WeightReceiver

__all__ = ["AdapterTake", "Landing", "Landings"]

logger = logging.getLogger(__name__)

Batch = Sequence[tuple[str, torch.Tensor]]


class Landing:
    """Memory one revision of a layout is received into, and views of it made once: the
    chunks, their split (``split_adapter``), and what each recorded slot replay reads
    (``asyncroll.vllm.lora.SlotWrites``, by recording). Held by one revision at a time (its
    owner, ``asyncroll.vllm.lora.RevisionStore``, hands it to the next once that revision is
    dropped)."""

    def __init__(self, layout: tuple[Placement, ...]) -> None:
        self.layout = layout
        self._names = {chunk for _, chunk, _, _ in layout}
        self.chunks: dict[str, torch.Tensor] = {}
        self.sources: dict[object, list[torch.Tensor]] = {}
        """A replay's recording -> the views of ``chunks`` it reads (made by the replay)."""
        self._pieces: dict[str, tuple[torch.Tensor, ...]] | None = None
        self.free_after: torch.cuda.Event | None = None
        """Recorded on the stream of the last reads of the chunks as the landing came back
        (``freed``): writes on another stream wait for it (``AdapterTake``)."""

    def freed(self) -> None:
        """The landing is free again: later writes on another stream wait for the reads
        queued on this thread's stream until now."""
        held = next(iter(self.chunks.values()), None)
        if held is not None and held.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(held.device))
            self.free_after = event

    def chunk(self, name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The landing's memory for chunk ``name``, shaped as ``like`` (new memory, and
        every view of the old forgotten, where it was not; new memory not kept, for a chunk
        the layout does not name: the check refuses the push)."""
        if name not in self._names:
            return torch.empty(like.shape, dtype=like.dtype, device=device)
        held = self.chunks.get(name)
        if (
            held is None or held.dtype != like.dtype or held.shape != like.shape
            or held.device != device
        ):
            held = self.chunks[name] = torch.empty(like.shape, dtype=like.dtype, device=device)
            self._pieces = None
            self.sources.clear()
        return held

    def pieces(self, chunks: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
        """``split_adapter(chunks, layout)``, made once while ``chunks`` are this landing's.

        Raises:
            WeightSyncError: as ``split_adapter``.
        """
        own = chunks.keys() == self.chunks.keys() and all(
            chunks[name] is tensor for name, tensor in self.chunks.items()
        )
        if own and self._pieces is not None:
            return self._pieces
        pieces = split_adapter(chunks, self.layout)
        if own:
            self._pieces = pieces
        return pieces


class AdapterTake:
    """Collects one adapter push (``load`` per bucket, then ``check``); ``chunks`` holds it.

    Args:
        device: Where the revision's tensors live (the worker's device).
        layout: Where each tensor lies in the pushed chunks (``asyncroll.adapters.placements``).
    """

    def __init__(
        self, device: torch.device | str, layout: tuple[Placement, ...],
        landing: Landing | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as a landing keeps it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout = layout
        self.landing = landing
        """Where the chunks land (None: new memory)."""
        if landing is not None and landing.free_after is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).wait_event(landing.free_after)
            landing.free_after = None
        self.chunks: dict[str, torch.Tensor] = {}
        """The pushed chunks, in memory of the revision's own."""
        self.pieces: dict[str, tuple[torch.Tensor, ...]] = {}
        """Each chunk's tensors, flat, in the layout's order (``split_adapter``), once
        checked."""
        self.verified = (0, 0)
        """Tensors checked against the sender's fingerprints, and those the push sent none for."""
        self._prints = PackedPrints(layout)
        """The fingerprints of each chunk as it landed, started at once (``load``)."""
        self.check_seconds = 0.0
        self.seconds: dict[str, float] = {}
        """Where the check went (benchmarks)."""

    def load(self, batch: Batch) -> None:
        """Copy one bucket out of the transport's memory (valid only during the call)."""
        if self.landing is None:
            landed = _copied(batch, self.device)
        else:
            landed = []
            for name, tensor in batch:
                target = self.landing.chunk(name, tensor, self.device)
                target.copy_(tensor)
                landed.append((name, target))
        self.chunks.update(landed)
        for name, chunk in landed:
            self._prints.start(name, chunk)

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
        pieces = (
            self.landing.pieces(self.chunks) if self.landing is not None
            else split_adapter(self.chunks, self.layout)
        )
        unpacked = time.perf_counter()
        pushed = report.fingerprints or {}
        found = self._prints.result(self.chunks) if pushed else {}
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


class Landings(ReceivingThread):
    """Adapter pushes received on a thread of their own (see the module doc).

    The thread waits for the sender's next push, lands it in memory ``lend`` gives for the
    layout last ``expect``-ed, checks it (``AdapterTake``) and answers the sender's request
    for a verdict (``WeightSender.push(verdicts=True)``), then keeps it under the push's id
    until ``take``. A push that fails gives its memory back (``give_back``); so do the pushes
    landed but never taken, once a later one is taken (their registration will not come).

    Args:
        receiver: Connected; this object's thread is its only user from now on.
        device: Where the revisions live.
        lend: Memory for one revision of a layout (``RevisionStore.landing``).
        give_back: Takes memory back (``RevisionStore.release``). Both are called from the
            thread and must be safe against the worker's own calls.
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        device: torch.device,
        lend: Callable[[tuple[Placement, ...]], Landing],
        give_back: Callable[[Landing | None], None],
        *,
        name: str = "asyncroll-landings",
    ) -> None:
        super().__init__(receiver, device, name=name)
        self._lend = lend
        self._give_back = give_back
        self._layout: tuple[Placement, ...] | None = None
        self._landed: dict[int, AdapterTake] = {}
        self._lock = threading.Lock()
        self.landed = self.failed = 0
        self.last_failure = ""
        self._start()

    def __repr__(self) -> str:
        waiting = sorted(self._landed)
        return f"<Landings landed={self.landed} failed={self.failed} waiting={waiting}>"

    @property
    def layout(self) -> tuple[Placement, ...] | None:
        return self._layout

    def expect(self, layout: tuple[Placement, ...] | None) -> None:
        """The layout of the pushes that come next (asked at each push's first bucket;
        None: they fail)."""
        self._layout = layout

    def release_all(self) -> None:
        """Give back every push landed and not taken (none will be registered now)."""
        with self._lock:
            landed, self._landed = list(self._landed.values()), {}
        for take in landed:
            self._release(take)

    def take(self, push: int) -> AdapterTake | None:
        """Push ``push``, landed and checked (None: it did not land here). Registrations come
        in the order of their pushes: the pushes before it that landed here will not be
        taken (another worker refused them), and their memory goes back."""
        with self._lock:
            take = self._landed.pop(push, None)
            gone = [self._landed.pop(p) for p in [p for p in self._landed if p < push]]
        for old in gone:
            self._release(old)
        return take

    def _closed(self) -> None:
        self.release_all()  # every landed push's memory goes back

    def _land(self, stream: torch.cuda.Stream | None) -> None:
        take: AdapterTake | None = None

        def load(batch: Batch) -> None:
            nonlocal take
            if take is None:
                layout = self._layout
                if layout is None:
                    raise WeightSyncError("no adapter layout was announced to this worker")
                take = AdapterTake(self.device, layout, self._lend(layout))
            take.load(batch)

        def check(report: ReceiveReport) -> None:
            if take is None:
                raise WeightSyncError(f"push {report.push}: the adapter push delivered no tensor")
            take.check(report)
            if report.fingerprints and take.verified[1]:
                raise WeightSyncError(  # (a verdict that passed says every tensor matched)
                    f"push {report.push}: {take.verified[1]} adapter tensors came without a"
                    " fingerprint"
                )
            with self._lock:
                self._landed[report.push] = take

        try:
            self._receiver.receive(load, check=check)
        except Exception as exc:
            self.failed += 1
            self.last_failure = f"{type(exc).__name__}: {exc}"
            with self._lock:
                kept = take is not None and any(t is take for t in self._landed.values())
            if take is not None and not kept:
                self._release(take)
            raise
        self.landed += 1

    def _release(self, take: AdapterTake) -> None:
        self._give_back(take.landing)
