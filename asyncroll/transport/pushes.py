"""The weight sender's pushes, one at a time: each one's state, its End, its count.

``Pushes.open`` frames one push, from the receivers it goes to to its End; the pipeline
(``pipeline.PushPipeline``) moves the bytes in between, and the sender's control-plane hooks
fail the push in flight (``Pushes.current``) when a receiver fails or leaves.

Invariants:

* a push goes to the receivers ready when it begins (none: it fails at once), and each of them
  is sent every bucket and the End;
* every push ends with an End to each receiver still here, naming the error if it failed (and
  then counted as failed once), even when its caller is cancelled; so does a push called off
  before it began, where its receivers were already waiting for it (``call_off``);
* the lazy tensors a push made for a buffer live until the buffer's copies are done, at the
  latest until the push ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import torch

from asyncroll.errors import TransportBrokenError, TransportClosedError, WeightSyncError
from asyncroll.transport import wire
from asyncroll.transport.aio import shielded
from asyncroll.transport.lazy import LazyTensor, Makes
from asyncroll.transport.peers import ControlPlane, Peer
from asyncroll.transport.reports import PushReport, SenderBucketTimes

__all__ = ["Fingerprint", "Prints", "PushState", "Pushes"]

Fingerprint = Callable[[dict[str, torch.Tensor], dict[str, torch.dtype]], dict[str, bytes]]
"""Fingerprints the lazy tensors made for a bucket, as the dtypes pushed."""
Prints = Mapping[str, bytes] | Callable[[], Mapping[str, bytes]]
"""A push's fingerprints, or what takes them once its first buckets are signalled."""


@dataclass(slots=True, kw_only=True)
class PushState:
    """One push in flight."""

    id: int
    version: int
    peers: list[Peer]
    """The receivers ready when the push began: each is sent every bucket and the End."""
    failure: BaseException | None = None
    """A receiver failed or left (the sender's hooks say so): the push raises it."""
    prints_after: int = 0
    """The bucket whose signal the push's fingerprints follow (``wire.Prints``)."""
    fingerprints: dict[str, bytes] = field(default_factory=dict)
    """The push's, for its Prints (those of its lazy tensors join as they are made)."""
    later_prints: Callable[[], Mapping[str, bytes]] | None = None
    """Takes the push's fingerprints when its Prints are sent (``Prints``' callable form)."""
    makes: Makes | None = None
    """The push's lazy tensors (``LazyTensor``), made as their buckets are packed."""
    fingerprint: Fingerprint | None = None
    """Fingerprints the lazy tensors made for each bucket (into ``fingerprints``)."""
    pieces: frozenset[str] = frozenset()
    """The push's tensors that are pieces (never fingerprinted as if whole)."""
    ended: float = 0.0
    """When the End was sent to every receiver."""
    made: list[list[torch.Tensor]] = field(default_factory=list)
    """Per staging buffer, the lazy tensors made for its bucket: alive until the buffer's
    copies are done (the next bucket into it, or the end of the push)."""


class Pushes:
    """The sender's pushes: the one in flight, and the counts of those done."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        self._ids = 0
        self.current: PushState | None = None
        """The push in flight."""
        self.succeeded = self.failed = self.bytes_pushed = 0

    def __repr__(self) -> str:
        return f"<Pushes succeeded={self.succeeded} failed={self.failed}>"

    @property
    def begun(self) -> int:
        """How many pushes began or were called off (each was given an id and ended with an
        End)."""
        return self._ids

    async def call_off(self, version: int, exc: BaseException) -> None:
        """A push that failed before it began, its receivers already waiting for it: count it
        as failed and send them its End, naming the error (each raises it)."""
        peers = self._control.ready_peers()
        self._ids += 1
        self.failed += 1
        state = PushState(id=self._ids, version=version, peers=peers)
        await self._send_end(state, 0, error=_describe_exc(exc))

    @contextlib.asynccontextmanager
    async def open(
        self,
        version: int,
        *,
        buckets: int,
        buffers: int,
        fingerprints: Prints | None,
        makes: Makes | None = None,
        fingerprint: Fingerprint | None = None,
        pieces: frozenset[str] = frozenset(),
    ) -> AsyncIterator[PushState]:
        """One push from its first message to its End; a failure is counted, ended, re-raised.

        Raises:
            WeightSyncError: no receiver is ready.
        """
        peers = self._control.ready_peers()
        if not peers:
            raise WeightSyncError("no receiver is connected")
        self._ids += 1
        # Fingerprints of lazy tensors are known once the last bucket is packed.
        prints_after = buckets - 1 if makes is not None else buckets // 2
        later = fingerprints if callable(fingerprints) else None
        given = fingerprints if fingerprints is not None and not callable(fingerprints) else {}
        state = self.current = PushState(
            id=self._ids, version=version, peers=peers, prints_after=prints_after,
            fingerprints=dict(given),
            later_prints=later, makes=makes, fingerprint=fingerprint, pieces=pieces,
            made=[[] for _ in range(buffers)],
        )
        try:
            yield state
            await self._send_end(state, buckets, error="")
            state.ended = time.perf_counter()
        except BaseException as exc:
            self.failed += 1
            await shielded(self._send_end(state, buckets, error=_describe_exc(exc)))
            raise
        finally:
            self.current = None
            for made in state.made:
                made.clear()

    def report(
        self,
        state: PushState,
        tensors: Mapping[str, torch.Tensor | LazyTensor],
        *,
        buckets: int,
        started: float,
        pack_s: float,
        wait_s: float,
        timeline: tuple[SenderBucketTimes, ...] = (),
    ) -> PushReport:
        """Count a push that succeeded and report it."""
        seconds = time.perf_counter() - started
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.succeeded += 1
        self.bytes_pushed += nbytes
        return PushReport(
            version=state.version, bytes=nbytes, buckets=buckets, tensors=len(tensors),
            receivers=len(state.peers), seconds=seconds, pack_seconds=pack_s,
            wait_seconds=wait_s, timeline=timeline, began=started, ended=state.ended,
        )

    async def send_prints(self, state: PushState) -> None:
        """The push's fingerprints, once: after a signal, so the receiver decodes them while it
        waits for the next bucket (58 KB for a 7B model: about 0.4 ms at the end of a push).
        Fingerprints given as a callable are taken now: their reads overlap the receivers'
        copies of the buckets signalled."""
        if state.later_prints is not None:
            later, state.later_prints = state.later_prints, None
            state.fingerprints.update(later())
        if not state.fingerprints:
            return
        for peer in state.peers:
            await self._control.send(
                peer,
                lambda p, seq: wire.Prints(
                    conn=p.conn, seq=seq, push=state.id, fingerprints=state.fingerprints
                ),
            )

    async def _send_end(self, state: PushState, buckets: int, *, error: str) -> None:
        for peer in state.peers:
            if peer.identity in self._control.peers:
                with contextlib.suppress(TransportBrokenError, TransportClosedError):
                    await self._control.send(
                        peer,
                        lambda p, seq: wire.End(
                            conn=p.conn, seq=seq, push=state.id, version=state.version,
                            buckets=buckets, error=error,
                        ),
                    )


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "push cancelled by the sender"
    return f"{type(exc).__name__}: {exc}"[:2000]
