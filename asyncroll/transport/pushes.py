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
  latest until the push ends;
* a push that asks for verdicts (``wire.Verdict``) returns only once every receiver it went
  to has checked what it loaded and said so; a failed check, or a receiver that leaves or
  stays silent meanwhile, fails the push (its End has gone: nothing is sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import torch

from asyncroll.errors import (
    TransportBrokenError,
    TransportClosedError,
    TransportTimeoutError,
    WeightSyncError,
)
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
    verdicts: dict[bytes, str] | None = None
    """Each receiver's verdict by identity (``wire.Verdict``; "": its check passed), where
    the push asks for them (None: it does not)."""


class Pushes:
    """The sender's pushes: the one in flight, and the counts of those done."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        self._ids = 0
        self.current: PushState | None = None
        """The push in flight."""
        self.judged: PushState | None = None
        """The push whose receivers' verdicts are awaited (its End sent)."""
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
        verdicts_within: float | None = None,
    ) -> AsyncIterator[PushState]:
        """One push from its first message to its End; a failure is counted, ended, re-raised.
        ``verdicts_within``: the End asks each receiver for its verdict, and the push waits
        for them (at most so many seconds).

        Raises:
            WeightSyncError: no receiver is ready; a receiver's check failed.
            TransportBrokenError: a receiver left before its verdict.
            TransportTimeoutError: a receiver gave no verdict in time.
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
            verdicts={} if verdicts_within is not None else None,
        )
        ended = False
        try:
            yield state
            if state.verdicts is not None:
                self.judged = state  # (a verdict may come as soon as its End is sent)
            await self._send_end(state, buckets, error="", verdict=state.verdicts is not None)
            ended = True
            state.ended = time.perf_counter()
            if verdicts_within is not None:
                await self._judged(state, verdicts_within)
        except BaseException as exc:
            self.failed += 1
            if not ended:
                await shielded(self._send_end(state, buckets, error=_describe_exc(exc)))
            raise
        finally:
            self.current = None
            if self.judged is state:
                self.judged = None
            for made in state.made:
                made.clear()

    def on_verdict(self, identity: bytes, verdict: wire.Verdict) -> None:
        """A receiver's verdict on the push awaiting them (others are late: dropped)."""
        state = self.judged
        if state is not None and state.verdicts is not None and verdict.push == state.id:
            state.verdicts.setdefault(identity, verdict.error)

    async def _judged(self, state: PushState, within: float) -> None:
        """Wait for the verdict of every receiver the push went to."""
        assert state.verdicts is not None
        verdicts = state.verdicts
        peers = self._control.peers

        def answered() -> bool:
            return all(
                p.identity in verdicts or p.identity not in peers for p in state.peers
            )

        try:
            await self._control.wait(answered, within=within)
        except TimeoutError:
            silent = [p.describe() for p in state.peers if p.identity not in verdicts]
            raise TransportTimeoutError(
                f"no verdict on push {state.id} (version {state.version}) from"
                f" {', '.join(silent)} within {within:g} s"
            ) from None
        for peer in state.peers:
            if peer.identity not in verdicts:
                raise TransportBrokenError(
                    f"{peer.describe()} left before its verdict on push {state.id}"
                    f" (version {state.version})"
                )
            if verdicts[peer.identity]:
                raise WeightSyncError(
                    f"{peer.describe()} failed its check of push {state.id} (version"
                    f" {state.version}): {verdicts[peer.identity]}"
                )

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

    async def _send_end(
        self, state: PushState, buckets: int, *, error: str, verdict: bool = False
    ) -> None:
        for peer in state.peers:
            if peer.identity in self._control.peers:
                with contextlib.suppress(TransportBrokenError, TransportClosedError):
                    await self._control.send(
                        peer,
                        lambda p, seq: wire.End(
                            conn=p.conn, seq=seq, push=state.id, version=state.version,
                            buckets=buckets, error=error, verdict=verdict,
                        ),
                    )


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "push cancelled by the sender"
    return f"{type(exc).__name__}: {exc}"[:2000]
