"""The weight sender's waits on device work: its own staging copies and the receivers' loads.

Each wait comes twice: blocking, for the packing thread, and polled on the event loop, for a
backend whose packing only queues device work (``Backend.inline_packing``).

Invariants:

* a receiver's load events are polled from the host, never waited on by a stream of ours: an
  event of a process that died never fires;
* every wait is bounded by ``ack_timeout`` (one bound for all the readers of a buffer), and a
  timeout names what did not finish: the receiver, or our copies;
* a receiver that left is not waited for; a wait stops once the sender closes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Final

from asyncroll.errors import TransportTimeoutError
from asyncroll.transport.backends import Backend, apoll_until, poll_until
from asyncroll.transport.peers import ControlPlane

__all__ = ["DeviceWaits", "Readers"]

Readers = list[tuple[bytes, object]]
"""(receiver, its load event) of the receivers last sent a buffer."""

_COPIES_LATE: Final = (
    "the staging copies did not finish within {:g} s (device work queued before the push,"
    " which the copies wait for, is still running?)"
)
_SOURCES_LATE: Final = (
    "the device work queued before the one-copy push (which writes the tensors it shares) did"
    " not finish within {:g} s"
)


class DeviceWaits:
    """Bounded waits on the device, for the sender's push pipeline."""

    def __init__(self, *, control: ControlPlane, backend: Backend, ack_timeout: float) -> None:
        self._control = control
        self._backend = backend
        self._ack_timeout = ack_timeout

    def __repr__(self) -> str:
        return f"<DeviceWaits {self._backend.name} within {self._ack_timeout:g} s>"

    def readers(self, index: int, loaders: list[bytes]) -> Readers:
        """(receiver, load event of buffer ``index``) of those of ``loaders`` still here."""
        readers = []
        for identity in loaders:
            peer = self._control.peers.get(identity)
            if peer is not None and peer.load_events is not None:
                readers.append((identity, peer.load_events[index]))
        return readers

    def loads(self, readers: Readers) -> None:
        """Poll receivers' load events from the host (never on our stream: an event of a process
        that died never fires). A receiver that left is not waited for."""
        for done, within, give_up, identity in self._load_polls(readers):
            try:
                poll_until(done, within=within, give_up=give_up)
            except TimeoutError:
                raise self._loads_late(identity) from None
            if self._control.closed:
                self._control.check_usable()  # TransportClosedError, naming the sender

    async def poll_loads(self, readers: Readers) -> None:
        """``loads`` on the event loop."""
        for done, within, give_up, identity in self._load_polls(readers):
            self._control.check_usable()
            try:
                await apoll_until(done, within=within, give_up=give_up)
            except TimeoutError:
                raise self._loads_late(identity) from None
        self._control.check_usable()

    def copies(self, marker: object) -> None:
        """Wait (bounded) for our copies up to ``marker``."""
        try:
            self._backend.finish_copies(marker, within=self._ack_timeout)
        except TimeoutError:
            raise TransportTimeoutError(_COPIES_LATE.format(self._ack_timeout)) from None

    async def poll_copies(self, marker: object) -> None:
        """``copies`` on the event loop."""
        try:
            await apoll_until(
                functools.partial(self._backend.copies_done, marker),
                within=self._ack_timeout,
                give_up=lambda: self._control.closed,
            )
        except TimeoutError:
            raise TransportTimeoutError(_COPIES_LATE.format(self._ack_timeout)) from None
        self._control.check_usable()

    async def poll_sources(self, sources_done: Callable[[], bool]) -> None:
        """On the event loop: the work queued before the push (the trainer's last writes to
        the tensors a one-copy push shares) is done; no thread hop where it already is."""
        try:
            await apoll_until(
                sources_done, within=self._ack_timeout, give_up=lambda: self._control.closed
            )
        except TimeoutError:
            raise TransportTimeoutError(_SOURCES_LATE.format(self._ack_timeout)) from None
        self._control.check_usable()

    def _load_polls(
        self, readers: Readers
    ) -> Iterator[tuple[Callable[[], bool], float, Callable[[], bool], bytes]]:
        """For each reader in turn, within one ``ack_timeout`` for all: (its loads are done,
        the seconds left, it left or we closed, who)."""
        deadline = time.monotonic() + self._ack_timeout
        for identity, event in readers:
            yield (
                functools.partial(self._backend.peer_loads_done, event),
                max(0.0, deadline - time.monotonic()),
                functools.partial(self._left_or_closed, identity),
                identity,
            )

    def _loads_late(self, identity: bytes) -> TransportTimeoutError:
        return TransportTimeoutError(
            f"{self._control.describe(identity)} did not finish loading a bucket on the device"
            f" within {self._ack_timeout:g} s"
        )

    def _left_or_closed(self, identity: bytes) -> bool:
        return self._control.closed or identity not in self._control.peers
