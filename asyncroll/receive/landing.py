"""A full-weight push landed while the engine steps, committed later between two steps.

An ``inflight`` update received inside its commit RPC holds the engine for the whole receive:
every wait for the trainer's next message, the copies, the backup of the served weights, the
check. ``WeightLanding`` moves all of that off the engine's step loop. Its thread (one per
worker, with a receiver and, on a GPU, a CUDA stream of its own) takes each push as it comes,
while the engine steps:

- a staged push is copied out of the transport's buffers into memory the landing keeps (an
  arena, one tensor per name, kept from one push to the next); a one-copy push's tensors are
  the trainer's own storages, kept mapped and read later in place (the trainer's ``update``
  does not return before the commit, so they do not change meanwhile);
- every landed tensor is checked against the sender's fingerprints;
- ``prepare`` runs (the worker refreshes its backup of the served weights there);
- the sender hears the verdict (``WeightSender.push(verdicts=True)``).

The commit (``LandedPush.replay``) then hands the landed tensors to the worker's usual load
in one batch whose sources persist, as a one-copy push does: the load plan's device copies
into the served parameters, the check of the parameters, the rollback if anything fails. Only
that runs between two steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from asyncroll.errors import WeightSyncError
from asyncroll.fingerprints import Fingerprinter
from asyncroll.transport.openmp import one_openmp_thread
from asyncroll.transport.receiver import (
    LoadFn,
    ReceiveReport,
    WeightReceiver,
    persistent_batch,
)

__all__ = ["LandedPush", "ReceivingThread", "WeightLanding"]

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
"""How often the landing thread, idle between pushes, looks whether it should stop."""

def _switch_seconds(text: str | None, default: float = 0.0005) -> float:
    """``ASYNCROLL_LANDING_SWITCH_SECONDS``, or ``default`` where it is unset or not a
    positive number (``sys.setswitchinterval`` refuses those: every landing would fail)."""
    try:
        value = float(text) if text else default
    except ValueError:
        value = default
    if not value > 0 or value == float("inf"):
        logger.warning("ASYNCROLL_LANDING_SWITCH_SECONDS=%r is not a positive number of seconds:"
                       " %g used", text, default)
        return default
    return value


SWITCH_SECONDS = _switch_seconds(os.environ.get("ASYNCROLL_LANDING_SWITCH_SECONDS"))
"""The interpreter's switch interval while a push lands (``sys.setswitchinterval``; 5 ms by
default). The landing thread's Python runs while the engine's step waits on the device with
the GIL released; when that wait ends, the step may wait for the GIL up to one interval. With
a push landing, the step an inflight commit waits behind ran 1.5-7 ms longer than a received
commit's on an H200 (the commit's gap split by the steps' ends, docs/performance.md); one A/B
of this setting, order crossed on two GPUs, shortened that step on one GPU and not the other.
Between pushes the landing thread waits in ``poll`` and nothing changes.
``ASYNCROLL_LANDING_SWITCH_SECONDS`` sets it (0.005 keeps Python's default: an A/B)."""

Batch = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class LandedPush:
    """One push, landed and checked: its tensors (in the landing's memory, or the trainer's
    storages), and the receiver's report of it (with the sender's fingerprints)."""

    push: int
    report: ReceiveReport
    tensors: tuple[tuple[str, torch.Tensor], ...]
    layout: object
    """Equal for two landed pushes only if their tensors are the same views in the same
    order (a load plan keys what it learned by it: ``persistent_batch``)."""

    def replay(self, load: LoadFn) -> ReceiveReport:
        """Hand every landed tensor to ``load``, in one batch that is the whole push and whose
        sources persist; returns the push's report, as a receive would."""
        load(persistent_batch(self.tensors, layout=self.layout))
        return self.report


_switches = threading.Lock()
_landing_now = 0
_interval_before = 0.0


@contextlib.contextmanager
def eager_switches() -> Iterator[None]:
    """``SWITCH_SECONDS`` as the switch interval inside, restored once no thread of this
    process lands a push (landing threads of several pushers may overlap)."""
    global _landing_now, _interval_before
    with _switches:
        if _landing_now == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval_before, SWITCH_SECONDS))
        _landing_now += 1
    try:
        yield
    finally:
        with _switches:
            _landing_now -= 1
            if _landing_now == 0:
                sys.setswitchinterval(_interval_before)


