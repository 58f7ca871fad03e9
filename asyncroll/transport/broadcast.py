"""Weights by collective broadcast, for engines on other hosts: the trainer is rank 0 of a
process group whose other ranks are the engines' workers (NCCL between GPUs, through vLLM's
``PyNcclCommunicator``; gloo on CPU, the same code).

One push, as every rank sees it, in order on the group:

1. a header (``push``, ``version``, the manifest's length),
2. the manifest: the transfers, each a bucket of small tensors packed at aligned offsets or
   one tensor larger than a bucket sent from (and into) its own storage, plus fingerprints,
3. the transfers, through ``buffers`` staging buffers on each side: the sender packs bucket
   k+1 while bucket k is on the wire; each receiver loads bucket k while k+1 arrives,
4. a trailer: the sender's status. A sender that fails mid-push still completes every
   collective (so the group stays usable) and says so here; receivers then fail the push,
   and their workers restore their backups, as for any failed push,
5. the verdict: an all-reduce of every rank's failures, once each receiver has loaded and
   checked what it took (``receive(after=...)``). Every rank learns whether the push landed
   everywhere, with no other message: the sender fails a push any receiver failed (a
   broadcast alone cannot tell it: NCCL may take a small push into a dead peer's buffers),
   and a receiver whose own part went well fails a push another rank failed, so every
   engine rolls back together; an engine whose receive returned knows its push is whole
   (a Ray engine labels it there, saving a round trip).

On CUDA no host waits per bucket on either side: streams wait on events of their own
process (pack -> broadcast -> reuse on the sender; broadcast -> load -> reuse on a
receiver). The host waits once, at the end of a push, with a deadline; a peer that never
completes (died) makes the waiting side abort its communicator and raise
``TransportTimeoutError`` (nothing hangs). On gloo every wait has the deadline, and a peer
that leaves the group fails the others' pending operations at once.

The group is formed by ``open_broadcast_sender`` (rank 0, which owns the rendezvous store on
a port it picks itself) and ``BroadcastReceiver.join`` in every worker; ``config()`` says
where to join. Independent of vLLM except for the NCCL communicator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any, Final

import msgspec
import torch

from asyncroll.errors import (
    ReceiverFailedError,
    TransportBrokenError,
    TransportClosedError,
    TransportTimeoutError,
    WeightSyncError,
)
from asyncroll.transport.defaults import DEFAULT_BUCKET_BYTES
from asyncroll.transport.lazy import LazyTensor, Makes
from asyncroll.transport.packing import as_bytes, dtype_by_name, dtype_name, slot_view
from asyncroll.transport.piece import Piece, split_pieces
from asyncroll.transport.plan import Part, TensorMeta, align, plan_buckets
from asyncroll.transport.pushes import Prints
from asyncroll.transport.receiver import LoadBatch, LoadFn, PlaceFn, ReceiveReport
from asyncroll.transport.sender import PushReport

__all__ = [
    "BroadcastReceiver",
    "BroadcastReceivers",
    "BroadcastSender",
    "FAILED_ELSEWHERE",
    "Group",
    "open_broadcast_sender",
    "routable_address",
]

logger = logging.getLogger(__name__)

_MAGIC: Final = 0x41524243  # "ARBC"
_OK: Final = 0
CONTROL_BYTES: Final = 256 << 10
"""The first broadcast of a push: a header (4 int64) and as much of the manifest as fits
(all of it for a 7B model's 339 tensors with fingerprints); a longer manifest's rest follows
in a second broadcast. One host round trip per push instead of two."""
_HEAD: Final = 32
FAILED_ELSEWHERE: Final = "another rank of the push group failed it"
"""What a receiver whose own part went well says of a push the verdict failed (it reaches
the trainer as text, through vLLM's RPC: ``SenderChannel`` prefers the other errors)."""


class _Entry(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    part: tuple[int, ...] = ()
    """A piece's place in its whole tensor (``plan.Part``): its offset, then the whole shape."""
    columns: tuple[int, ...] = ()
    """A column block's ``[first, end)`` (``plan.Part.columns``)."""


class _Transfer(msgspec.Struct, array_like=True, frozen=True):
    nbytes: int
    entries: tuple[_Entry, ...]
    whole: bool
    """One tensor larger than a bucket, sent from and into its own storage."""


class _Manifest(msgspec.Struct, frozen=True):
    transfers: tuple[_Transfer, ...]
    fingerprints: dict[str, bytes] = {}


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Manifest).decode


def routable_address() -> str:
    """This host's address as peers on other hosts reach it (no packet is sent)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        address = probe.getsockname()[0]
        if isinstance(address, str) and not address.startswith("0."):
            return address
    return "127.0.0.1"


def layout(
    tensors: Mapping[str, torch.Tensor | LazyTensor],
    bucket_bytes: int,
    parts: Mapping[str, Part] | None = None,
) -> tuple[_Transfer, ...]:
    """Buckets of tensors in the given order, each at most ``bucket_bytes``; a tensor larger
    than that is a transfer of its own (the bucket before it is sent first, so tensors travel
    in the given order: a sharded trainer's gathers follow it). ``parts``: the pieces'."""
    parts = parts or {}
    transfers: list[_Transfer] = []
    entries: list[_Entry] = []
    end = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        part = parts.get(name)
        where: dict[str, Any] = {} if part is None else {
            "part": (part.offset, *part.whole), "columns": part.columns or ()
        }
        entry = _Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), 0, nbytes, **where)
        if nbytes > bucket_bytes:
            if entries:
                transfers.append(_Transfer(end, tuple(entries), whole=False))
                entries, end = [], 0
            transfers.append(_Transfer(nbytes, (entry,), whole=True))
            continue
        offset = align(end)
        if offset + nbytes > bucket_bytes and entries:
            transfers.append(_Transfer(end, tuple(entries), whole=False))
            entries, offset = [], 0
        entries.append(msgspec.structs.replace(entry, offset=offset))
        end = offset + nbytes
    if entries:
        transfers.append(_Transfer(end, tuple(entries), whole=False))
    return tuple(transfers)


class Group:
    """One side of the push group: ``broadcast`` from rank 0, in order, asynchronously."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: float,
        comm: Any,
        store: Any = None,
    ) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        self._comm = comm
        self._works: dict[int, Any] = {}
        self._issued = 0
        self._closed = False
        self.stream: Any = _stream(device) if device.type == "cuda" else None

    @classmethod
    def open(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: float,
        listen: socket.socket | None = None,
    ) -> Group:
        """Join (rank 0: host) the group; blocks until every rank has joined."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            store: Any = StatelessProcessGroup.create(
                host=host,
                port=port,
                rank=rank,
                world_size=world_size,
                store_timeout=int(timeout),
                listen_socket=listen,
            )
            comm: Any = PyNcclCommunicator(store, device=device)
        else:
            import torch.distributed as dist

            c10d: Any = dist
            store = c10d.TCPStore(
                host,
                port,
                world_size,
                rank == 0,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=listen.detach() if listen is not None else None,
            )
            comm = c10d.ProcessGroupGloo(
                c10d.PrefixStore("asyncroll-push", store), rank, world_size,
                timedelta(seconds=timeout),
            )
        return cls(
            rank=rank, world_size=world_size, device=device, timeout=timeout, comm=comm,
            store=store,
        )

    def broadcast(self, tensor: torch.Tensor) -> int | None:
        """Start a broadcast from rank 0 into (or from) ``tensor``. Gloo: a token to ``wait``
        on; CUDA: None (the operation is queued on ``stream``)."""
        if self._closed:
            raise TransportClosedError("the push group is closed")
        if self.stream is not None:
            self._comm.broadcast(tensor, 0, stream=self.stream)
            return None
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._issued += 1
        self._works[self._issued] = self._comm.broadcast([tensor], options)
        return self._issued

    def all_reduce(self, tensor: torch.Tensor) -> int | None:
        """Start summing ``tensor`` over the group, in place; tokens as ``broadcast``."""
        if self._closed:
            raise TransportClosedError("the push group is closed")
        if self.stream is not None:
            self._comm.all_reduce(tensor, tensor, stream=self.stream)
            return None
        self._issued += 1
        self._works[self._issued] = self._comm.allreduce([tensor])
        return self._issued

    def verdict(self, failed: bool, deadline: float, what: str) -> int:
        """Every rank's ``failed`` summed: how many ranks failed ``what`` (blocks)."""
        count = self.ready(
            torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        )
        handle = self.all_reduce(count)
        if self.stream is not None:
            self.drain(deadline, what)
        else:
            self.wait(handle, deadline)
        return int(count.item())

    def ready(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, made on the caller's current stream, safe to broadcast: CUDA: the
        group's stream waits for that stream, and the allocator for the group's stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            tensor.record_stream(self.stream)
        return tensor

    def wait(self, token: int | None, deadline: float) -> None:
        """Gloo: wait for one operation. A peer that left, or the deadline, closes the group
        (every rank's pending operation then fails at once) and raises."""
        if token is None:
            return
        work = self._works.pop(token, None)
        if work is None:  # waited for already, or the group is gone
            if self._closed:
                raise TransportClosedError("the push group is closed")
            return
        left = max(deadline - time.monotonic(), 0.001)
        try:
            finished = work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            work = None  # (a traceback must not keep the group alive: see ``close``)
            self.close()
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TransportTimeoutError(f"a broadcast did not finish in time: {exc}") from exc
            raise TransportBrokenError(f"a peer of the push group failed: {exc}") from exc
        work = None
        if finished is False:
            self.close()
            raise TransportTimeoutError("a broadcast did not finish by its deadline")

    def drain(self, deadline: float, what: str) -> None:
        """CUDA: wait, with the deadline, for everything queued on the group's stream. A
        peer that never joins the operation makes us abort the communicator (it cannot be
        used again) and raise ``TransportTimeoutError``."""
        if self.stream is None:
            return
        done = _event()
        done.record(self.stream)
        pause = 5e-6  # (short sleeps: this wait is on the update's critical path)
        while not done.query():
            if self._closed:
                raise TransportClosedError(f"{what}: the push group was closed")
            if time.monotonic() > deadline:
                self.close()
                raise TransportTimeoutError(f"{what}: a peer did not complete the broadcast")
            time.sleep(pause)
            pause = min(pause * 2, 5e-5)

    def close(self) -> None:
        """Leave the group: the other ranks' pending operations fail now. NCCL: abort the
        communicator. Gloo has no call that does it: the group's connections close when the
        last reference to it goes, so no operation handle ever leaves this object (they are
        tokens) and this drops the group and them."""
        if self._closed:
            return
        self._closed = True
        comm, self._comm = self._comm, None
        self._works.clear()
        if self.stream is not None:
            with contextlib.suppress(Exception):
                comm.destroy()  # ncclCommAbort: unblocks a broadcast a dead peer never joins
        del comm

    @property
    def closed(self) -> bool:
        return self._closed


def _stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _control(push: int, version: int, manifest: bytes) -> tuple[bytearray, bytes]:
    """The first broadcast's bytes (``CONTROL_BYTES``), and the manifest's rest, if any."""
    head = torch.tensor([_MAGIC, push, version, len(manifest)], dtype=torch.int64)
    control = bytearray(CONTROL_BYTES)
    control[:_HEAD] = head.numpy().tobytes()
    first = manifest[: CONTROL_BYTES - _HEAD]
    control[_HEAD : _HEAD + len(first)] = first
    return control, manifest[len(first) :]


class BroadcastSender:
    """Rank 0: packs and broadcasts pushes. Blocking; ``open_broadcast_sender`` runs it off the
    event loop."""

    def __init__(self, group: Group, *, bucket_bytes: int, buffers: int = 2) -> None:
        if buffers < 1:
            raise ValueError("buffers must be at least 1")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._buffers = [
            torch.empty(bucket_bytes, dtype=torch.uint8, device=group.device)
            for _ in range(buffers)
        ]
        self._pushes = 0
        self._lock = threading.Lock()

    @property
    def receivers(self) -> int:
        return self.group.world_size - 1

    def idle(self, timeout: float) -> bool:
        """Wait (blocking) for the push in progress, if any, to end: its thread cannot be
        cancelled, and a sharded trainer must not make the rest of its gathers beside it.
        False: it did not end within ``timeout``."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True

    def push_blocking(
        self,
        tensors: Mapping[str, torch.Tensor | LazyTensor | Piece],
        *,
        version: int,
        fingerprints: Mapping[str, bytes] | None = None,
    ) -> PushReport:
        """One whole push (every rank runs its side). Returns once every receiver has loaded
        and checked its part (so the caller may change ``tensors``).

        ``LazyTensor``s are made as their transfer is packed, in the order of
        ``plan_buckets`` over the push (``Makes.take``): every rank of a sharded trainer
        makes its gathers in that order, whichever transport it pushes through, and a push
        that fails makes the rest before it raises. A ``Piece`` travels as its own tensor,
        its place in the whole in the manifest.

        Raises:
            WeightSyncError: packing failed here (the collectives were still completed, and
                the receivers were told to fail the push too), or a receiver failed its part.
            TransportTimeoutError: a receiver did not complete a broadcast by the deadline
                (the group is closed; open a new one).
        """
        group = self.group
        device = group.device
        with self._lock:
            self._pushes += 1
            push = self._pushes
            started = time.perf_counter()
            deadline = time.monotonic() + group.timeout
            plain, parts = split_pieces(tensors)
            transfers = layout(plain, self.bucket_bytes, parts)
            manifest = _encode(_Manifest(transfers, dict(fingerprints or {})))
            makes = _makes(plain, parts, self.bucket_bytes)
            failure: BaseException | None = None
            pack_seconds = 0.0
            on_cuda = group.stream is not None
            copy_stream: Any = _stream(device) if on_cuda else None
            if on_cuda:  # the tensors are ready on the caller's stream
                group.stream.wait_stream(torch.cuda.current_stream(device))
                copy_stream.wait_stream(torch.cuda.current_stream(device))
            packed: list[Any] = [_event() if on_cuda else None for _ in self._buffers]
            sent: list[Any] = [_event() if on_cuda else None for _ in self._buffers]
            pending: list[Any] = [None] * len(self._buffers)
            handles: list[Any] = []

            control, rest = _control(push, version, manifest)
            sources = [torch.frombuffer(control, dtype=torch.uint8)]
            if rest:
                sources.append(torch.frombuffer(bytearray(rest), dtype=torch.uint8))
            for source in sources:
                handles.append(group.broadcast(group.ready(source.to(device))))
            for index, transfer in enumerate(transfers):
                if transfer.whole:  # from the tensor's own storage where it can
                    entry = transfer.entries[0]
                    data: torch.Tensor | None = None
                    if failure is None:
                        try:
                            source = self._take(makes, plain, [entry.name])[entry.name]
                            made = isinstance(plain[entry.name], LazyTensor)
                            if source.dtype != dtype_by_name(entry.dtype):  # (made as another)
                                source = source.to(dtype_by_name(entry.dtype))
                            data = as_bytes(source)
                            if data.device != device or data.data_ptr() != source.data_ptr():
                                data = group.ready(data.to(device))  # a copy, on our stream
                            elif made:  # made on the caller's stream; dropped once sent
                                data = group.ready(data)
                        except Exception as exc:  # keep the collectives in step
                            failure = exc
                    if data is None:  # (failed: the receivers still take as many bytes)
                        data = group.ready(
                            torch.empty(transfer.nbytes, dtype=torch.uint8, device=device)
                        )
                    handles.append(group.broadcast(data))
                    continue
                slot = index % len(self._buffers)
                buffer = self._buffers[slot]
                packing = time.perf_counter()
                if on_cuda:
                    copy_stream.wait_event(sent[slot])
                else:
                    group.wait(pending[slot], deadline)
                if failure is None:
                    try:
                        inputs = self._take(makes, plain, [e.name for e in transfer.entries])
                        if on_cuda and makes is not None:  # made on the caller's stream
                            copy_stream.wait_stream(torch.cuda.current_stream(device))
                            for tensor in inputs.values():
                                if tensor.is_cuda:
                                    tensor.record_stream(copy_stream)
                        packing_on = torch.cuda.stream(copy_stream) if on_cuda else None
                        with packing_on or contextlib.nullcontext():
                            for entry in transfer.entries:
                                slot_view(
                                    buffer, entry.offset, entry.nbytes,
                                    dtype_by_name(entry.dtype), entry.shape,
                                ).copy_(inputs[entry.name])
                    except Exception as exc:  # keep the collectives in step; report at the end
                        failure = exc
                pack_seconds += time.perf_counter() - packing
                if on_cuda:
                    packed[slot].record(copy_stream)
                    group.stream.wait_event(packed[slot])
                pending[slot] = group.broadcast(buffer[: transfer.nbytes])
                if on_cuda:
                    sent[slot].record(group.stream)
                handles.append(pending[slot])
            if makes is not None and makes.pending:  # a failure: the other ranks' gathers
                try:
                    makes.drain()
                except Exception as exc:
                    failure = failure or exc
            status = _OK if failure is None else 1
            trailer = torch.tensor([_MAGIC, status], dtype=torch.int64, device=device)
            handles.append(group.broadcast(group.ready(trailer)))
            waiting = time.perf_counter()
            if on_cuda:
                group.drain(deadline, f"push {push}")
            else:
                for handle in handles:
                    group.wait(handle, deadline)
            failed = group.verdict(failure is not None, deadline, f"push {push}'s verdict")
            finished = time.perf_counter()
            if failure is not None:
                raise WeightSyncError(
                    f"push {push} failed while packing: {type(failure).__name__}: {failure}"
                ) from failure
            if failed:
                raise ReceiverFailedError(
                    f"push {push} (version {version}) failed in {failed} of {self.receivers}"
                    " receivers (their engines say why)"
                )
            return PushReport(
                version=version,
                bytes=sum(t.nbytes for t in transfers),
                buckets=len(transfers),
                tensors=len(tensors),
                receivers=self.receivers,
                seconds=finished - started,
                pack_seconds=pack_seconds,
                wait_seconds=finished - waiting,
                began=started,
            )

    @staticmethod
    def _take(
        makes: Makes | None,
        plain: Mapping[str, torch.Tensor | LazyTensor],
        names: list[str],
    ) -> dict[str, torch.Tensor]:
        if makes is not None:
            return makes.take(names)
        return {name: plain[name] for name in names}  # type: ignore[misc]

    async def push(
        self,
        tensors: Mapping[str, torch.Tensor | LazyTensor | Piece],
        *,
        version: int,
        one_copy: bool = False,
        fingerprints: Prints | None = None,
        fingerprint: Any = None,
    ) -> PushReport:
        """``push_blocking`` in a thread (the event loop keeps running). Fingerprints given
        as a callable are taken at once: the push's manifest, its first message, carries
        them; so lazy tensors are checked by the receivers only where ``fingerprints`` has
        theirs (a sharded trainer's, from its shards), never by ``fingerprint`` as made."""
        import asyncio

        del one_copy, fingerprint  # whole tensors are sent from their own storage
        if callable(fingerprints):
            fingerprints = fingerprints()
        return await asyncio.to_thread(
            self.push_blocking, tensors, version=version, fingerprints=fingerprints
        )

    def close(self) -> None:
        self.group.close()
        self._buffers = []


class BroadcastReceiver:
    """A worker's side of the push group. Blocking; one thread at a time. Offers the same
    ``receive(load_fn, place=...)`` as ``WeightReceiver``."""

    def __init__(self, group: Group, *, buffers: int = 2, bucket_bytes: int) -> None:
        self.group = group
        self._count = buffers
        self._bucket_bytes = bucket_bytes
        self._buffers: list[torch.Tensor] = []

    @classmethod
    def join(
        cls, config: Mapping[str, Any], *, rank: int, device: torch.device
    ) -> BroadcastReceiver:
        """Join the group ``config`` (the sender's ``config()``) describes as ``rank``."""
        group = Group.open(
            host=str(config["host"]),
            port=int(config["port"]),
            rank=rank,
            world_size=int(config["world_size"]),
            device=device,
            timeout=float(config["timeout"]),
        )
        return cls(group, buffers=int(config["buffers"]), bucket_bytes=int(config["bucket_bytes"]))

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Staging buffer ``slot`` (allocated whole at its first use, kept: a buffer freed
        while another stream still writes it could be handed out again)."""
        if not self._buffers:
            self._buffers = [
                self.group.ready(
                    torch.empty(self._bucket_bytes, dtype=torch.uint8, device=self.group.device)
                )
                for _ in range(self._count)
            ]
        return self._buffers[slot][:nbytes]

    def receive(
        self,
        load_fn: LoadFn,
        *,
        place: PlaceFn | None = None,
        timeout: float | None = None,
        after: Callable[[ReceiveReport], None] | None = None,
    ) -> ReceiveReport:
        """Take one whole push, ``load_fn`` per transfer (views valid only during the call),
        then ``after(report)`` (the worker's checks of what it loaded), then the verdict:
        returns only if every rank's part succeeded.

        Raises:
            WeightSyncError: the sender failed the push, ``load_fn`` or ``after`` raised, or
                another rank failed its part (the remaining collectives are still
                completed: the group stays usable).
            TransportTimeoutError: the sender (or a peer) did not complete a broadcast by the
                deadline; the group is closed.
            TransportClosedError: closed.
        """
        group = self.group
        if group.closed:
            raise TransportClosedError("the push group is closed")
        device = group.device
        on_cuda = group.stream is not None
        began = time.perf_counter()
        deadline = time.monotonic() + (group.timeout if timeout is None else timeout)
        control = group.ready(torch.empty(CONTROL_BYTES, dtype=torch.uint8, device=device))
        handle = group.broadcast(control)
        if on_cuda:
            group.drain(deadline, "the push's header")
        else:
            group.wait(handle, deadline)
        received = control.cpu()
        magic, push, version, length = (int(x) for x in received[:_HEAD].view(torch.int64))
        if magic != _MAGIC:
            group.close()
            raise WeightSyncError(f"the push group is out of step (header {magic:#x})")
        payload = received[_HEAD : _HEAD + length].numpy().tobytes()
        if length > len(payload):
            rest = group.ready(
                torch.empty(length - len(payload), dtype=torch.uint8, device=device)
            )
            handle = group.broadcast(rest)
            if on_cuda:
                group.drain(deadline, f"push {push}'s manifest")
            else:
                group.wait(handle, deadline)
            payload += rest.cpu().numpy().tobytes()
        manifest = _decode(payload)
        transfers = manifest.transfers
        count = max(self._count, 1)
        received_ev: list[Any] = [_event() if on_cuda else None for _ in range(count)]
        loaded_ev: list[Any] = [_event() if on_cuda else None for _ in range(count)]
        load_stream: Any = torch.cuda.current_stream(device) if on_cuda else None
        failure: BaseException | None = None
        load_seconds = 0.0
        nbytes = 0
        tensors = 0

        def post(index: int) -> tuple[Any, torch.Tensor | None, torch.Tensor]:
            """Start receiving transfer ``index``: (handle, destination placed, buffer)."""
            nonlocal failure
            transfer = transfers[index]
            if transfer.whole:
                entry = transfer.entries[0]
                target = None
                if place is not None and failure is None:
                    try:
                        part = _part(entry)
                        target = place(entry.name, dtype_by_name(entry.dtype), entry.shape, part)
                    except Exception as exc:  # (a bad part) this rank's load fails; keep going
                        failure = exc
                if target is not None and target.numel() == transfer.nbytes:
                    into = target
                else:
                    into = torch.empty(transfer.nbytes, dtype=torch.uint8, device=device)
                    target = None if target is None or target.numel() else target
                    # (its block may have been freed by loads still queued: wait for them)
                    group.ready(into)
                return group.broadcast(into), target, into
            slot = index % count
            buffer = self._buffer(slot, transfer.nbytes)
            if on_cuda:
                group.stream.wait_event(loaded_ev[slot])
            handle = group.broadcast(buffer)
            if on_cuda:
                received_ev[slot].record(group.stream)
            return handle, None, buffer

        posted: dict[int, tuple[Any, torch.Tensor | None, torch.Tensor]] = {}
        for index in range(min(count, len(transfers))):
            posted[index] = post(index)
        for index, transfer in enumerate(transfers):
            handle, placed, data = posted.pop(index)
            slot = index % count
            if on_cuda:
                if transfer.whole:
                    done = _event()
                    done.record(group.stream)
                    load_stream.wait_event(done)
                else:
                    load_stream.wait_event(received_ev[slot])
            else:
                group.wait(handle, deadline)
            loading = time.perf_counter()
            if failure is None and placed is None:
                batch = LoadBatch()
                batch.extend(
                    (e.name, slot_view(data, e.offset, e.nbytes, dtype_by_name(e.dtype), e.shape))
                    for e in transfer.entries
                )
                try:
                    for entry in transfer.entries:
                        part = _part(entry)
                        if part is not None:
                            batch.parts[entry.name] = part
                    load_fn(batch)
                except Exception as exc:
                    failure = exc
            load_seconds += time.perf_counter() - loading
            nbytes += transfer.nbytes
            tensors += len(transfer.entries)
            if on_cuda and not transfer.whole:
                loaded_ev[slot].record(load_stream)
            following = index + count
            if following < len(transfers):
                posted[following] = post(following)
        trailer = group.ready(torch.empty(2, dtype=torch.int64, device=device))
        handle = group.broadcast(trailer)
        if on_cuda:
            group.drain(deadline, f"push {push}")
            torch.cuda.current_stream(device).synchronize()
        else:
            group.wait(handle, deadline)
        magic, status = (int(x) for x in trailer.tolist())
        if magic != _MAGIC:
            group.close()
            raise WeightSyncError(f"push {push}: the push group is out of step (trailer)")
        error: Exception | None = None
        if status != _OK:
            error = WeightSyncError(f"push {push} (version {version}) failed in the sender")
        elif failure is not None:
            error = WeightSyncError(
                f"push {push}: loading failed: {type(failure).__name__}: {failure}"
            )
            error.__cause__ = failure
        report = ReceiveReport(
            push=push,
            version=version,
            buckets=len(transfers),
            tensors=tensors,
            bytes=nbytes,
            seconds=time.perf_counter() - began,
            load_seconds=load_seconds,
            began=began,
            fingerprints=manifest.fingerprints,
        )
        if error is None and after is not None:
            try:
                after(report)
            except Exception as exc:
                error = exc
        failed = group.verdict(error is not None, deadline, f"push {push}'s verdict")
        if error is not None:
            raise error
        if failed:
            raise WeightSyncError(f"push {push} (version {version}): {FAILED_ELSEWHERE}")
        return dataclasses.replace(report, seconds=time.perf_counter() - began)

    def close(self) -> None:
        self.group.close()
        self._buffers = []


def _part(entry: _Entry) -> Part | None:
    """A piece's place in its whole tensor, as the manifest says (None: a whole tensor)."""
    if not entry.part:
        return None
    offset, *whole = entry.part
    columns = None
    if entry.columns:
        first, end = entry.columns
        if len(whole) < 2 or not 0 <= first < end <= math.prod(whole[1:]):
            raise ValueError(f"{entry.name!r}: columns {entry.columns} do not fit {whole}")
        columns = (first, end)
    return Part(whole=tuple(whole), offset=offset, columns=columns)


def _makes(
    plain: Mapping[str, torch.Tensor | LazyTensor], parts: Mapping[str, Part], bucket_bytes: int
) -> Makes | None:
    """The push's lazy tensors, made in ``plan_buckets``'s order (``Makes``), if any."""
    if not any(isinstance(t, LazyTensor) for t in plain.values()):
        return None
    metas = [
        TensorMeta(name=n, dtype=t.dtype, shape=tuple(t.shape), part=parts.get(n))
        for n, t in plain.items()
    ]
    return Makes(plan_buckets(metas, bucket_bytes=bucket_bytes), plain)


class BroadcastReceivers:
    """A worker in several push groups, every trainer rank's (``DistributedWeightPusher``
    with ``fan_in``): one push takes each group's push in turn, in rank order, through the
    same ``load_fn``, and reports them as one. Offers ``BroadcastReceiver``'s ``receive``."""

    def __init__(self, receivers: list[BroadcastReceiver]) -> None:
        self.receivers = receivers

    def receive(
        self,
        load_fn: LoadFn,
        *,
        place: PlaceFn | None = None,
        timeout: float | None = None,
        after: Callable[[ReceiveReport], None] | None = None,
    ) -> ReceiveReport:
        """Every group's push, then ``after`` (once, on them all) inside the last group's
        verdict. A group's push that fails fails the rest too, after they have been taken
        (and dropped): every group's collectives stay in step, and every sender hears of it.

        Raises: as ``BroadcastReceiver.receive``, the first failure."""
        reports: list[ReceiveReport] = []
        failure: BaseException | None = None

        def failed(_: ReceiveReport) -> None:
            raise WeightSyncError(f"another push group of this worker failed: {failure}")

        def checked(last: ReceiveReport) -> None:
            if after is not None:
                after(_merged([*reports, last]))

        def dropped(_: list[tuple[str, torch.Tensor]]) -> None:
            pass

        for index, receiver in enumerate(self.receivers):
            final = index == len(self.receivers) - 1
            try:
                if failure is not None:
                    receiver.receive(dropped, timeout=timeout, after=failed)
                else:
                    reports.append(receiver.receive(
                        load_fn, place=place, timeout=timeout, after=checked if final else None
                    ))
            except BaseException as exc:
                failure = failure or exc
                if isinstance(exc, (TransportTimeoutError, TransportClosedError)):
                    break  # (that group is gone; the others' deadlines end them)
        if failure is not None:
            raise failure
        return _merged(reports)

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


def _merged(reports: list[ReceiveReport]) -> ReceiveReport:
    """Several groups' reports of one push, taken one after another, as one."""
    prints: dict[str, bytes] = {}
    for report in reports:
        prints.update(report.fingerprints)
    last = reports[-1]
    return dataclasses.replace(
        last,
        buckets=sum(r.buckets for r in reports),
        tensors=sum(r.tensors for r in reports),
        bytes=sum(r.bytes for r in reports),
        seconds=sum(r.seconds for r in reports),
        load_seconds=sum(r.load_seconds for r in reports),
        began=reports[0].began,
        fingerprints=prints,
    )


def _close_opened(opening: Any) -> None:
    """A group that formed after its opener gave up: close it."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


@contextlib.asynccontextmanager
async def open_broadcast_sender(
    *,
    receivers: int,
    device: torch.device,
    join: Callable[[dict[str, Any]], Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES["cuda_ipc"],
    buffers: int = 2,
    peer_timeout: float = 120.0,
    host: str | None = None,
) -> AsyncIterator[BroadcastSender]:
    """Form the group with ``receivers`` workers and yield its sender; closed on exit.

    ``join(config)`` is awaited while the sender takes rank 0: it must make every receiver
    call ``BroadcastReceiver.join(config, rank=...)`` (ranks 1..receivers), e.g. through each
    engine's ``attach``. ``config`` holds the rendezvous (this host's routable address and a
    port bound here, so no other process can take it), the world size, the deadline and the
    buffer count; a receiver adds its own rank. ``peer_timeout`` bounds every wait for
    another rank (forming the group, and each push).
    """
    import asyncio

    address = host or routable_address()
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("0.0.0.0" if address != "127.0.0.1" else address, 0))
    listen.listen(128)
    config = {
        "transport": "broadcast",
        "host": address,
        "port": listen.getsockname()[1],
        "world_size": receivers + 1,
        "timeout": peer_timeout,
        "buffers": buffers,
        "bucket_bytes": bucket_bytes,
    }
    opening = asyncio.ensure_future(asyncio.to_thread(
        Group.open,
        host=address,
        port=int(config["port"]),
        rank=0,
        world_size=receivers + 1,
        device=device,
        timeout=peer_timeout,
        listen=listen,
    ))
    try:
        # Both end before either's failure is raised: ``join`` may be a collective of the
        # caller's (a sharded trainer's ranks), which must not outlive this call.
        outcomes = await asyncio.gather(opening, join(config), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
    except BaseException:
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            opening.result().close()
        else:
            opening.add_done_callback(_close_opened)
        with contextlib.suppress(OSError):
            listen.close()
        raise
    sender = BroadcastSender(opening.result(), bucket_bytes=bucket_bytes, buffers=buffers)
    try:
        yield sender
    finally:
        sender.close()
