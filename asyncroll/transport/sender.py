"""The trainer side of the weight push: the ``WeightSender`` facade and its control-plane hooks.

``open_weight_sender`` builds a ``WeightSender``: its control plane (``peers.ControlPlane``: the
socket, the receivers and its reader on the event loop, which reads exactly as long as the
``async with``),
its staging buffers (``staging.Staging``, allocated once) and its push pipeline
(``pipeline.PushPipeline``: the per-bucket hot path, and the one-copy push). ``push`` checks its
input, waits for the receivers and runs one push at a time through the pipeline; the hooks turn
the control plane's events into the pipeline's state: an ack frees a buffer, a receiver that
fails or leaves fails the push in flight (``pushes.Pushes``).

Invariants:

* pushes run one at a time, each checked before its first message (bad input raises
  ``ValueError`` and sends nothing);
* waiting for receivers is bounded (``connect_timeout``), and a timeout says how many came (and
  whether some peer failed authentication);
* after ``wait_receivers`` succeeds (with ``seal=True``), the socket file, the runtime directory
  and the shared-memory names are unlinked: from then on a SIGKILL of either side leaves nothing on
  disk, and nobody else can connect;
* ``aclose`` is idempotent; what the constructor acquired is released once, and an unclosed
  sender warns and releases it as it is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch

from asyncroll.errors import (
    TransportAuthError,
    TransportBrokenError,
    TransportClosedError,
    TransportTimeoutError,
    WeightSyncError,
)
from asyncroll.transport import wire
from asyncroll.transport.aio import shielded
from asyncroll.transport.backends import Backend, ShmBackend
from asyncroll.transport.defaults import DEFAULT_BUCKET_BYTES
from asyncroll.transport.lazy import LazyTensor, Makes
from asyncroll.transport.peers import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from asyncroll.transport.peers import ControlPlane, Peer, PeerHooks
from asyncroll.transport.piece import Piece, split_pieces
from asyncroll.transport.pipeline import PushPipeline
from asyncroll.transport.plan import GroupOf, TensorMeta, default_group
from asyncroll.transport.pushes import Fingerprint, Prints, Pushes
from asyncroll.transport.reports import PushReport, SenderBucketTimes
from asyncroll.transport.security import JobIdentity
from asyncroll.transport.shared import SharedStorages, check_shareable
from asyncroll.transport.staging import Staging

__all__ = [
    "PushReport",
    "SenderBucketTimes",
    "SenderStatistics",
    "WeightSender",
    "open_weight_sender",
]

_T = TypeVar("_T")



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
    shared_repeats: int = 0
    """One-copy messages sent as a repeat of the list the receiver holds (by its id)."""


class WeightSender:
    """Pushes named tensors into every connected receiver. Build it with ``open_weight_sender``."""

    def __init__(
        self,
        *,
        backend: Backend | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES["cuda_ipc"],
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
        self._expected = receivers
        self._connect_timeout = connect_timeout
        self._auth_failures_told = 0
        """Authentication failures a ``wait_receivers`` has seen already (it reports newer ones)."""
        self._ack_timeout = ack_timeout
        self._close_timeout = close_timeout
        self._seal_when_ready = seal
        self._identity = identity or JobIdentity.generate()
        self._shared = SharedStorages()
        self._push_lock = asyncio.Lock()
        self._control = ControlPlane(
            identity=self._identity,
            hooks=PeerHooks(  # weakly: an unclosed sender is freed (and warns) as it is dropped
                welcome=_weakly(self._welcome),
                open_load_events=_weakly(self._open_load_events),
                on_ack=_weakly(self._on_ack),
                on_verdict=_weakly(self._on_verdict),
                on_drop=_weakly(self._on_drop),
            ),
            owner=self,
            runtime_base=runtime_base,
        )
        try:
            self._staging = Staging(
                self._backend, nonce=self._identity.nonce, count=buffers,
                bucket_bytes=bucket_bytes, group_of=group_of, close_timeout=close_timeout,
            )
        except BaseException:
            self._control.release()
            raise
        self._pushes = Pushes(self._control)
        self._pipeline = PushPipeline(
            control=self._control, backend=self._backend, staging=self._staging,
            shared=self._shared, pushes=self._pushes, ack_timeout=ack_timeout,
        )

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
            pushes=self._pushes.succeeded,
            failed_pushes=self._pushes.failed,
            bytes_pushed=self._pushes.bytes_pushed,
            auth_failures=control.auth_failures,
            buffers=self._staging.count,
            bucket_bytes=self._bucket_bytes,
            sealed=control.sealed,
            closed=control.closed,
            shared_storages=len(self._shared),
            shared_repeats=self._pipeline.shared_repeats,
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
            TransportAuthError: not enough receivers came, and some peer failed authentication
                since the last wait (or since the sender opened), before this one or during it.
            TransportTimeoutError: not enough receivers came within the timeout.
            TransportClosedError: the sender was closed.
        """
        control = self._control
        if control.sealed and control.ready_count() < n:
            raise TransportBrokenError(
                f"{control.ready_count()} of {n} receivers left, and the sender is sealed (no new"
                " receiver can connect): open a new sender"
            )
        timeout = self._connect_timeout
        try:
            await control.wait(lambda: control.ready_count() >= n, within=timeout)
        except TimeoutError:
            msg = f"{control.ready_count()} of {n} receivers connected within {timeout:g} s"
            seen = control.statistics().auth_failures
            failures, self._auth_failures_told = seen - self._auth_failures_told, seen
            if failures:
                raise TransportAuthError(
                    f"{msg}; {failures} peer message(s) failed authentication (a receiver with"
                    " the wrong secret?)"
                ) from None
            raise TransportTimeoutError(msg) from None
        self._auth_failures_told = control.statistics().auth_failures
        if self._seal_when_ready and not control.sealed:
            self._staging.unlink()
            control.seal()

    async def push(
        self,
        named_tensors: Mapping[str, torch.Tensor | LazyTensor | Piece]
        | Iterable[tuple[str, torch.Tensor | LazyTensor | Piece]],
        *,
        version: int,
        one_copy: bool = False,
        fingerprints: Prints | None = None,
        fingerprint: Fingerprint | None = None,
        receivers_waiting: bool = False,
        verdicts: bool = False,
    ) -> PushReport:
        """Move ``named_tensors`` into every ready receiver; returns once all of them loaded it.

        ``fingerprints`` (``asyncroll.fingerprints``) travel with the push, for each receiver's
        loader to check what it loaded (``ReceiveReport.fingerprints``). Given as a callable,
        they are taken once the first buckets are signalled (their reads then overlap the
        receivers' copies); the tensors must not change meanwhile.

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

        ``receivers_waiting``: the receivers were told to receive this push before it began
        (their ``receive`` is called already). A push that fails, or is cancelled, before it
        begins (before it has an id and its first message) then still sends them its End,
        naming the error, so they stop waiting at once (``call_off``); without it such a push
        sends nothing (a receiver that is not receiving would read that End as its next
        push's, unless told which push to take: ``next_push``). Where several pushes share
        the sender at once, "before it begins" means before any other push began since.

        Raises:
            WeightSyncError: a receiver's loader raised (names the receiver, tensor and message).
            TransportBrokenError: a receiver disconnected mid-push.
            TransportTimeoutError: a receiver did not ack within ``ack_timeout``.
            TransportClosedError: the sender is closed.
        """
        unbegun = self._pushes.begun if receivers_waiting else None
        try:
            return await self._push(
                named_tensors, version=version, one_copy=one_copy, fingerprints=fingerprints,
                fingerprint=fingerprint, unbegun=unbegun, verdicts=verdicts,
            )
        except BaseException as exc:
            await self._call_off_unbegun(unbegun, version, exc)
            raise

    @property
    def next_push(self) -> int:
        """The id the next push will have (``WeightReceiver.receive(push=...)``): each call of
        ``push`` that begins, or is called off, takes the next id."""
        return self._pushes.begun + 1

    async def call_off(self, version: int, exc: BaseException) -> None:
        """The receivers were told to receive a push that will not come (it failed, or its
        caller was cancelled, before it began): send them its End, naming ``exc``; each one
        raises it. Counted as a failed push. Runs to completion even if our caller is
        cancelled meanwhile; after the push in flight, if any (its receivers are busy with
        it)."""

        async def locked() -> None:
            async with self._push_lock:
                await self._pushes.call_off(version, exc)

        await shielded(locked())

    async def _call_off_unbegun(
        self, unbegun: int | None, version: int, exc: BaseException
    ) -> None:
        """``call_off`` if the receivers wait (``unbegun``: the count of pushes begun when this
        one was called) and no push began since."""
        if unbegun is not None and self._pushes.begun == unbegun:
            await self.call_off(version, exc)

    async def _push(
        self,
        named_tensors: Mapping[str, torch.Tensor | LazyTensor | Piece]
        | Iterable[tuple[str, torch.Tensor | LazyTensor | Piece]],
        *,
        version: int,
        one_copy: bool,
        fingerprints: Prints | None,
        fingerprint: Fingerprint | None,
        unbegun: int | None,
        verdicts: bool,
    ) -> PushReport:
        self._control.check_usable()
        within = self._ack_timeout if verdicts else None
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
                return await self._pipeline.run_shared(
                    whole, version, fingerprints=fingerprints, verdicts_within=within
                )
        plan = self._staging.plan_for(
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
                return await self._pipeline.run(
                    plan, tensors, version, fingerprints=fingerprints, makes=makes,
                    fingerprint=fingerprint if lazy else None, pieces=frozenset(parts),
                    verdicts_within=within,
                )
        except BaseException as exc:
            # the waiting receivers first: the drain makes every tensor left (gathers)
            await self._call_off_unbegun(unbegun, version, exc)
            if makes is not None and makes.pending:  # the other ranks' collectives
                await self._pipeline.drain(makes)
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
        """Start reading the socket on the running loop (``open_weight_sender`` does this)."""
        self._control.start()

    # ---------------------------------------------------------------- hooks of the control plane

    def _welcome(self, peer: Peer, seq: int) -> wire.Welcome:
        return wire.Welcome(
            conn=peer.conn,
            seq=seq,
            backend=self._backend.name,
            bucket_bytes=self._bucket_bytes,
            buffers=self._staging.descriptors(),
            copy_events=self._staging.copy_events,
        )

    def _open_load_events(self, handles: list[bytes]) -> list[object] | None:
        if len(handles) != len(self._staging.buffers):
            raise ValueError(f"{len(handles)} load events for {len(self._staging.buffers)}")
        return self._backend.open_peer_events(handles)

    def _on_ack(self, identity: bytes, ack: wire.Ack) -> None:
        peer = self._control.peers.get(identity)
        if peer is not None:
            peer.shared_layout = ack.layout
        self._staging.acked(identity, push=ack.push, bucket=ack.index)
        state = self._pushes.current
        if ack.error and state is not None and state.id == ack.push and state.failure is None:
            where = f" loading {ack.tensor!r}" if ack.tensor else ""
            state.failure = WeightSyncError(
                f"{self._control.describe(identity)} failed{where} (bucket {ack.index} of push"
                f" {ack.push}, version {state.version}): {ack.error}"
            )

    def _on_verdict(self, identity: bytes, verdict: wire.Verdict) -> None:
        self._pushes.on_verdict(identity, verdict)

    def _on_drop(self, peer: Peer, reason: str) -> None:
        self._staging.left(peer.identity)
        state = self._pushes.current
        if state is not None and state.failure is None and peer.ready and not self._control.closed:
            state.failure = TransportBrokenError(f"{reason} during push of version {state.version}")

    # ---------------------------------------------------------------- the end

    def _release(self) -> None:
        """Synchronous, idempotent teardown of everything the constructor acquired."""
        try:
            self._control.release()
        finally:
            self._staging.release()
            self._shared.clear()

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
    bucket_bytes: int = DEFAULT_BUCKET_BYTES["cuda_ipc"],
    buffers: int = 2,
    receivers: int | None = None,
    group_of: GroupOf = default_group,
    connect_timeout: float = 120.0,
    ack_timeout: float = 60.0,
    close_timeout: float = 5.0,
    seal: bool = True,
    runtime_base: Path | None = None,
) -> AsyncIterator[WeightSender]:
    """Open a weight sender; its socket is read exactly as long as the ``async with`` block.

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
        await shielded(sender.aclose())


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
