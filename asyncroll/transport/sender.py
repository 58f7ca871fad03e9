"""The trainer side of the weight push: persistent staging buffers (two), N receivers, one socket.

``open_weight_sender`` binds a ZeroMQ ROUTER socket in a private runtime directory, allocates the
staging buffers once, and owns one reader task (started on enter, cancelled and awaited on exit)
that authenticates every incoming frame and turns acks into state the push coroutine waits on.

Invariants:

* a buffer is rewritten only after every receiver that was sent its bucket has acked it (or left)
  and the device finished their reads (the load events they recorded, polled from the host: no
  stream of ours ever waits on another process's device work);
  packing bucket k+1 into one buffer overlaps receivers loading bucket k from the other;
* a bucket is signalled only once its copies are done; with asynchronous copies (CUDA) and three
  or more buffers, one step late: bucket k+1's copies are queued before bucket k is signalled.
  Never with two: packing k+1 then needs the buffer of k-1, so k's signal would wait for the
  receiver to finish k-1 and the receiver would idle between buckets (this halved the end-to-end
  rate of a 7B push on an H100);
* packing runs in one private worker thread, FIFO, so a push cancelled mid-pack can never race
  the next push's packing of the same buffer;
* every wait is bounded (``connect_timeout``, ``ack_timeout``) and a timeout names the receiver
  and the bucket that did not answer;
* a frame that fails authentication is dropped and counted, never acked, and never disturbs a push;
* after ``wait_receivers`` succeeds (with ``seal=True``), the socket file, the runtime directory
  and the shared-memory names are unlinked: from then on a SIGKILL of either side leaves nothing on
  disk, and nobody else can connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

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
    poll_until,
)
from asyncroll.transport.packing import dtype_name, pack_bucket
from asyncroll.transport.plan import Bucket, GroupOf, TensorMeta, default_group, plan_buckets
from asyncroll.transport.security import JobIdentity, RateLimitedLog, make_runtime_dir

__all__ = ["PushReport", "SenderStatistics", "WeightSender", "open_weight_sender"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_BUCKET_BYTES: Final = 512 << 20
"""Size of one staging buffer: large enough to amortise a round trip, small enough to double."""
MAX_FRAME_BYTES: Final = 1 << 20
"""Largest frame a peer may send us; bigger ones drop the peer's connection (no memory DoS)."""
_QUARANTINE: list[StagingBuffer] = []
"""Staging buffers closed with copies still queued into them: never freed (see ``_release``)."""


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
class _Peer:
    identity: bytes
    conn: bytes
    name: str
    pid: int
    next_in: int = 1
    next_out: int = 0
    ready: bool = False
    load_events: list[object] | None = None
    """Device events the peer records after loading each buffer (None: it syncs before acks)."""

    def describe(self) -> str:
        return f"receiver {self.name!r} (pid {self.pid})"


