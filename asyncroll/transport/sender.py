"""The trainer side of the weight push: staging buffers (two, persistent) and the push pipeline.

``open_weight_sender`` builds a ``WeightSender``: its control plane (``peers.ControlPlane``: the
socket, the receivers and the reader task, which lives exactly as long as the ``async with``)
and its staging buffers, allocated once. A push plans buckets, packs each into a free buffer and
signals it to every ready receiver: ``_run_push`` is the whole per-bucket loop. A one-copy push
(``shared``) skips the staging and sends one message.

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
* packing that blocks (shared memory) runs in one private worker thread, FIFO, so a push
  cancelled mid-pack can never race the next push's packing of the same buffer; packing that
  only queues device work (CUDA: ``Backend.inline_packing``) runs on the event loop, in the
  copy stream's order, and its device waits are polls that let the loop run;
* every wait is bounded (``connect_timeout``, ``ack_timeout``) and a timeout names the receiver
  and the bucket that did not answer;
* every push ends with an End to each receiver still here, naming the error if it failed (and
  then counted as failed once);
* a staging buffer that copies may still be queued into is never freed (``_QUARANTINE``);
* after ``wait_receivers`` succeeds (with ``seal=True``), the socket file, the runtime directory
  and the shared-memory names are unlinked: from then on a SIGKILL of either side leaves nothing on
  disk, and nobody else can connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar, cast

import torch

from asyncroll.errors import (
    TransportAuthError,
    TransportBrokenError,
    TransportClosedError,
    TransportTimeoutError,
    WeightSyncError,
)
from asyncroll.transport import wire
from asyncroll.transport.backends import (
    Backend,
    CudaIpcBackend,
    ShmBackend,
    StagingBuffer,
    apoll_until,
    poll_until,
)
from asyncroll.transport.lazy import LazyTensor, Makes
from asyncroll.transport.packing import dtype_name, pack_bucket
from asyncroll.transport.peers import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from asyncroll.transport.peers import ControlPlane, Peer, PeerHooks
from asyncroll.transport.piece import Piece, split_pieces
from asyncroll.transport.plan import Bucket, GroupOf, TensorMeta, default_group, plan_buckets
from asyncroll.transport.security import JobIdentity
from asyncroll.transport.shared import SharedStorages, check_shareable

__all__ = [
    "PushReport",
    "SenderBucketTimes",
    "SenderStatistics",
    "WeightSender",
    "open_weight_sender",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_BUCKET_BYTES: Final = 512 << 20
"""Size of one staging buffer: large enough to amortise a round trip, small enough to double."""
_COPIES_LATE: Final = (
    "the staging copies did not finish within {:g} s (device work queued before the push,"
    " which the copies wait for, is still running?)"
)
_QUARANTINE: list[StagingBuffer] = []
"""Staging buffers closed with copies still queued into them: never freed (see ``_release``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderBucketTimes:
    """One bucket's way through the sender, as ``time.perf_counter()`` stamps (on Linux one
    monotonic clock for every process of the machine: they line up with the receivers'
    ``ReceiverBucketTimes``)."""

    bucket: int
    waited: float
    """The wait for a free buffer began."""
    free: float
    """Every receiver of the buffer's last bucket had acked it."""
    loads_done: float
    """Their reads of it were done on the device (polled)."""
    queued: float
    """Our copies into it were queued."""
    copied: float
    """They were done (the bucket may be signalled)."""
    signalled: float
    """It was sent to every receiver."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PushReport:
    """What one push moved and where its time went."""

    version: int
    bytes: int
    buckets: int
    tensors: int
    receivers: int
    seconds: float
    pack_seconds: float
    """Time packing buckets into staging buffers (in the worker thread)."""
    wait_seconds: float
    """Time waiting for receivers to release a buffer (and for the final acks)."""
    timeline: tuple[SenderBucketTimes, ...] = ()
    """Per bucket, where its time went (staged pushes)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderStatistics:
    receivers: int
    """Receivers connected, authenticated and mapped."""
    pushes: int
    failed_pushes: int
    bytes_pushed: int
    auth_failures: int
    """Frames dropped because they failed authentication (forged, replayed, garbage)."""
    buffers: int
    bucket_bytes: int
    sealed: bool
    closed: bool
    shared_storages: int = 0
    """One-copy mode: the trainer's storages exported and kept (since the last push)."""


@dataclass(slots=True, kw_only=True)
class _PushState:
    id: int
    version: int
    peers: list[Peer]
    """The receivers ready when the push began: each is sent every bucket and the End."""
    failure: BaseException | None = None
    prints_after: int = 0
    """The bucket whose signal the push's fingerprints follow (``wire.Prints``)."""
    makes: Makes | None = None
    """The push's lazy tensors (``LazyTensor``), made as their buckets are packed."""


class WeightSender:
    """Pushes named tensors into every connected receiver. Build it with ``open_weight_sender``."""

    def __init__(
        self,
        *,
        backend: Backend | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        buffers: int = 2,
        receivers: int | None = None,
        group_of: GroupOf = default_group,
        connect_timeout: float = 120.0,
        ack_timeout: float = 60.0,
        close_timeout: float = 5.0,
        seal: bool = True,
        runtime_base: Path | None = None,
        identity: JobIdentity | None = None,
    ) -> None:
        if buffers < 1:
            raise ValueError(f"buffers must be at least 1, got {buffers}")
        self._backend: Backend = backend or ShmBackend()
        self._bucket_bytes = bucket_bytes
        self._group_of = group_of
        self._expected = receivers
        self._connect_timeout = connect_timeout
        self._ack_timeout = ack_timeout
        self._close_timeout = close_timeout
        self._seal_when_ready = seal
        self._identity = identity or JobIdentity.generate()
        self._holders: list[set[bytes]] = [set() for _ in range(buffers)]
        self._holding: list[tuple[int, int] | None] = [None] * buffers
        self._loaders: list[list[bytes]] = [[] for _ in range(buffers)]
        self._late_signals = self._backend.async_copies and buffers > 2
        """Signal bucket k once bucket k+1's copies are queued (see ``_run_push``)."""
        self._push: _PushState | None = None
        self._fingerprints: dict[str, bytes] = {}
        """The current push's, for its End."""
        self._fingerprint: (
            Callable[[dict[str, torch.Tensor], dict[str, torch.dtype]], dict[str, bytes]] | None
        ) = None
        """Fingerprints the lazy tensors made for each bucket of the current push."""
        self._pieces: frozenset[str] = frozenset()
        """The current push's tensors that are pieces (never fingerprinted as if whole)."""
        self._made: list[list[torch.Tensor]] = [[] for _ in range(buffers)]
        """Per staging buffer, the lazy tensors made for its bucket: alive until the buffer's
        copies are done (the next bucket into it, or the end of the push)."""
        self._shared = SharedStorages()
        self._push_ids = 0
        self._pushes = self._failed = self._bytes = 0
        self._push_lock = asyncio.Lock()
        self._staging: list[StagingBuffer] = []
        self._plan: tuple[tuple[TensorMeta, ...], list[Bucket]] | None = None
        """The last push's layout and its buckets: the next push of the same layout reuses
        them, and the staging views below."""
        self._views: list[dict[tuple[int, int, torch.dtype, tuple[int, ...]], torch.Tensor]] = [
            {} for _ in range(buffers)
        ]
        """Per staging buffer, its typed views for the slots of ``_plan`` (``pack_bucket``)."""
        self._control = ControlPlane(
            identity=self._identity,
            hooks=PeerHooks(  # weakly: an unclosed sender is freed (and warns) as it is dropped
                welcome=_weakly(self._welcome),
                open_load_events=_weakly(self._open_load_events),
                on_ack=_weakly(self._on_ack),
                on_drop=_weakly(self._on_drop),
            ),
            owner=self,
            runtime_base=runtime_base,
        )
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="asyncroll-pack")
        try:
            for i in range(buffers):  # one at a time: a failure releases those made before it
                self._staging.append(
                    self._backend.allocate(nonce=self._identity.nonce, index=i, nbytes=bucket_bytes)
                )
            self._copy_events = (
                self._backend.export_copy_events(buffers) if self._backend.async_copies else []
            )
            """Handles of our per-buffer copy events, for the welcome ([]: none)."""
        except BaseException:
            self._release()
            raise

    # ---------------------------------------------------------------- public API

    @property
    def address(self) -> str:
        return self._control.address

    @property
    def nonce(self) -> str:
        return self._identity.nonce

    @property
    def runtime_dir(self) -> Path:
        return self._control.runtime_dir

    def receiver_config(self) -> dict[str, str | int]:
        """Everything a receiver needs, as a json-able dict (it holds the secret: never log it)."""
        return {
            "address": self.address,
            "nonce": self._identity.nonce,
            "secret": self._identity.secret.hex(),
            "timeout_ms": int(self._ack_timeout * 1000),
        }

    def statistics(self) -> SenderStatistics:
        control = self._control.statistics()
        return SenderStatistics(
            receivers=control.ready,
            pushes=self._pushes,
            failed_pushes=self._failed,
            bytes_pushed=self._bytes,
            auth_failures=control.auth_failures,
            buffers=len(self._holders),
            bucket_bytes=self._bucket_bytes,
            sealed=control.sealed,
            closed=control.closed,
            shared_storages=len(self._shared),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if s.closed else ("sealed" if s.sealed else "open")
        return (
            f"<WeightSender {self._backend.name} {state} nonce={self.nonce} receivers={s.receivers}"
            f" buffers={s.buffers}x{s.bucket_bytes} pushes={s.pushes}>"
        )

    async def wait_receivers(self, n: int) -> None:
        """Wait (at most ``connect_timeout``) until ``n`` receivers have mapped the buffers; seal.

        Raises:
            TransportBrokenError: sealed, and a receiver has left since (fails at once).
            TransportAuthError: not enough receivers came, and some peer failed authentication.
            TransportTimeoutError: not enough receivers came within the timeout.
            TransportClosedError: the sender was closed.
        """
        control = self._control
        if control.sealed and control.ready_count() < n:
            raise TransportBrokenError(
                f"{control.ready_count()} of {n} receivers left, and the sender is sealed (no new"
                " receiver can connect): open a new sender"
            )
        failures_before = control.statistics().auth_failures
        timeout = self._connect_timeout
        try:
            await control.wait(lambda: control.ready_count() >= n, within=timeout)
        except TimeoutError:
            msg = f"{control.ready_count()} of {n} receivers connected within {timeout:g} s"
            failures = control.statistics().auth_failures - failures_before
            if failures:
                raise TransportAuthError(
                    f"{msg}; {failures} peer message(s) failed authentication (a receiver with"
                    " the wrong secret?)"
                ) from None
            raise TransportTimeoutError(msg) from None
        if self._seal_when_ready and not control.sealed:
            for buffer in self._staging:
                buffer.unlink()
            control.seal()

    async def push(
        self,
        named_tensors: Mapping[str, torch.Tensor | LazyTensor | Piece]
        | Iterable[tuple[str, torch.Tensor | LazyTensor | Piece]],
        *,
        version: int,
        one_copy: bool = False,
        fingerprints: Mapping[str, bytes] | None = None,
        fingerprint: Callable[[dict[str, torch.Tensor], dict[str, torch.dtype]], dict[str, bytes]]
        | None = None,
    ) -> PushReport:
        """Move ``named_tensors`` into every ready receiver; returns once all of them loaded it.

        ``fingerprints`` (``asyncroll.fingerprints``) travel with the push, for each receiver's
        loader to check what it loaded (``ReceiveReport.fingerprints``).

        A ``LazyTensor`` is made when its first bucket is packed (``asyncroll.transport.lazy``:
        in plan order, so ranks that push the same layout make theirs in the same order) and
        dropped once its last bucket's copies are done; ``fingerprint(made, dtypes)``, if
        given, fingerprints the tensors made for each bucket (as the dtypes pushed), and those
        fingerprints travel after the last bucket. If the push fails, the lazy tensors not made
        yet are made and dropped before it raises (no other rank waits in a collective).

        A ``Piece`` pushes part of a tensor (``asyncroll.transport.piece``): its own tensor
        travels, and receivers are told where it sits in the whole.

        ``one_copy`` (CUDA IPC only): no staging; receivers read the tensors in place, through
        IPC handles of their storages (exported once while the sender keeps them). The tensors
        must be contiguous and must not change until this returns: by then every receiver's
        reads are finished on the device.

        Raises:
            WeightSyncError: a receiver's loader raised (names the receiver, tensor and message).
            TransportBrokenError: a receiver disconnected mid-push.
            TransportTimeoutError: a receiver did not ack within ``ack_timeout``.
            TransportClosedError: the sender is closed.
        """
        self._control.check_usable()
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        given = dict(pairs)
        if len(given) != len(pairs):
            raise ValueError("tensor names must be unique")
        tensors, parts = split_pieces(given)
        lazy = any(isinstance(t, LazyTensor) for t in tensors.values())
        if one_copy:
            if lazy or parts:
                raise ValueError("one_copy reads whole tensors in place: no LazyTensor or Piece")
            whole = cast(dict[str, torch.Tensor], tensors)
            check_shareable(self._backend, whole)
            if self._expected is not None:
                await self.wait_receivers(self._expected)
            async with self._push_lock:
                self._fingerprints = dict(fingerprints or {})
                return await self._run_shared_push(whole, version)
        plan = self._plan_for(
            tuple(
                TensorMeta(name=n, dtype=t.dtype, shape=tuple(t.shape), part=parts.get(n))
                for n, t in tensors.items()
            )
        )
        makes = Makes(plan, tensors) if lazy else None
        try:
            if self._expected is not None:
                await self.wait_receivers(self._expected)  # immediate once they are in; seals
            async with self._push_lock:
                self._fingerprints = dict(fingerprints or {})
                self._fingerprint = fingerprint if lazy else None
                self._pieces = frozenset(parts)
                return await self._run_push(plan, tensors, version, makes=makes)
        except BaseException:
            if makes is not None and makes.pending:  # the other ranks' collectives
                try:
                    await _shielded(self._in_packer(makes.drain))
                except Exception:
                    log.warning("could not make the failed push's other tensors", exc_info=True)
            raise

    async def aclose(self) -> None:
        """Wait (bounded) for receivers to release their mappings and say bye; free everything.

        Idempotent; safe to call while a push is in flight (the push raises TransportClosedError).
        """
        if self._control.closed:
            return
        try:
            await self._control.aclose(within=self._close_timeout)
        finally:
            self._release()

    def start(self) -> None:
        """Start the reader task (``open_weight_sender`` does this and owns the task)."""
        self._control.start()

    # ---------------------------------------------------------------- the push

    def _plan_for(self, metas: tuple[TensorMeta, ...]) -> list[Bucket]:
        """The buckets of a push of ``metas`` (the last push's, when the layout is the same)."""
        if self._plan is None or self._plan[0] != metas:
            buckets = plan_buckets(metas, bucket_bytes=self._bucket_bytes, group_of=self._group_of)
            self._plan = (metas, buckets)
            for views in self._views:
                views.clear()
        return self._plan[1]

    async def _run_push(
        self,
        plan: list[Bucket],
        tensors: Mapping[str, torch.Tensor | LazyTensor],
        version: int,
        *,
        makes: Makes | None = None,
    ) -> PushReport:
        started = time.perf_counter()
        pack_s = wait_s = 0.0
        # With asynchronous copies (CUDA) and three or more buffers, a bucket is signalled one
        # step late: once bucket k+1's copies are queued, we wait for bucket k's and signal it,
        # so the device always has the next copies at hand while Python signals and acks.
        # (With two, k+1's buffer is k-1's: k's signal would wait for k-1's ack.)
        unsignalled: tuple[Bucket, int, object] | None = None
        stamps: list[dict[str, float]] = []
        clock = time.perf_counter
        # Packing on the loop only where it only queues device work: a copy from host memory
        # would block the loop (the packing thread takes such pushes).
        inline = getattr(self._backend, "inline_packing", False) and all(
            t.is_cuda for t in tensors.values()
        )
        async with self._pushing(version, buckets=len(plan), makes=makes) as state:
            self._backend.mark_sources_ready()
            # Signal each bucket as soon as its copies are queued: every receiver polls the
            # buffer's copy event before it reads.
            early = bool(self._copy_events) and all(peer.polls_copies for peer in state.peers)
            marker: object = None
            for bucket in plan:
                index = bucket.index % len(self._staging)
                stamp = {"waited": clock()}
                stamps.append(stamp)
                await self._wait_buffer_free(index, state)
                stamp["free"] = clock()
                readers = self._load_events_of(index)
                previous = unsignalled[2] if unsignalled is not None else None
                if inline:
                    marker = await self._pack_here(
                        bucket, index, tensors, readers, previous, stamps, early
                    )
                else:
                    marker = await self._in_packer(
                        self._pack, bucket, index, tensors, readers, previous, stamps, early
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
                if inline:
                    await self._poll_copies(marker)
                else:
                    await self._in_packer(self._finish_copies, marker)
            if unsignalled is not None:
                if inline:
                    await self._poll_copies(unsignalled[2])
                else:
                    await self._in_packer(self._finish_copies, unsignalled[2])
                stamps[-1]["copied"] = clock()
                await self._send_bucket(unsignalled[0], unsignalled[1], state)
                stamps[-1]["signalled"] = clock()
            for index in range(len(self._staging)):
                await self._wait_buffer_free(index, state)
            # Acks may precede the loads on the device (load events): wait for those too.
            readers = [r for i in range(len(self._staging)) for r in self._load_events_of(i)]
            if inline:
                await self._poll_loads(readers)
            else:
                await self._in_packer(self._wait_loads, readers)
            wait_s += clock() - t0
        timeline = tuple(
            SenderBucketTimes(bucket=i, **stamp)
            for i, stamp in enumerate(stamps)
            if len(stamp) == 6
        )
        return self._count(
            state,
            tensors,
            buckets=len(plan),
            started=started,
            pack_s=pack_s,
            wait_s=wait_s,
            timeline=timeline,
        )

    async def _run_shared_push(self, tensors: dict[str, torch.Tensor], version: int) -> PushReport:
        """One-copy mode: one message naming every tensor's storage and place; one ack from
        each receiver once its reads are done on the device."""
        backend = self._backend
        assert isinstance(backend, CudaIpcBackend)
        started = time.perf_counter()
        async with self._pushing(version, buckets=1) as state:
            await self._wait_buffer_free(0, state)  # no bucket of an earlier push pending
            backend.mark_sources_ready()
            storages, entries, used = self._shared.share(backend, tensors)
            t0 = time.perf_counter()
            await self._in_packer(
                functools.partial(backend.wait_sources, within=self._ack_timeout)
            )
            pack_s = time.perf_counter() - t0
            self._hold(0, state, bucket=0)
            self._loaders[0] = []  # receivers synchronise before they ack a shared push
            for peer in state.peers:
                await self._control.send(
                    peer,
                    lambda p, seq: wire.Shared(
                        conn=p.conn, seq=seq, push=state.id, version=version,
                        storages=storages, entries=entries,
                    ),
                )
            await self._send_prints(state)
            t1 = time.perf_counter()
            await self._wait_buffer_free(0, state)
            wait_s = time.perf_counter() - t1
        self._shared.keep_only(used)  # receivers release what the next push does not list
        return self._count(state, tensors, buckets=1, started=started, pack_s=pack_s, wait_s=wait_s)

    @contextlib.asynccontextmanager
    async def _pushing(
        self, version: int, *, buckets: int, makes: Makes | None = None
    ) -> AsyncIterator[_PushState]:
        """One push from its first message to its End; a failure is counted, ended, re-raised.

        Raises:
            WeightSyncError: no receiver is ready.
        """
        peers = self._control.ready_peers()
        if not peers:
            raise WeightSyncError("no receiver is connected")
        self._push_ids += 1
        # Fingerprints of lazy tensors are known once the last bucket is packed.
        prints_after = buckets - 1 if makes is not None else buckets // 2
        state = self._push = _PushState(
            id=self._push_ids, version=version, peers=peers, prints_after=prints_after,
            makes=makes,
        )
        try:
            yield state
            await self._send_end(state, buckets, error="")
        except BaseException as exc:
            self._failed += 1
            await _shielded(self._send_end(state, buckets, error=_describe_exc(exc)))
            raise
        finally:
            self._push = None
            for made in self._made:
                made.clear()

    def _count(
        self,
        state: _PushState,
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
        self._pushes += 1
        self._bytes += nbytes
        return PushReport(
            version=state.version,
            bytes=nbytes,
            buckets=buckets,
            tensors=len(tensors),
            receivers=len(state.peers),
            seconds=seconds,
            pack_seconds=pack_s,
            wait_seconds=wait_s,
            timeline=timeline,
        )

    async def _in_packer(self, function: Callable[..., _T], *args: object) -> _T:
        """Run ``function`` in the packing thread (FIFO); TransportClosedError once closed."""
        self._control.check_usable()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._packer, function, *args
            )
        except RuntimeError:  # the executor was shut down by aclose() meanwhile
            self._control.check_usable()
            raise
        self._control.check_usable()  # aclose() may have run while the thread worked
        return result

    def _load_events_of(self, index: int) -> list[tuple[bytes, object]]:
        """(receiver, load event) of the receivers last sent buffer ``index`` that are here."""
        readers = []
        for identity in self._loaders[index]:
            peer = self._control.peers.get(identity)
            if peer is not None and peer.load_events is not None:
                readers.append((identity, peer.load_events[index]))
        return readers

    def _pack(
        self,
        bucket: Bucket,
        index: int,
        tensors: Mapping[str, torch.Tensor | LazyTensor],
        readers: list[tuple[bytes, object]],
        previous: object | None,
        stamps: list[dict[str, float]],
        early: bool = False,
    ) -> object:
        """Wait until the buffer's last readers finished on the device, queue the bucket's
        copies, then (if given) wait for the previous bucket's, or (``early``: receivers poll
        the copy events) for none. Returns this one's marker. Stamps ``loads_done``,
        ``queued`` and ``copied`` (the last, of the bucket waited for)."""
        self._wait_loads(readers)
        marker = self._queue(bucket, index, tensors, stamps, early)
        waited, which = self._signal_waits_for(marker, previous, early, stamps)
        if which:
            self._finish_copies(waited)
            stamps[which]["copied"] = time.perf_counter()
        return marker

    def _queue(
        self,
        bucket: Bucket,
        index: int,
        tensors: Mapping[str, torch.Tensor | LazyTensor],
        stamps: list[dict[str, float]],
        early: bool = False,
    ) -> object:
        """Queue the bucket's copies (its buffer's readers are done); returns its marker (with
        ``early``, the buffer's copy event, recorded). Stamps ``loads_done`` and ``queued``."""
        stamps[-1]["loads_done"] = time.perf_counter()
        makes = self._push.makes if self._push is not None else None
        made: dict[str, torch.Tensor] = {}
        sources = cast(Mapping[str, torch.Tensor], tensors)  # lazy ones only with ``makes``
        if makes is not None:
            self._made[index].clear()  # the buffer's readers are done: so are its copies
            sources, made = makes.for_bucket(bucket)
            self._made[index].extend(sources.values())
            self._backend.mark_sources_ready()  # the copies wait for the making (a gather)
        with _packing(), self._backend.copy_context():
            pack_bucket(bucket, self._staging[index].tensor, sources, self._views[index])
        if made and self._fingerprint is not None:
            made = {n: t for n, t in made.items() if n not in self._pieces}  # not whole ones
            dtypes = {slot.name: slot.dtype for slot in bucket.slots if slot.name in made}
            if made:
                self._fingerprints.update(self._fingerprint(made, dtypes))
        marker = self._backend.record_copies(index) if early else self._backend.mark_copies()
        stamps[-1]["queued"] = time.perf_counter()
        return marker

    def _signal_waits_for(
        self,
        marker: object,
        previous: object | None,
        early: bool = False,
        stamps: list[dict[str, float]] | None = None,
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

    async def _pack_here(
        self,
        bucket: Bucket,
        index: int,
        tensors: Mapping[str, torch.Tensor | LazyTensor],
        readers: list[tuple[bytes, object]],
        previous: object | None,
        stamps: list[dict[str, float]],
        early: bool = False,
    ) -> object:
        """``_pack`` on the event loop, for a backend whose packing only queues device work
        (``inline_packing``): no thread hop a bucket, and the device waits are polls that let
        the loop run (the acks of the other buffer arrive meanwhile)."""
        await self._poll_loads(readers)
        marker = self._queue(bucket, index, tensors, stamps, early)
        waited, which = self._signal_waits_for(marker, previous, early, stamps)
        if which:
            await self._poll_copies(waited)
            stamps[which]["copied"] = time.perf_counter()
        return marker

    async def _poll_loads(self, readers: list[tuple[bytes, object]]) -> None:
        """``_wait_loads`` on the event loop."""
        for done, within, give_up, identity in self._load_polls(readers):
            self._control.check_usable()
            try:
                await apoll_until(done, within=within, give_up=give_up)
            except TimeoutError:
                raise self._loads_late(identity) from None
        self._control.check_usable()

    async def _poll_copies(self, marker: object) -> None:
        """``_finish_copies`` on the event loop."""
        try:
            await apoll_until(
                functools.partial(self._backend.copies_done, marker),
                within=self._ack_timeout,
                give_up=lambda: self._control.closed,
            )
        except TimeoutError:
            raise TransportTimeoutError(_COPIES_LATE.format(self._ack_timeout)) from None
        self._control.check_usable()

    def _wait_loads(self, readers: list[tuple[bytes, object]]) -> None:
        """Poll receivers' load events from the host (never on our stream: an event of a process
        that died never fires). A receiver that left is not waited for."""
        for done, within, give_up, identity in self._load_polls(readers):
            try:
                poll_until(done, within=within, give_up=give_up)
            except TimeoutError:
                raise self._loads_late(identity) from None
            if self._control.closed:
                raise TransportClosedError(f"{self!r} is closed")

    def _load_polls(
        self, readers: list[tuple[bytes, object]]
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

    def _finish_copies(self, marker: object) -> None:
        """Wait (bounded) for our copies up to ``marker``."""
        try:
            self._backend.finish_copies(marker, within=self._ack_timeout)
        except TimeoutError:
            raise TransportTimeoutError(_COPIES_LATE.format(self._ack_timeout)) from None

    async def _wait_buffer_free(self, index: int, state: _PushState) -> None:
        def what() -> str:
            holders = ", ".join(self._control.describe(i) for i in self._holders[index])
            push, bucket = self._holding[index] or (0, -1)
            return (
                f"{holders} did not ack bucket {bucket} of push {push} (version {state.version})"
                f" within {self._ack_timeout:g} s"
            )

        try:
            await self._control.wait(
                lambda: state.failure is not None or not self._holders[index],
                within=self._ack_timeout,
            )
        except TimeoutError:
            raise TransportTimeoutError(what()) from None
        if state.failure is not None:
            raise state.failure

    def _hold(self, index: int, state: _PushState, *, bucket: int) -> None:
        """Buffer ``index`` now holds ``bucket`` of this push, until every receiver here acks."""
        self._holding[index] = (state.id, bucket)
        self._holders[index] = {
            peer.identity for peer in state.peers if peer.identity in self._control.peers
        }

    async def _send_bucket(
        self, bucket: Bucket, index: int, state: _PushState, *, copying: bool = False
    ) -> None:
        entries = [
            wire.Entry(
                name=s.name,
                dtype=dtype_name(s.dtype),
                shape=list(s.shape),
                offset=s.offset,
                nbytes=s.nbytes,
                start=s.start,
                total=s.total,
                spanning=s.spanning,
                part=[] if s.part is None else [s.part.offset, *s.part.whole],
            )
            for s in bucket.slots
        ]
        self._hold(index, state, bucket=bucket.index)
        self._loaders[index] = list(self._holders[index])
        for peer in state.peers:
            await self._control.send(
                peer,
                lambda p, seq: wire.Bucket(
                    conn=p.conn,
                    seq=seq,
                    push=state.id,
                    version=state.version,
                    index=bucket.index,
                    buffer=index,
                    entries=entries,
                    completes=list(bucket.completes),
                    copying=copying,
                ),
            )
        if bucket.index == state.prints_after:
            await self._send_prints(state)

    async def _send_prints(self, state: _PushState) -> None:
        """The push's fingerprints, once: after a signal, so the receiver decodes them while it
        waits for the next bucket (58 KB for a 7B model: about 0.4 ms at the end of a push)."""
        if not self._fingerprints:
            return
        for peer in state.peers:
            await self._control.send(
                peer,
                lambda p, seq: wire.Prints(
                    conn=p.conn, seq=seq, push=state.id, fingerprints=self._fingerprints
                ),
            )

    async def _send_end(self, state: _PushState, buckets: int, *, error: str) -> None:
        for peer in state.peers:
            if peer.identity in self._control.peers:
                with contextlib.suppress(TransportBrokenError, TransportClosedError):
                    await self._control.send(
                        peer,
                        lambda p, seq: wire.End(
                            conn=p.conn,
                            seq=seq,
                            push=state.id,
                            version=state.version,
                            buckets=buckets,
                            error=error,
                        ),
                    )

    # ---------------------------------------------------------------- hooks of the control plane

    def _welcome(self, peer: Peer, seq: int) -> wire.Welcome:
        return wire.Welcome(
            conn=peer.conn,
            seq=seq,
            backend=self._backend.name,
            bucket_bytes=self._bucket_bytes,
            buffers=[buffer.descriptor for buffer in self._staging],
            copy_events=self._copy_events,
        )

    def _open_load_events(self, handles: list[bytes]) -> list[object] | None:
        if len(handles) != len(self._staging):
            raise ValueError(f"{len(handles)} load events for {len(self._staging)}")
        return self._backend.open_peer_events(handles)

    def _on_ack(self, identity: bytes, ack: wire.Ack) -> None:
        index = ack.index % len(self._holders)
        if self._holding[index] == (ack.push, ack.index):
            self._holders[index].discard(identity)
        state = self._push
        if ack.error and state is not None and state.id == ack.push and state.failure is None:
            where = f" loading {ack.tensor!r}" if ack.tensor else ""
            state.failure = WeightSyncError(
                f"{self._control.describe(identity)} failed{where} (bucket {ack.index} of push"
                f" {ack.push}, version {state.version}): {ack.error}"
            )

    def _on_drop(self, peer: Peer, reason: str) -> None:
        for holders in self._holders:
            holders.discard(peer.identity)
        state = self._push
        if state is not None and state.failure is None and peer.ready and not self._control.closed:
            state.failure = TransportBrokenError(f"{reason} during push of version {state.version}")

    # ---------------------------------------------------------------- the staging buffers' end

    def _release(self) -> None:
        """Synchronous, idempotent teardown of everything the constructor acquired."""
        try:
            self._control.release()
        finally:
            self._release_staging()

    def _release_staging(self) -> None:
        self._packer.shutdown(wait=True)  # no copies are queued after this
        self._views, self._plan = [], None  # views of the buffers go before the buffers
        if self._copies_pending():
            # Copies into these buffers are still queued (a push was cut short while the device
            # was busy); were the memory given back to the allocator, they could write into
            # someone else's tensor.
            log.warning("keeping %d staging buffers with copies still queued", len(self._staging))
            _QUARANTINE.extend(self._staging)
        else:
            for buffer in self._staging:
                buffer.close()
        self._staging = []
        self._shared.clear()

    def _copies_pending(self) -> bool:
        """Whether copies into the staging buffers are still running after ``close_timeout``."""
        if not self._staging or not self._backend.async_copies:
            return False
        try:
            self._backend.finish_copies(self._backend.mark_copies(), within=self._close_timeout)
        except Exception:  # a timeout, or a broken device: either way, do not free
            return True
        return False

    def __del__(self) -> None:
        control = getattr(self, "_control", None)
        if control is not None and not control.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)
            with contextlib.suppress(Exception):
                self._release()


@contextlib.asynccontextmanager
async def open_weight_sender(
    *,
    backend: Backend | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffers: int = 2,
    receivers: int | None = None,
    group_of: GroupOf = default_group,
    connect_timeout: float = 120.0,
    ack_timeout: float = 60.0,
    close_timeout: float = 5.0,
    seal: bool = True,
    runtime_base: Path | None = None,
) -> AsyncIterator[WeightSender]:
    """Open a weight sender; its reader task lives exactly as long as the ``async with`` block.

    Args:
        backend: Staging memory (``ShmBackend()`` by default; ``CudaIpcBackend(device)`` on GPU).
        bucket_bytes: Size of each staging buffer (a multiple of 256).
        buffers: Staging buffers: 2 (double buffering, the default), 1 (for comparison), or
            more where a push's round-trip latency, not bandwidth, limits it.
        receivers: If given, ``push`` first waits for this many receivers (then seals).
        group_of: Fused-group key of a tensor name (see ``plan.default_group``).
        connect_timeout: Bound on waiting for receivers to connect.
        ack_timeout: Bound on waiting for any receiver's ack of a bucket.
        close_timeout: Bound on waiting, at close, for receivers to release their mappings.
        seal: Unlink the socket and shared-memory names once the expected receivers are in.
        runtime_base: Parent of the private runtime directory (default $XDG_RUNTIME_DIR or /tmp).

    Yields:
        The sender. Its ``receiver_config()`` is what each receiver needs.
    """
    sender = WeightSender(
        backend=backend,
        bucket_bytes=bucket_bytes,
        buffers=buffers,
        receivers=receivers,
        group_of=group_of,
        connect_timeout=connect_timeout,
        ack_timeout=ack_timeout,
        close_timeout=close_timeout,
        seal=seal,
        runtime_base=runtime_base,
    )
    try:
        sender.start()
        yield sender
    finally:
        await _shielded(sender.aclose())


async def _shielded(awaitable: Awaitable[None]) -> None:
    """Run cleanup I/O to completion even if our caller is being cancelled."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task  # finish the cleanup, then let the cancellation propagate
        raise


@contextlib.contextmanager
def _packing() -> Iterator[None]:
    """Grad mode for packing: no autograd (parameters require grad), and never inference mode
    (the caller's, on the loop's thread): views of the staging buffers made under it, which
    are kept for the next push, could not be written outside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _weakly(method: Callable[..., _T]) -> Callable[..., _T]:
    """``method`` without a strong reference to its object (the control plane must not keep
    the sender alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> _T:
        bound = ref()
        if bound is None:
            raise TransportClosedError("the weight sender is gone")
        return bound(*args)

    return call


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "push cancelled by the sender"
    return f"{type(exc).__name__}: {exc}"[:2000]