class ReceivingThread:
    """A receiver of its own, used by a thread of its own (on a GPU, under a CUDA stream of
    its own): the thread waits for each push and hands it to ``_land``. Subclasses:
    ``WeightLanding`` here, ``asyncroll.receive.adapter.Landings``."""

    def __init__(self, receiver: WeightReceiver, device: torch.device, *, name: str) -> None:
        self._receiver = receiver
        self.device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def close(self, *, within: float = 10.0) -> None:
        """Stop the thread (once its push in progress ends), close the receiver, let go of
        what was landed (``_closed``). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(within)
        if self._thread.is_alive():
            logger.warning("%r: the landing thread did not stop in %g s", self, within)
            return  # its receiver is its own: not closed under it
        self._receiver.close()
        self._closed()

    def _closed(self) -> None:
        """Once the thread has stopped and the receiver is closed."""

    def _land(self, stream: torch.cuda.Stream | None) -> None:
        """Receive one push (the receiver has a message waiting)."""
        raise NotImplementedError

    def _run(self) -> None:
        stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        else:  # single-threaded on the host: no OpenMP team of its own beside the engine's
            one_openmp_thread()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while not self._stop.is_set():
                try:
                    if self._receiver.poll(POLL_SECONDS):
                        with eager_switches():
                            self._land(stream)
                except Exception as exc:
                    if self._stop.is_set():
                        return
                    logger.warning("%r: %s", self, exc)


class WeightLanding(ReceivingThread):
    """Full-weight pushes received on a thread of their own (see the module doc); the last
    one that landed waits for ``take``.

    Args:
        receiver: Connected; this object's thread is its only user from now on.
        device: The worker's device (the arena's, and the stream's).
        prepare: Called on the thread once a push has landed and passed its check, before
            the sender hears the verdict (the worker's backup of its served weights).
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        device: torch.device,
        *,
        prepare: Callable[[], None] | None = None,
        name: str = "asyncroll-landing",
    ) -> None:
        super().__init__(receiver, device, name=name)
        self._prepare = prepare
        self._arena: dict[str, torch.Tensor] = {}
        self._layout: tuple[tuple[tuple[str, int], ...], object] | None = None
        self._fingerprinter = Fingerprinter()
        self._landed: LandedPush | None = None
        self._lock = threading.Lock()
        self.landed = self.failed = 0
        self.last_failure = ""
        self._start()

    def __repr__(self) -> str:
        waiting = self._landed.push if self._landed is not None else None
        return f"<WeightLanding landed={self.landed} failed={self.failed} waiting={waiting}>"

    @property
    def arena_bytes(self) -> int:
        """The memory the landing keeps for staged pushes."""
        return sum(t.numel() * t.element_size() for t in self._arena.values())

    def holds(self, push: int) -> bool:
        """Push ``push`` has landed and waits for ``take``."""
        landed = self._landed
        return landed is not None and landed.push == push

    def take(self, push: int) -> LandedPush | None:
        """Push ``push``, landed and checked (None: it did not land here, or not last)."""
        with self._lock:
            landed = self._landed
            if landed is None or landed.push != push:
                return None
            self._landed = None
            return landed

    def _closed(self) -> None:
        with self._lock:
            self._landed = None
        self._arena.clear()

    def _land(self, stream: torch.cuda.Stream | None) -> None:
        with self._lock:
            self._landed = None  # a new push: the one before will not be committed
        tensors: list[tuple[str, torch.Tensor]] = []
        shared: list[object] = []

        def load(batch: Batch) -> None:
            parts = getattr(batch, "parts", None)
            if parts:
                raise WeightSyncError(
                    f"pieces of tensors ({next(iter(parts))!r}, ...) do not land: an inflight"
                    " update lands whole tensors"
                )
            if getattr(batch, "whole_push", False):  # one copy: the trainer's storages
                tensors.extend(batch)
                shared.append(getattr(batch, "layout", None) or object())
                return
            targets = [self._slot(name, tensor) for name, tensor in batch]
            with torch.no_grad():
                torch._foreach_copy_(targets, [tensor for _, tensor in batch])
            tensors.extend(zip((name for name, _ in batch), targets, strict=True))

        def check(report: ReceiveReport) -> None:
            if not tensors:
                raise WeightSyncError(f"push {report.push} delivered no tensor")
            pushed = report.fingerprints
            if pushed:
                landed = dict(tensors)
                missing = sorted(set(landed) - set(pushed))
                if missing:
                    raise WeightSyncError(
                        f"push {report.push}: {len(missing)} tensors came without a fingerprint:"
                        f" {missing[:5]}"
                    )
                wrong = self._fingerprinter.differing(landed, pushed)
                if wrong:
                    raise WeightSyncError(
                        f"push {report.push}: {len(wrong)} tensors differ from what was pushed"
                        f" (fingerprints): {wrong[:5]}"
                    )
            if self._prepare is not None:
                self._prepare()
            if stream is not None:
                stream.synchronize()  # the commit's copies, on another stream, read all this
            if not shared:  # names no longer pushed give their memory back
                for name in set(self._arena) - {name for name, _ in tensors}:
                    del self._arena[name]
            layout = shared[0] if shared else self._layout_of(tensors)
            with self._lock:
                self._landed = LandedPush(report.push, report, tuple(tensors), layout)
            self.landed += 1  # (before the verdict: the sender may read it once it returns)

        try:
            self._receiver.receive(load, check=check)
        except Exception as exc:
            self.failed += 1
            self.last_failure = f"{type(exc).__name__}: {exc}"
            raise

    def _slot(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The arena's tensor for ``name``, shaped as ``like`` (new memory where it was not)."""
        held = self._arena.get(name)
        if held is None or held.dtype != like.dtype or held.shape != like.shape:
            held = self._arena[name] = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return held

    def _layout_of(self, tensors: list[tuple[str, torch.Tensor]]) -> object:
        """The landing's token for these views (the same as the last push's, where they are)."""
        key = tuple((name, tensor.data_ptr()) for name, tensor in tensors)
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, object())
        return self._layout[1]