@dataclass(slots=True, kw_only=True)
class _PushState:
    id: int
    version: int
    failure: BaseException | None = None


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
        self._sealer = wire.Sealer(self._identity.secret, role="sender")
        self._auth_log = RateLimitedLog(log)
        self._peers: dict[bytes, _Peer] = {}
        self._seen_conns: set[bytes] = set()
        self._rejected: set[bytes] = set()
        self._holders: list[set[bytes]] = [set() for _ in range(buffers)]
        self._holding: list[tuple[int, int] | None] = [None] * buffers
        self._loaders: list[list[bytes]] = [[] for _ in range(buffers)]
        self._late_signals = self._backend.async_copies and buffers > 2
        """Signal bucket k once bucket k+1's copies are queued (see ``_run_push``)."""
        self._push: _PushState | None = None
        self._shared: dict[tuple[str, int, int], tuple[int, torch.Tensor, bytes]] = {}
        """One-copy mode: exported storages by (device, address, bytes) -> (id, the storage as
        a uint8 tensor, its descriptor). Holding the tensor keeps the address from reuse."""
        self._shared_ids = 0
        self._push_ids = 0
        self._pushes = self._failed = self._bytes = self._auth_failures = 0
        self._sealed = self._closed = False
        self._fatal: BaseException | None = None
        self._changed = asyncio.Condition()
        self._push_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._staging: list[StagingBuffer] = []
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="asyncroll-pack")
        self._dir = make_runtime_dir(self._identity.nonce, runtime_base)
        self._socket_path = self._dir / "ctl.sock"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._monitor: zmq.asyncio.Socket | None = None
        self._conn_of: dict[int, bytes] = {}  # connection fd -> peer identity
        self._origin: dict[bytes, str] = {}  # peer identity -> kernel-reported credentials
        self._gone: set[bytes] = set()  # peers that left: their late frames are ignored
        try:
            self._bind()
            self._staging = [
                self._backend.allocate(nonce=self._identity.nonce, index=i, nbytes=bucket_bytes)
                for i in range(buffers)
            ]
        except BaseException:
            self._release()
            raise

    def _bind(self) -> None:
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.ROUTER_MANDATORY, 1),
            (zmq.MAXMSGSIZE, MAX_FRAME_BYTES),
        ):
            self._sock.setsockopt(option, value)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path)  # stale file of a crashed namesake
        self._sock.bind(self.address)
        os.chmod(self._socket_path, 0o600)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    # ---------------------------------------------------------------- public API

    @property
    def address(self) -> str:
        return f"ipc://{self._socket_path}"

    @property
    def nonce(self) -> str:
        return self._identity.nonce

    @property
    def runtime_dir(self) -> Path:
        return self._dir

    def receiver_config(self) -> dict[str, str | int]:
        """Everything a receiver needs, as a json-able dict (it holds the secret: never log it)."""
        return {
            "address": self.address,
            "nonce": self._identity.nonce,
            "secret": self._identity.secret.hex(),
            "timeout_ms": int(self._ack_timeout * 1000),
        }

    def statistics(self) -> SenderStatistics:
        return SenderStatistics(
            receivers=sum(peer.ready for peer in self._peers.values()),
            pushes=self._pushes,
            failed_pushes=self._failed,
            bytes_pushed=self._bytes,
            auth_failures=self._auth_failures,
            buffers=len(self._holders),
            bucket_bytes=self._bucket_bytes,
            sealed=self._sealed,
            closed=self._closed,
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
        if self._sealed and self._ready_count() < n:
            raise TransportBrokenError(
                f"{self._ready_count()} of {n} receivers left, and the sender is sealed (no new"
                " receiver can connect): open a new sender"
            )
        failures_before = self._auth_failures
        timeout = self._connect_timeout
        try:
            await self._wait(lambda: self._ready_count() >= n, within=timeout)
        except TimeoutError:
            msg = f"{self._ready_count()} of {n} receivers connected within {timeout:g} s"
            if self._auth_failures > failures_before:
                raise TransportAuthError(
                    f"{msg}; {self._auth_failures - failures_before} peer message(s) failed"
                    " authentication (a receiver with the wrong secret?)"
                ) from None
            raise TransportTimeoutError(msg) from None
        if self._seal_when_ready:
            self._seal()

    async def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        one_copy: bool = False,
    ) -> PushReport:
        """Move ``named_tensors`` into every ready receiver; returns once all of them loaded it.

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
        self._check_usable()
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        tensors = dict(pairs)
        if len(tensors) != len(pairs):
            raise ValueError("tensor names must be unique")
        if one_copy:
            self._check_shareable(tensors)
            if self._expected is not None:
                await self.wait_receivers(self._expected)
            async with self._push_lock:
                return await self._run_shared_push(tensors, version)
        plan = plan_buckets(
            [TensorMeta.of(name, t) for name, t in tensors.items()],
            bucket_bytes=self._bucket_bytes,
            group_of=self._group_of,
        )
        if self._expected is not None:
            await self.wait_receivers(self._expected)  # immediate once they are in; seals
        async with self._push_lock:
            return await self._run_push(plan, tensors, version)

    async def aclose(self) -> None:
        """Wait (bounded) for receivers to release their mappings and say bye; free everything.

        Idempotent; safe to call while a push is in flight (the push raises TransportClosedError).
        """
        if self._closed:
            return
        self._closed = True
        try:
            async with self._changed:
                self._changed.notify_all()  # a push waiting on acks raises TransportClosedError
            with contextlib.suppress(TimeoutError):
                await self._wait(
                    lambda: not self._peers or self._fatal is not None,  # no reader: no byes
                    within=self._close_timeout,
                    closing=True,
                )
        finally:
            if self._reader is not None:
                self._reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reader
            self._release()

    # ---------------------------------------------------------------- the push

    async def _run_push(
        self, plan: list[Bucket], tensors: dict[str, torch.Tensor], version: int
    ) -> PushReport:
        peers = [peer for peer in self._peers.values() if peer.ready]
        if not peers:
            raise WeightSyncError("no receiver is connected")
        self._push_ids += 1
        state = self._push = _PushState(id=self._push_ids, version=version)
        started = time.perf_counter()
        pack_s = wait_s = 0.0
        # With asynchronous copies (CUDA) and three or more buffers, a bucket is signalled one
        # step late: once bucket k+1's copies are queued, we wait for bucket k's and signal it,
        # so the device always has the next copies at hand while Python signals and acks.
        # (With two, k+1's buffer is k-1's: k's signal would wait for k-1's ack.)
        unsignalled: tuple[Bucket, int, object] | None = None
        try:
            self._backend.mark_sources_ready()
            for bucket in plan:
                index = bucket.index % len(self._staging)
                t0 = time.perf_counter()
                await self._wait_buffer_free(index, state)
                t1 = time.perf_counter()
                readers = self._load_events_of(index)
                previous = unsignalled[2] if unsignalled is not None else None
                marker = await self._in_packer(
                    self._pack, bucket, index, tensors, readers, previous
                )
                t2 = time.perf_counter()
                wait_s, pack_s = wait_s + t1 - t0, pack_s + t2 - t1
                if unsignalled is not None:
                    await self._send_bucket(peers, unsignalled[0], unsignalled[1], state)
                    unsignalled = None
                if self._late_signals:
                    unsignalled = (bucket, index, marker)
                else:
                    await self._send_bucket(peers, bucket, index, state)
            t0 = time.perf_counter()
            if unsignalled is not None:
                await self._in_packer(self._finish_copies, unsignalled[2])
                await self._send_bucket(peers, unsignalled[0], unsignalled[1], state)
            for index in range(len(self._staging)):
                await self._wait_buffer_free(index, state)
            # Acks may precede the loads on the device (load events): wait for those too.
            readers = [r for i in range(len(self._staging)) for r in self._load_events_of(i)]
            await self._in_packer(self._wait_loads, readers)
            wait_s += time.perf_counter() - t0
            await self._send_end(peers, state, len(plan), error="")
        except BaseException as exc:
            self._failed += 1
            await _shielded(self._send_end(peers, state, len(plan), error=_describe_exc(exc)))
            raise
        finally:
            self._push = None
        seconds = time.perf_counter() - started
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._pushes += 1
        self._bytes += nbytes
        return PushReport(
            version=version,
            bytes=nbytes,
            buckets=len(plan),
            tensors=len(tensors),
            receivers=len(peers),
            seconds=seconds,
            pack_seconds=pack_s,
            wait_seconds=wait_s,
        )

    def _check_shareable(self, tensors: Mapping[str, torch.Tensor]) -> None:
        backend = self._backend
        if not isinstance(backend, CudaIpcBackend):
            raise ValueError(f"one-copy pushes need the cuda_ipc backend, not {backend.name}")
        for name, tensor in tensors.items():
            if tensor.device != backend.device:
                raise ValueError(
                    f"one-copy push: {name!r} is on {tensor.device}, the sender on"
                    f" {backend.device}"
                )
            if not tensor.is_contiguous():
                raise ValueError(f"one-copy push: {name!r} is not contiguous")

    async def _run_shared_push(self, tensors: dict[str, torch.Tensor], version: int) -> PushReport:
        """One-copy mode: one message naming every tensor's storage and place; one ack from
        each receiver once its reads are done on the device."""
        peers = [peer for peer in self._peers.values() if peer.ready]
        if not peers:
            raise WeightSyncError("no receiver is connected")
        backend = self._backend
        assert isinstance(backend, CudaIpcBackend)
        self._push_ids += 1
        state = self._push = _PushState(id=self._push_ids, version=version)
        started = time.perf_counter()
        try:
            await self._wait_buffer_free(0, state)  # no bucket of an earlier push pending
            backend.mark_sources_ready()
            storages, entries, used = self._share(backend, tensors)
            t0 = time.perf_counter()
            await self._in_packer(
                functools.partial(backend.wait_sources, within=self._ack_timeout)
            )
            pack_s = time.perf_counter() - t0
            self._holding[0] = (state.id, 0)
            self._holders[0] = {peer.identity for peer in peers if peer.identity in self._peers}
            self._loaders[0] = []  # receivers synchronise before they ack a shared push
            for peer in peers:
                await self._send(
                    peer,
                    lambda p, seq: wire.Shared(
                        conn=p.conn, seq=seq, push=state.id, version=version,
                        storages=storages, entries=entries,
                    ),
                )
            t1 = time.perf_counter()
            await self._wait_buffer_free(0, state)
            wait_s = time.perf_counter() - t1
            await self._send_end(peers, state, 1, error="")
        except BaseException as exc:
            self._failed += 1
            await _shielded(self._send_end(peers, state, 1, error=_describe_exc(exc)))
            raise
        finally:
            self._push = None
        for key in [key for key in self._shared if key not in used]:
            del self._shared[key]  # receivers release what the next push does not list
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._pushes += 1
        self._bytes += nbytes
        return PushReport(
            version=version,
            bytes=nbytes,
            buckets=1,
            tensors=len(tensors),
            receivers=len(peers),
            seconds=time.perf_counter() - started,
            pack_seconds=pack_s,
            wait_seconds=wait_s,
        )

    def _share(
        self, backend: CudaIpcBackend, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[list[wire.Storage], list[wire.SharedEntry], set[tuple[str, int, int]]]:
        storages: dict[int, wire.Storage] = {}
        entries = []
        used = set()
        for name, tensor in tensors.items():
            if tensor.numel() == 0:  # no bytes, no storage to share
                entries.append(
                    wire.SharedEntry(
                        name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                        storage=-1, offset=0, nbytes=0,
                    )
                )
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
            if key not in self._shared:
                self._shared_ids += 1
                whole, descriptor = backend.export_storage(tensor)
                self._shared[key] = (self._shared_ids, whole, descriptor)
            ident, whole, descriptor = self._shared[key]
            used.add(key)
            storages.setdefault(
                ident, wire.Storage(id=ident, descriptor=descriptor, nbytes=whole.numel())
            )
            entries.append(
                wire.SharedEntry(
                    name=name,
                    dtype=dtype_name(tensor.dtype),
                    shape=list(tensor.shape),
                    storage=ident,
                    offset=int(tensor.storage_offset()) * tensor.element_size(),
                    nbytes=tensor.numel() * tensor.element_size(),
                )
            )
        return list(storages.values()), entries, used

    async def _in_packer(self, function: Callable[..., _T], *args: object) -> _T:
        """Run ``function`` in the packing thread (FIFO); TransportClosedError once closed."""
        self._check_usable()
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._packer, function, *args
            )
        except RuntimeError:  # the executor was shut down by aclose() meanwhile
            self._check_usable()
            raise
        self._check_usable()  # aclose() may have run while the thread worked
        return result

    def _load_events_of(self, index: int) -> list[tuple[bytes, object]]:
        """(receiver, load event) of the receivers last sent buffer ``index`` that are here."""
        readers = []
        for identity in self._loaders[index]:
            peer = self._peers.get(identity)
            if peer is not None and peer.load_events is not None:
                readers.append((identity, peer.load_events[index]))
        return readers

    def _pack(
        self,
        bucket: Bucket,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        readers: list[tuple[bytes, object]],
        previous: object | None,
    ) -> object:
        """Wait until the buffer's last readers finished on the device, queue the bucket's
        copies, then (if given) wait for the previous bucket's. Returns this one's marker."""
        self._wait_loads(readers)
        with torch.no_grad(), self._backend.copy_context():  # parameters require grad
            pack_bucket(bucket, self._staging[index].tensor, tensors)
        marker = self._backend.mark_copies()
        if self._late_signals:
            if previous is not None:
                self._finish_copies(previous)
        else:
            self._finish_copies(marker)
        return marker

    def _wait_loads(self, readers: list[tuple[bytes, object]]) -> None:
        """Poll receivers' load events from the host (never on our stream: an event of a process
        that died never fires). A receiver that left is not waited for."""
        deadline = time.monotonic() + self._ack_timeout
        for identity, event in readers:
            try:
                poll_until(
                    functools.partial(self._backend.peer_loads_done, event),
                    within=max(0.0, deadline - time.monotonic()),
                    give_up=functools.partial(self._left_or_closed, identity),
                )
            except TimeoutError:
                raise TransportTimeoutError(
                    f"{self._describe(identity)} did not finish loading a bucket on the device"
                    f" within {self._ack_timeout:g} s"
                ) from None
            if self._closed:
                raise TransportClosedError(f"{self!r} is closed")

    def _left_or_closed(self, identity: bytes) -> bool:
        return self._closed or identity not in self._peers

    def _finish_copies(self, marker: object) -> None:
        """Wait (bounded) for our copies up to ``marker``."""
        try:
            self._backend.finish_copies(marker, within=self._ack_timeout)
        except TimeoutError:
            raise TransportTimeoutError(
                f"the staging copies did not finish within {self._ack_timeout:g} s (device work"
                " queued before the push, which the copies wait for, is still running?)"
            ) from None

    async def _wait_buffer_free(self, index: int, state: _PushState) -> None:
        def what() -> str:
            holders = ", ".join(self._describe(i) for i in self._holders[index])
            push, bucket = self._holding[index] or (0, -1)
            return (
                f"{holders} did not ack bucket {bucket} of push {push} (version {state.version})"
                f" within {self._ack_timeout:g} s"
            )

        try:
            await self._wait(
                lambda: state.failure is not None or not self._holders[index],
                within=self._ack_timeout,
            )
        except TimeoutError:
            raise TransportTimeoutError(what()) from None
        if state.failure is not None:
            raise state.failure

    async def _send_bucket(
        self, peers: list[_Peer], bucket: Bucket, index: int, state: _PushState
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
            )
            for s in bucket.slots
        ]
        self._holding[index] = (state.id, bucket.index)
        self._holders[index] = {peer.identity for peer in peers if peer.identity in self._peers}
        self._loaders[index] = list(self._holders[index])
        for peer in peers:
            await self._send(
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
                ),
            )

    async def _send_end(
        self, peers: list[_Peer], state: _PushState, buckets: int, *, error: str
    ) -> None:
        for peer in peers:
            if peer.identity in self._peers:
                with contextlib.suppress(TransportBrokenError, TransportClosedError):
                    await self._send(
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

    async def _send(self, peer: _Peer, build: Callable[[_Peer, int], wire.Message]) -> None:
        message = build(peer, peer.next_out)
        peer.next_out += 1
        try:
            await self._sock.send_multipart([peer.identity, *self._sealer.seal(message)])
        except zmq.ZMQError as exc:
            if self._closed:
                raise TransportClosedError(f"{self!r} is closed") from exc
            self._drop_peer(peer.identity, f"{peer.describe()} is unreachable ({exc})")
            raise TransportBrokenError(f"{peer.describe()} is unreachable") from exc

    # ---------------------------------------------------------------- the reader task

    def start(self) -> None:
        """Start the reader task (``open_weight_sender`` does this and owns the task)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_forever(), name=f"{self!r} reader")

    async def _read_forever(self) -> None:
        assert self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if self._monitor in ready:
                    self._on_monitor_event(await self._monitor.recv_multipart())
                if self._sock in ready:
                    await self._dispatch(await self._sock.recv_multipart(copy=False))
                async with self._changed:
                    self._changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader must not die silently: waiters see it
            log.exception("weight sender reader failed")
            self._fatal = TransportBrokenError(f"weight sender reader failed: {exc!r}")
            async with self._changed:
                self._changed.notify_all()

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            identity = self._conn_of.pop(int(event["value"]), None)
            if identity is not None:
                self._rejected.discard(identity)
                self._origin.pop(identity, None)
                if identity in self._peers:
                    self._drop_peer(identity, f"{self._describe(identity)} disconnected")

    async def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if identity not in self._origin:
            self._learn_origin(identity, frames[-1])
        if identity in self._gone:
            return
        try:
            message = self._sealer.open([frame.bytes for frame in frames[1:]])
            self._check_sequence(identity, message)
        except TransportAuthError as exc:
            await self._reject(identity, str(exc))
            return
        if isinstance(message, wire.Hello):
            await self._welcome(identity, message)
        elif isinstance(message, wire.Ready):
            self._on_ready(self._peers[identity], message)
        elif isinstance(message, wire.Ack):
            self._on_ack(identity, message)
        elif isinstance(message, wire.Bye):
            self._drop_peer(identity, f"{self._describe(identity)} closed")

    def _learn_origin(self, identity: bytes, frame: zmq.Frame) -> None:
        """Map the connection's fd to the peer (for disconnects) and note its credentials."""
        with contextlib.suppress(zmq.ZMQError, ValueError):
            self._conn_of[int(frame.get(zmq.SRCFD))] = identity
        with contextlib.suppress(zmq.ZMQError, ValueError, UnicodeError):
            # libzmq reports an ipc peer's SO_PEERCRED as "host:uid:gid:pid"
            _host, uid, _gid, pid = str(frame.get("Peer-Address")).rsplit(":", 3)
            self._origin[identity] = f"pid {int(pid)} uid {int(uid)}"
            return
        self._origin[identity] = "unknown origin"

    def _check_sequence(self, identity: bytes, message: wire.Message) -> None:
        peer = self._peers.get(identity)
        if isinstance(message, wire.Hello):
            if peer is not None or message.seq != 0 or message.conn in self._seen_conns:
                raise TransportAuthError("replayed or duplicate hello")
            return
        if isinstance(message, wire.Welcome | wire.Bucket | wire.Shared | wire.End):
            raise TransportAuthError(f"unexpected {type(message).__name__}")
        if peer is None or message.conn != peer.conn or message.seq != peer.next_in:
            raise TransportAuthError("message out of sequence (replayed?)")
        peer.next_in += 1

    async def _reject(self, identity: bytes, reason: str) -> None:
        self._auth_failures += 1
        self._auth_log.warning(
            "dropped an unauthenticated message from peer %s: %s", self._describe(identity), reason
        )
        if identity not in self._peers and identity not in self._rejected:
            self._rejected.add(identity)  # one constant answer per connection, so it fails fast
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart([identity, wire.REJECT])

    async def _welcome(self, identity: bytes, hello: wire.Hello) -> None:
        if self._sealed:
            await self._reject(identity, "sealed: no new receivers are accepted")
            return
        self._seen_conns.add(hello.conn)
        peer = _Peer(identity=identity, conn=hello.conn, name=hello.name, pid=hello.pid)
        self._peers[identity] = peer
        log.info("%s connected", peer.describe())
        with contextlib.suppress(TransportBrokenError):
            await self._send(
                peer,
                lambda p, seq: wire.Welcome(
                    conn=p.conn,
                    seq=seq,
                    backend=self._backend.name,
                    bucket_bytes=self._bucket_bytes,
                    buffers=[buffer.descriptor for buffer in self._staging],
                ),
            )

    def _on_ready(self, peer: _Peer, ready: wire.Ready) -> None:
        if ready.events:
            try:
                if len(ready.events) != len(self._staging):
                    raise ValueError(f"{len(ready.events)} load events for {len(self._staging)}")
                peer.load_events = self._backend.open_peer_events(ready.events)
            except Exception as exc:  # it would ack before its loads are done: unusable
                log.warning("%s sent unusable load events: %r", peer.describe(), exc)
                self._drop_peer(peer.identity, f"{peer.describe()} sent unusable load events")
                return
        peer.ready = True

    def _on_ack(self, identity: bytes, ack: wire.Ack) -> None:
        index = ack.index % len(self._holders)
        if self._holding[index] == (ack.push, ack.index):
            self._holders[index].discard(identity)
        state = self._push
        if ack.error and state is not None and state.id == ack.push and state.failure is None:
            where = f" loading {ack.tensor!r}" if ack.tensor else ""
            state.failure = WeightSyncError(
                f"{self._describe(identity)} failed{where} (bucket {ack.index} of push"
                f" {ack.push}, version {state.version}): {ack.error}"
            )

    def _drop_peer(self, identity: bytes, reason: str) -> None:
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        self._gone.add(identity)
        log.info("%s", reason)
        for holders in self._holders:
            holders.discard(identity)
        state = self._push
        if state is not None and state.failure is None and peer.ready and not self._closed:
            state.failure = TransportBrokenError(f"{reason} during push of version {state.version}")

    # ---------------------------------------------------------------- helpers

    def _describe(self, identity: bytes) -> str:
        peer = self._peers.get(identity)
        if peer is not None:
            return peer.describe()
        return f"<unauthenticated {identity.hex()}, {self._origin.get(identity, 'unknown origin')}>"

    def _ready_count(self) -> int:
        return sum(peer.ready for peer in self._peers.values())

    def _check_usable(self, *, closing: bool = False) -> None:
        if self._closed and not closing:
            raise TransportClosedError(f"{self!r} is closed")
        if self._fatal is not None and not closing:
            raise self._fatal
        if self._reader is None:
            raise TransportClosedError("the sender's reader is not running: use open_weight_sender")

    async def _wait(
        self, predicate: Callable[[], bool], *, within: float, closing: bool = False
    ) -> None:
        """Wait for ``predicate`` under the change condition; raise if the sender breaks."""

        def done() -> bool:
            self._check_usable(closing=closing)
            return predicate()

        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(done)

    def _seal(self) -> None:
        """Unlink every name on disk: all receivers have mapped the buffers and connected."""
        if self._sealed:
            return
        self._sealed = True
        for buffer in self._staging:
            buffer.unlink()
        self._unlink_names()

    def _unlink_names(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _release(self) -> None:
        """Synchronous, idempotent teardown of everything the constructor acquired."""
        self._closed = True
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=0)
        self._ctx.term()
        self._packer.shutdown(wait=True)  # no copies are queued after this
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
        self._unlink_names()

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
        if not getattr(self, "_closed", True):
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


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "push cancelled by the sender"
    return f"{type(exc).__name__}: {exc}"[:2000]
