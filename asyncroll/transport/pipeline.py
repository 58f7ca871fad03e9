"""The weight push's per-bucket hot path: pack each bucket into a free buffer, signal it, wait.

``PushPipeline.run`` is the whole loop of a staged push: for each bucket of the plan, wait until
its staging buffer is free, pack the bucket into it, and signal it to every receiver of the push;
then wait for the last acks and loads. ``run_shared`` is the one-copy push: no staging, one
message. Around them: the buffers and who holds them (``staging``), the waits on the device
(``waits``), one push's state and its End (``pushes``), the receivers (``peers``).

Invariants:

* a buffer is rewritten only after every receiver that was sent its bucket has acked it (or left)
  and the device finished their reads (the load events they recorded, polled from the host: no
  stream of ours ever waits on another process's device work);
  packing bucket k+1 into one buffer overlaps receivers loading bucket k from the other;
* with asynchronous copies (CUDA), a bucket is signalled as soon as its copies are queued when
  every receiver of the push polls our copy events (``Backend.export_copy_events``): each
  receiver reads a buffer only once the buffer's copy event has fired, so signalling, waking
  and acking all overlap the device's copies. Otherwise a bucket is signalled only once its
  copies are done; with three or more buffers one step late: bucket k+1's copies are queued
  before bucket k is signalled. Never with two: packing k+1 then needs the buffer of k-1, so
  k's signal would wait for the receiver to finish k-1 and the receiver would idle between
  buckets (this halved the end-to-end rate of a 7B push on an H100); a push returns only once
  its copies are done, whoever polled them;
* packing that blocks (shared memory) runs in the staging's one worker thread, FIFO, so a push
  cancelled mid-pack can never race the next push's packing of the same buffer; packing that
  only queues device work (CUDA: ``Backend.inline_packing``) runs on the event loop, in the
  copy stream's order, and its device waits are polls that let the loop run;
* every wait is bounded (``ack_timeout``) and a timeout names the receiver and the bucket that
  did not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar, cast

import torch

from asyncroll.errors import TransportTimeoutError
from asyncroll.transport import wire
from asyncroll.transport.aio import shielded
from asyncroll.transport.backends import Backend, CudaIpcBackend
from asyncroll.transport.lazy import LazyTensor, Makes
from asyncroll.transport.packing import bucket_spans, dtype_name, fused_slots, pack_bucket
from asyncroll.transport.peers import ControlPlane, Peer
from asyncroll.transport.plan import Bucket
from asyncroll.transport.pushes import Fingerprint, Prints, Pushes, PushState
from asyncroll.transport.reports import PushReport, SenderBucketTimes
from asyncroll.transport.shared import SharedStorages
from asyncroll.transport.staging import Staging
from asyncroll.transport.waits import DeviceWaits, Readers

__all__ = ["PushPipeline"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_Sources = Mapping[str, torch.Tensor | LazyTensor]
_Stamps = list[dict[str, float]]
"""Per bucket so far, its ``SenderBucketTimes`` stamps by name."""


class PushPipeline:
    """Runs the sender's pushes through its staging buffers, one at a time (the caller's lock)."""

    def __init__(
        self,
        *,
        control: ControlPlane,
        backend: Backend,
        staging: Staging,
        shared: SharedStorages,
        pushes: Pushes,
        ack_timeout: float,
    ) -> None:
        self._control = control
        self._backend = backend
        self._staging = staging
        self._shared = shared
        self.shared_repeats = 0
        """One-copy messages sent as a repeat of the list the receiver held (by its id)."""
        self._pushes = pushes
        self._ack_timeout = ack_timeout
        self._waits = DeviceWaits(control=control, backend=backend, ack_timeout=ack_timeout)
        self._late_signals = backend.async_copies and staging.count > 2
        """Signal bucket k once bucket k+1's copies are queued (see ``run``)."""
        self._raw_copies = backend.async_copies
        """Queue a bucket's copies as address ranges (``Backend.queue_spans``) where the
        backend can: device copies, whose host cost is on every bucket's path."""

    def __repr__(self) -> str:
        return f"<PushPipeline {self._staging!r} {self._pushes!r}>"

    async def run(
        self,
        plan: list[Bucket],
        tensors: _Sources,
        version: int,
        *,
        fingerprints: Prints | None,
        makes: Makes | None = None,
        fingerprint: Fingerprint | None = None,
        pieces: frozenset[str] = frozenset(),
        verdicts_within: float | None = None,
    ) -> PushReport:
        """A staged push of ``tensors``, bucket by bucket as ``plan`` says (``verdicts_within``:
        ``Pushes.open``)."""
        started = time.perf_counter()
        pack_s = wait_s = 0.0
        # With asynchronous copies (CUDA) and three or more buffers, a bucket is signalled one
        # step late: once bucket k+1's copies are queued, we wait for bucket k's and signal it,
        # so the device always has the next copies at hand while Python signals and acks.
        # (With two, k+1's buffer is k-1's: k's signal would wait for k-1's ack.)
        unsignalled: tuple[Bucket, int, object] | None = None
        stamps: _Stamps = []
        clock = time.perf_counter
        # Packing on the loop only where it only queues device work: a copy from host memory
        # would block the loop (the packing thread takes such pushes).
        inline = getattr(self._backend, "inline_packing", False) and all(
            t.is_cuda for t in tensors.values()
        )
        async with self._pushes.open(
            version, buckets=len(plan), buffers=self._staging.count, fingerprints=fingerprints,
            makes=makes, fingerprint=fingerprint, pieces=pieces, verdicts_within=verdicts_within,
        ) as state:
            self._backend.mark_sources_ready()
            # Signal each bucket as soon as its copies are queued: every receiver polls the
            # buffer's copy event before it reads.
            early = bool(self._staging.copy_events) and all(p.polls_copies for p in state.peers)
            marker: object = None
            for bucket in plan:
                index = bucket.index % len(self._staging.buffers)
                stamp = {"waited": clock()}
                stamps.append(stamp)
                await self._wait_buffer_free(index, state)
                stamp["free"] = clock()
                readers = self._waits.readers(index, self._staging.loaders(index))
                previous = unsignalled[2] if unsignalled is not None else None
                if inline:
                    marker = await self._pack_here(
                        state, bucket, index, tensors, readers, previous, stamps, early
                    )
                else:
                    marker = await self._in_packer(
                        self._pack, state, bucket, index, tensors, readers, previous, stamps,
                        early,
                    )
                wait_s += stamp["free"] - stamp["waited"]
                pack_s += clock() - stamp["free"]
                if unsignalled is not None:
                    await self._send_bucket(unsignalled[0], unsignalled[1], state)
                    stamps[-2]["signalled"] = clock()
                    unsignalled = None
                if self._late_signals and not early:
                    unsignalled = (bucket, index, marker)
                else:
                    await self._send_bucket(bucket, index, state, copying=early)
                    stamp["signalled"] = clock()
            t0 = clock()
            if early and marker is not None:  # our copies are done before the push returns
                await self._copies_done(marker, inline=inline)
            if unsignalled is not None:
                await self._copies_done(unsignalled[2], inline=inline)
                stamps[-1]["copied"] = clock()
                await self._send_bucket(unsignalled[0], unsignalled[1], state)
                stamps[-1]["signalled"] = clock()
            await self._wait_all_free(state, inline=inline)
            wait_s += clock() - t0
        timeline = tuple(
            SenderBucketTimes(bucket=i, **stamp)
            for i, stamp in enumerate(stamps)
            if len(stamp) == 6
        )
        return self._pushes.report(
            state, tensors, buckets=len(plan), started=started, pack_s=pack_s, wait_s=wait_s,
            timeline=timeline,
        )

    async def run_shared(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        *,
        fingerprints: Prints | None,
        verdicts_within: float | None = None,
    ) -> PushReport:
        """One-copy mode: one message naming every tensor's storage and place; one ack from
        each receiver once its reads are done on the device."""
        backend = self._backend
        assert isinstance(backend, CudaIpcBackend)
        started = time.perf_counter()
        opened = self._pushes.open(
            version, buckets=1, buffers=0, fingerprints=fingerprints,
            verdicts_within=verdicts_within,
        )
        async with opened as state:
            await self._wait_buffer_free(0, state)  # no bucket of an earlier push pending
            free = time.perf_counter()
            backend.mark_sources_ready()
            storages, entries, used = self._shared.share(backend, tensors)
            t0 = time.perf_counter()
            await self._waits.poll_sources(backend.sources_done)
            t1 = time.perf_counter()
            self._hold(0, state, bucket=0, loads=False)  # receivers synchronise before they ack
            layout = self._shared.layout

            def full(p: Peer, seq: int) -> wire.Message:
                return wire.Shared(
                    conn=p.conn, seq=seq, push=state.id, version=version, storages=storages,
                    entries=entries, layout=layout,
                )

            def again(p: Peer, seq: int) -> wire.Message:  # the list it holds: its id will do
                return wire.Shared(
                    conn=p.conn, seq=seq, push=state.id, version=version, storages=[],
                    entries=[], layout=layout, repeat=True,
                )

            for peer in state.peers:
                repeat = peer.shared_layout == layout
                self.shared_repeats += repeat
                await self._control.send(peer, again if repeat else full)
            signalled = time.perf_counter()
            await self._pushes.send_prints(state)
            t2 = time.perf_counter()
            await self._wait_buffer_free(0, state)
            acked = time.perf_counter()
            wait_s = acked - t2
        self._shared.keep_only(used)  # receivers release what the next push does not list
        # The one message's way, in a staged bucket's terms: sharing is its "queue", the
        # wait for the trainer's last writes its "copies".
        times = SenderBucketTimes(
            bucket=0, waited=started, free=free, loads_done=free, queued=t0, copied=t1,
            signalled=signalled, acked=acked,
        )
        return self._pushes.report(
            state, tensors, buckets=1, started=started, pack_s=t1 - t0, wait_s=wait_s,
            timeline=(times,),
        )

    async def drain(self, makes: Makes) -> None:
        """Make (and drop) the lazy tensors of a failed push not made yet: other ranks may
        wait for them in collectives."""
        try:
            await shielded(self._in_packer(makes.drain))
        except Exception:
            log.warning("could not make the failed push's other tensors", exc_info=True)

    async def _in_packer(self, function: Callable[..., _T], *args: object) -> _T:
        """Run ``function`` in the packing thread (FIFO); TransportClosedError once closed."""
        self._control.check_usable()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._staging.packer, function, *args
            )
        except RuntimeError:  # the executor was shut down by aclose() meanwhile
            self._control.check_usable()
            raise
        self._control.check_usable()  # aclose() may have run while the thread worked
        return result

    # ---------------------------------------------------------------- waits

    async def _wait_buffer_free(self, index: int, state: PushState) -> None:
        staging = self._staging

        def what() -> str:
            holders = ", ".join(self._control.describe(i) for i in staging.holders(index))
            push, bucket = staging.holding(index) or (0, -1)
            return (
                f"{holders} did not ack bucket {bucket} of push {push} (version {state.version})"
                f" within {self._ack_timeout:g} s"
            )

        try:
            await self._control.wait(
                lambda: state.failure is not None or staging.is_free(index),
                within=self._ack_timeout,
            )
        except TimeoutError:
            raise TransportTimeoutError(what()) from None
        if state.failure is not None:
            raise state.failure

    async def _wait_all_free(self, state: PushState, *, inline: bool) -> None:
        """Every buffer acked, then the receivers' loads done on the device (acks may precede
        them: load events)."""
        count = len(self._staging.buffers)
        for index in range(count):
            await self._wait_buffer_free(index, state)
        loaders = self._staging.loaders
        readers = [r for i in range(count) for r in self._waits.readers(i, loaders(i))]
        if inline:
            await self._waits.poll_loads(readers)
        else:
            await self._in_packer(self._waits.loads, readers)

    async def _copies_done(self, marker: object, *, inline: bool) -> None:
        if inline:
            await self._waits.poll_copies(marker)
        else:
            await self._in_packer(self._waits.copies, marker)

    # ---------------------------------------------------------------- a bucket: pack

    def _pack(
        self, state: PushState, bucket: Bucket, index: int, tensors: _Sources, readers: Readers,
        previous: object | None, stamps: _Stamps, early: bool = False,
    ) -> object:
        """Wait until the buffer's last readers finished on the device, queue the bucket's
        copies, then (if given) wait for the previous bucket's, or (``early``: receivers poll
        the copy events) for none. Returns this one's marker. Stamps ``loads_done``,
        ``queued`` and ``copied`` (the last, of the bucket waited for)."""
        self._waits.loads(readers)
        marker = self._queue(state, bucket, index, tensors, stamps, early)
        waited, which = self._signal_waits_for(marker, previous, early, stamps)
        if which:
            self._waits.copies(waited)
            stamps[which]["copied"] = time.perf_counter()
        return marker

    async def _pack_here(
        self, state: PushState, bucket: Bucket, index: int, tensors: _Sources, readers: Readers,
        previous: object | None, stamps: _Stamps, early: bool = False,
    ) -> object:
        """``_pack`` on the event loop, for a backend whose packing only queues device work
        (``inline_packing``): no thread hop a bucket, and the device waits are polls that let
        the loop run (the acks of the other buffer arrive meanwhile)."""
        await self._waits.poll_loads(readers)
        marker = self._queue(state, bucket, index, tensors, stamps, early)
        waited, which = self._signal_waits_for(marker, previous, early, stamps)
        if which:
            await self._waits.poll_copies(waited)
            stamps[which]["copied"] = time.perf_counter()
        return marker

    def _queue(
        self, state: PushState, bucket: Bucket, index: int, tensors: _Sources, stamps: _Stamps,
        early: bool = False,
    ) -> object:
        """Queue the bucket's copies (its buffer's readers are done); returns its marker (with
        ``early``, the buffer's copy event, recorded). Stamps ``loads_done`` and ``queued``.

        Nothing is made or packed once ``state``'s push has ended: a job that was already in
        the packing thread when its push was cut short (cancelled) may start after the next
        push opened, whose lazy tensors and buffers are not its to touch."""
        stamps[-1]["loads_done"] = time.perf_counter()
        if self._pushes.current is not state:
            stamps[-1]["queued"] = time.perf_counter()
            return self._backend.mark_copies()
        made: dict[str, torch.Tensor] = {}
        sources = cast(Mapping[str, torch.Tensor], tensors)  # lazy ones only with ``makes``
        if state.makes is not None:
            state.made[index].clear()  # the buffer's readers are done: so are its copies
            sources, made = state.makes.for_bucket(bucket)
            state.made[index].extend(sources.values())
            self._backend.mark_sources_ready()  # the copies wait for the making (a gather)
        buffer = self._staging.buffers[index].tensor
        # The big copies as driver calls, the small ones in one fused launch beside them (on
        # the same stream), or all through pack_bucket where a source needs torch.
        one_by_one, fused = fused_slots(bucket) if self._raw_copies else (bucket, None)
        spans = bucket_spans(one_by_one, buffer, sources) if self._raw_copies else None
        if spans is None or not self._backend.queue_spans(spans):
            with _packing(), self._backend.copy_context():
                pack_bucket(bucket, buffer, sources, self._staging.views[index])
        elif fused is not None:
            with _packing(), self._backend.copy_context():
                pack_bucket(fused, buffer, sources, self._staging.views[index])
        if made and state.fingerprint is not None:
            made = {n: t for n, t in made.items() if n not in state.pieces}  # not whole ones
            dtypes = {slot.name: slot.dtype for slot in bucket.slots if slot.name in made}
            if made:
                state.fingerprints.update(state.fingerprint(made, dtypes))
        marker = self._backend.record_copies(index) if early else self._backend.mark_copies()
        stamps[-1]["queued"] = time.perf_counter()
        return marker

    def _signal_waits_for(
        self, marker: object, previous: object | None, early: bool = False,
        stamps: _Stamps | None = None,
    ) -> tuple[object, int]:
        """The copies to finish now, and whose stamps say so (-1: this bucket's; -2: with late
        signals, the previous bucket's; 0: none, the first bucket with late signals, or every
        bucket with ``early`` signals, whose ``copied`` stamp is then its ``queued`` one: the
        receivers see the copies land)."""
        if early:
            if stamps is not None:
                stamps[-1]["copied"] = stamps[-1]["queued"]
            return None, 0
        if not self._late_signals:
            return marker, -1
        return previous, (-2 if previous is not None else 0)

    # ---------------------------------------------------------------- a bucket: signal

    def _hold(self, index: int, state: PushState, *, bucket: int, loads: bool = True) -> None:
        """Buffer ``index`` now holds ``bucket`` of this push, until every receiver here acks
        (and, with ``loads``, their load events fire)."""
        holders = {peer.identity for peer in state.peers if peer.identity in self._control.peers}
        self._staging.hold(
            index, push=state.id, bucket=bucket, holders=holders,
            loaders=list(holders) if loads else [],
        )

    async def _send_bucket(
        self, bucket: Bucket, index: int, state: PushState, *, copying: bool = False
    ) -> None:
        entries = [
            wire.Entry(
                name=s.name, dtype=dtype_name(s.dtype), shape=list(s.shape), offset=s.offset,
                nbytes=s.nbytes, start=s.start, total=s.total, spanning=s.spanning,
                part=[] if s.part is None else [s.part.offset, *s.part.whole],
                columns=[] if s.part is None or s.part.columns is None else [*s.part.columns],
            )
            for s in bucket.slots
        ]
        self._hold(index, state, bucket=bucket.index)
        for peer in state.peers:
            await self._control.send(
                peer,
                lambda p, seq: wire.Bucket(
                    conn=p.conn, seq=seq, push=state.id, version=state.version,
                    index=bucket.index, buffer=index, entries=entries,
                    completes=list(bucket.completes), copying=copying,
                ),
            )
        if bucket.index == state.prints_after:
            await self._pushes.send_prints(state)


@contextlib.contextmanager
def _packing() -> Iterator[None]:
    """Grad mode for packing: no autograd (parameters require grad), and never inference mode
    (the caller's, on the loop's thread): views of the staging buffers made under it, which
    are kept for the next push, could not be written outside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield
