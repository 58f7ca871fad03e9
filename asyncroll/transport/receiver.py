"""The engine-worker side of the weight push: a blocking receiver.

It runs inside another process (later a vLLM worker, called from a synchronous rpc method), so its
API blocks: ``connect()`` once, ``receive(load_fn)`` once per push, ``close()`` at the end.

Invariants:

* each staging buffer is imported once, at ``connect``, and the mapping is cached until ``close``;
* ``load_fn`` gets views into the staging buffer: they are valid only during the call (the sender
  overwrites the buffer after our ack). Copy what you keep;
* ``load_fn`` always sees whole fused groups and whole tensors (spanning groups are reassembled
  in one reusable scratch buffer the receiver owns and handed over when complete: also views,
  also valid only during the call), except a spanning tensor that ``place`` gives a destination
  for: its pieces are copied straight there as they arrive, and ``load_fn`` never sees it;
* the ack of a bucket is sent after ``load_fn`` returned and the backend's reads are finished,
  or, on the sender's GPU, once they are queued, followed by a device event that the sender
  polls before it reuses the buffer; ``receive`` returns after the device finished every load;
  a loader exception becomes an error ack naming the tensor, and ``receive`` raises
  WeightSyncError once the sender ends the push;
* every wait is bounded; unauthenticated or out-of-sequence frames are dropped and counted;
* ``close`` releases the mappings before its final message, so the sender can reclaim memory.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncroll.errors import (
    TransportAuthError,
    TransportBrokenError,
    TransportClosedError,
    TransportTimeoutError,
    WeightSyncError,
)
from asyncroll.transport import wire
from asyncroll.transport.backends import Backend, MappedBuffer, make_backend, poll_until
from asyncroll.transport.packing import SpanAssembler, dtype_by_name, slot_view
from asyncroll.transport.plan import Part, Slot
from asyncroll.transport.security import RateLimitedLog

__all__ = [
    "LoadBatch",
    "LoadFn",
    "PlaceFn",
    "ReceiveReport",
    "ReceiverStatistics",
    "WeightReceiver",
    "persistent_batch",
]

log = logging.getLogger(__name__)

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], Any]
"""Called once per bucket with (name, tensor) pairs; the tensors are valid only during the call."""

PlaceFn = Callable[[str, torch.dtype, tuple[int, ...], "Part | None"], "torch.Tensor | None"]
"""Asked once per push for each tensor larger than a bucket, at its first piece, with its name,
dtype, shape and ``Part`` (None: a whole tensor): where its bytes go verbatim (a flat uint8
tensor of exactly its size, on the buffers' device), an empty tensor to drop them (the model
does not need them), or None to have it reassembled and handed to ``load_fn`` as usual."""

CLOSE_LINGER_MS: Final = 1000
"""How long close() lets the final message drain before dropping it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverBucketTimes:
    """One bucket's way through the receiver, as ``time.perf_counter()`` stamps (comparable
    with the sender's ``SenderBucketTimes`` on Linux)."""

    bucket: int
    received: float
    """Its signal was read and authenticated."""
    landed: float
    """The sender's copies into the buffer were seen finished (its copy event polled; the
    same as ``received`` for a bucket signalled after its copies)."""
    issued: float
    """The loader returned (on CUDA: its copies are queued)."""
    recorded: float
    """Its reads were marked (the buffer's load event recorded, or the device synchronised)."""
    acked: float
    """The ack was sent."""
    arrived: float = 0.0
    """The socket had its signal (polled; ``received`` is then its read and check): at the
    start of the wait for a signal already queued."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiveReport:
    """One push as the receiver saw it."""

    push: int
    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    load_seconds: float = 0.0
    """Time spent in the load callback and waiting for its device work to finish."""
    wait_seconds: float = 0.0
    """Time blocked waiting for the sender's next message (a bucket, or the end)."""
    record_seconds: float = 0.0
    """Time marking each bucket's reads done (recording its load event, or synchronising)."""
    ack_seconds: float = 0.0
    """Time sealing and sending acks."""
    sync_seconds: float = 0.0
    """Time, at the end, waiting for the device to finish every load (part of load_seconds)."""
    timeline: tuple[ReceiverBucketTimes, ...] = ()
    """Per bucket (or the one message of a one-copy push), where its time went."""
    began: float = 0.0
    """When ``receive`` was called (``time.perf_counter()``: how late after the sender began)."""
    fingerprints: Mapping[str, builtins.bytes] = dataclasses.field(default_factory=dict)
    """The sender's fingerprint of each tensor (empty: not fingerprinted), to check what was
    loaded against (``asyncroll.fingerprints``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverStatistics:
    connected: bool
    imports: int
    """Buffers imported (mapped); stays at the sender's buffer count for the connection's life."""
    pushes: int
    failed_pushes: int
    buckets: int
    bytes_loaded: int
    auth_failures: int
    stale_messages: int
    load_events: int = 0
    """Device events exported to the sender (one per buffer): acks then precede the loads on
    the device, and the sender polls the events before reusing a buffer. 0: we sync before
    each ack."""
    polls_copies: bool = False
    """We poll the sender's copy events: buckets are signalled while their copies run."""


@dataclass(frozen=True, slots=True)
class _SharedLayout:
    """A one-copy list of storages and entries as a receiver holds it: mapped, viewed."""

    layout: int
    """The sender's id of the list (``wire.Shared.layout``)."""
    storages: list[wire.Storage]
    entries: list[wire.SharedEntry]
    made: LoadBatch
    """The (name, view) pairs, under their ``layout`` token (handed over as copies)."""
    nbytes: int


class LoadBatch(list[tuple[str, torch.Tensor]]):
    """The list handed to load_fn; remembers which tensor iteration reached (for error reports)."""

    current = ""
    sources_persist = False
    """The tensors are views of memory that stays mapped at the same addresses while the
    loader keeps them (the staging buffers; a one-copy push's trainer storages, which a kept
    view keeps mapped), so a loader may keep them to read later pushes of the same layout
    (``LoadPlan`` does, by address: a storage the trainer replaced maps elsewhere, and the
    views kept of it are dropped a push later)."""

    whole_push = False
    """The batch is the whole push (one copy): no other load of the push follows it, and the
    device sync before the ack follows the loader's return."""
    layout: object = None
    """Equal for two batches of one receiver only if they hold the same names with the same
    views (same addresses, dtypes, shapes, strides) in the same order, as handed over; None:
    not known. A loader may key what it remembers of a batch by it (``LoadPlan``, with the
    batch's length): a loader that changes such a list in place must drop its layout."""

    parts: dict[str, Part]
    """The batch's tensors that are pieces of larger ones (``Part``), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in super().__iter__():
            self.current = item[0]
            yield item


def persistent_batch(
    tensors: Iterable[tuple[str, torch.Tensor]], *, layout: object
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as one batch that is a whole push and whose sources persist
    (as a one-copy push's): for a loader given tensors that outlive the call (a landed push,
    ``asyncroll.receive.landing``). ``layout`` as ``LoadBatch.layout``."""
    batch = LoadBatch()
    list.extend(batch, tensors)
    batch.sources_persist = batch.whole_push = True
    batch.layout = layout
    return batch


class WeightReceiver:
    """Receives pushes from one ``WeightSender``. Blocking; one thread at a time."""

    def __init__(
        self,
        *,
        address: str,
        secret: bytes,
        name: str = "receiver",
        timeout: float = 60.0,
        backend_factory: Callable[[str], Backend] = make_backend,
    ) -> None:
        self._sealer = wire.Sealer(secret, role="receiver")
        self.address = address
        self.name = name
        self._timeout = timeout
        self._backend_factory = backend_factory
        self._backend: Backend | None = None
        self._mapped: list[MappedBuffer] = []
        self._views: dict[tuple[int, int, int, str, tuple[int, ...]], torch.Tensor] = {}
        """Typed views of the staging buffers by slot (buffer, offset, bytes, dtype, shape):
        a push of a layout seen before makes none again (at most ``_MAX_VIEWS`` kept)."""
        self._shared_views: dict[int, dict[tuple[int, int, str, tuple[int, ...]], torch.Tensor]]
        self._shared_views = {}
        """One-copy pushes: per trainer storage, the views of its tensors, as ``_views``."""
        self._shared: dict[int, MappedBuffer] = {}
        """One-copy mode: the trainer's storages mapped, by the sender's id."""
        self._last_shared: _SharedLayout | None = None
        """The last shared push's storages and entries, and the batch made of them."""
        self._spans = SpanAssembler()
        self._place: PlaceFn | None = None
        self._span_parts: dict[str, Part] = {}
        """This push's spanning tensors that are pieces of larger ones."""
        self._placed: dict[str, torch.Tensor] = {}
        """This push's spanning tensors that ``place`` gave a destination (empty: dropped)."""
        self._conn = secrets.token_bytes(16)
        self._next_out = 0
        self._next_in = 0
        self._finished_push = 0
        self._bucket_bytes = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller: zmq.Poller | None = None
        self._closed = False
        self._imports = self._pushes = self._failed = self._buckets = self._bytes = 0
        self._auth_failures = self._stale = 0
        self._load_seconds = 0.0
        self._stage = {"wait": 0.0, "record": 0.0, "ack": 0.0, "sync": 0.0}
        self._issued = self._recorded = self._landed = self._arrived = 0.0
        """When the current bucket's loads were issued and marked (``ReceiverBucketTimes``)."""
        self._load_events = 0
        self._polls_copies = False
        """We opened the sender's copy events: buckets may come while their copies run."""
        self._timeout_now = timeout
        self._auth_log = RateLimitedLog(log)

    @classmethod
    def from_config(
        cls, config: Mapping[str, str | int], *, name: str = "receiver", **options: Any
    ) -> WeightReceiver:
        """Build a receiver from ``WeightSender.receiver_config()`` (a json-able dict)."""
        timeout_ms = config.get("timeout_ms")
        if isinstance(timeout_ms, int):
            options.setdefault("timeout", timeout_ms / 1000)
        return cls(
            address=str(config["address"]),
            secret=bytes.fromhex(str(config["secret"])),
            name=name,
            **options,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._sock else "new")
        return (
            f"<WeightReceiver {self.name!r} {state} address={self.address}"
            f" pushes={self._pushes} buffers={len(self._mapped)}>"
        )

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics(
            connected=self._sock is not None and not self._closed,
            imports=self._imports,
            pushes=self._pushes,
            failed_pushes=self._failed,
            buckets=self._buckets,
            bytes_loaded=self._bytes,
            auth_failures=self._auth_failures,
            stale_messages=self._stale,
            load_events=self._load_events,
            polls_copies=self._polls_copies,
        )

    # ---------------------------------------------------------------- connect

    def connect(self, *, timeout: float | None = None) -> None:
        """Say hello, import the staging buffers, tell the sender we are ready.

        Raises:
            TransportAuthError: the sender rejected our hello (wrong secret), or vice versa.
            TransportTimeoutError: the sender did not answer within the timeout.
        """
        if self._closed:
            raise TransportClosedError(f"{self!r} is closed")
        if self._sock is not None:
            return
        timeout = self._timeout if timeout is None else timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        # A sender that dies (its process killed, say) drops the connection: we hear of it at
        # once instead of after the timeout.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(self.address)
        try:
            self._send(
                lambda seq: wire.Hello(conn=self._conn, seq=seq, name=self.name, pid=os.getpid())
            )
            welcome = self._recv(timeout, "the sender did not answer our hello", handshake=True)
            if not isinstance(welcome, wire.Welcome):
                raise TransportBrokenError(f"expected a welcome, got {type(welcome).__name__}")
            events = self._import(welcome)
            self._send(
                lambda seq: wire.Ready(
                    conn=self._conn, seq=seq, events=events, polls_copies=self._polls_copies
                )
            )
        except BaseException:
            self.close()
            raise
        log.info("%r connected", self)

    def _import(self, welcome: wire.Welcome) -> list[bytes]:
        """Map the buffers; returns the handles of our per-buffer load events (may be [])."""
        self._backend = self._backend_factory(welcome.backend)
        self._bucket_bytes = welcome.bucket_bytes
        for descriptor in welcome.buffers:
            self._mapped.append(self._backend.open(descriptor, nbytes=welcome.bucket_bytes))
            self._imports += 1
        events = self._backend.export_load_events(len(self._mapped))
        self._load_events = len(events)
        try:
            self._polls_copies = self._backend.open_copy_events(welcome.copy_events)
        except Exception as exc:  # then the sender signals each bucket once it is copied
            log.warning("%r cannot poll the sender's copy events: %r", self, exc)
            self._polls_copies = False
        return events

    # ---------------------------------------------------------------- receive

    def receive(
        self,
        load_fn: LoadFn,
        *,
        place: PlaceFn | None = None,
        timeout: float | None = None,
        push: int = 0,
        check: Callable[[ReceiveReport], None] | None = None,
    ) -> ReceiveReport:
        """Run one whole push: ``load_fn`` per bucket, an ack after each; block until it ends.

        Args:
            load_fn: Called with a list of (name, tensor) per bucket. The tensors are views into
                shared staging memory, valid only during the call: copy what you keep. (A
                loader may keep the views themselves where the list's ``sources_persist`` is
                true, to read the same slots of later pushes; it must drop them before the
                receiver closes, and must not change them in place.)
            place: Optional (``PlaceFn``): a destination for a tensor that spans buckets, so
                that its pieces land there as they arrive instead of being reassembled in the
                scratch buffer and copied again by ``load_fn`` (a compiled load plan knows
                where an embedding goes; ``LoadPlan.destination``).
            timeout: Bound on each wait for the sender (default: the receiver's timeout).
            push: The id of the push to take (``WeightSender.next_push``, read before the
                push began): messages of earlier pushes still queued here (a push that ended
                while we were not receiving) are stale and skipped. 0: the next push.
            check: Called with the report once the push ended well, before ``receive``
                returns; where the sender asked for a verdict (``WeightSender.push(verdicts=
                True)``), what it raised (or that it passed) is sent back, so that the push
                fails (or returns) on it.

        Returns:
            What was loaded, and the version the sender pushed.

        Raises:
            WeightSyncError: ``load_fn`` raised here, or the push failed elsewhere (the sender
                ended it with an error). What ``check`` raised, as it is.
            TransportTimeoutError: the sender went quiet for longer than the timeout.
            TransportClosedError: the receiver is closed or was never connected.
        """
        if self._closed or self._sock is None:
            raise TransportClosedError(f"{self!r} is not connected")
        timeout = self._timeout_now = self._timeout if timeout is None else timeout
        self._spans.clear()
        self._placed.clear()
        self._span_parts.clear()
        self._place = place
        self._load_seconds = 0.0
        stage = self._stage = dict.fromkeys(self._stage, 0.0)
        timeline: list[ReceiverBucketTimes] = []
        clock = time.perf_counter
        started = time.perf_counter()
        expected, push, buckets, tensors, nbytes = push, 0, 0, 0, 0
        failure: tuple[str, str] | None = None
        prints: dict[str, builtins.bytes] = {}
        try:
            while True:
                waiting = clock()
                message = self._recv(
                    timeout, f"the sender sent nothing for push {push or '(next)'}"
                )
                received = clock()
                stage["wait"] += received - waiting
                if (
                    isinstance(message, wire.Bucket | wire.Shared | wire.Prints | wire.End)
                    and (message.push <= self._finished_push or message.push < expected)
                ):
                    self._discard_stale(message)
                    continue
                if isinstance(message, wire.Prints):
                    prints = message.fingerprints  # mid-push; checked after the last load
                    continue
                if isinstance(message, wire.End):
                    push, end = message.push, message
                    break
                if not isinstance(message, wire.Bucket | wire.Shared):
                    raise TransportBrokenError(f"unexpected {type(message).__name__} during a push")
                push = message.push
                self._issued = self._recorded = self._landed = received
                if failure is None:
                    if isinstance(message, wire.Shared):
                        failure, loaded = self._load_shared(message, load_fn)
                        last = self._last_shared
                        nbytes += last.nbytes if failure is None and last is not None else 0
                    else:
                        failure, loaded = self._load(message, load_fn)
                        nbytes += sum(e.nbytes for e in message.entries)
                    tensors += loaded
                    buckets += 1
                acking = clock()
                self._send(self._ack(message, failure))
                acked = clock()
                stage["ack"] += acked - acking
                index = message.index if isinstance(message, wire.Bucket) else 0
                timeline.append(
                    ReceiverBucketTimes(
                        bucket=index,
                        received=received,
                        landed=max(received, self._landed),
                        issued=self._issued,
                        recorded=self._recorded,
                        acked=acked,
                        arrived=self._arrived,
                    )
                )
        except BaseException:
            self._finished_push = max(self._finished_push, push)
            self._failed += 1
            self._settle_loads()
            raise
        self._finished_push = push
        if self._backend is not None:  # acks may have preceded the loads on the device
            syncing = clock()
            self._backend.finish_loads()
            stage["sync"] = clock() - syncing
            self._load_seconds += stage["sync"]
        error = "the receiver failed to load the push"
        try:
            report = self._finish(
                end, failure, buckets, tensors, nbytes, started, timeline,
                end.fingerprints or prints,
            )
            if check is not None:
                check(report)
            error = ""
            return report
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            raise
        finally:
            if end.verdict and not end.error:
                verdict = error
                self._send(
                    lambda seq: wire.Verdict(conn=self._conn, seq=seq, push=end.push, error=verdict)
                )

    def poll(self, timeout: float) -> bool:
        """Whether a message (or news of the sender) waits, after at most ``timeout`` seconds:
        a receiver running on a thread of its own waits here between pushes, free to stop.

        Raises:
            TransportClosedError: the receiver is closed or was never connected.
        """
        if self._closed or self._poller is None:
            raise TransportClosedError(f"{self!r} is not connected")
        return bool(self._poller.poll(max(0, int(timeout * 1000))))

    def _finish(
        self,
        end: wire.End,
        failure: tuple[str, str] | None,
        buckets: int,
        tensors: int,
        nbytes: int,
        started: float,
        timeline: list[ReceiverBucketTimes],
        prints: Mapping[str, builtins.bytes],
    ) -> ReceiveReport:
        if failure is not None or end.error:
            self._failed += 1
            if failure is not None:
                tensor, error = failure
                raise WeightSyncError(f"loading {tensor!r} failed in {self.name!r}: {error}")
            raise WeightSyncError(f"push {end.push} (version {end.version}) failed: {end.error}")
        self._pushes += 1
        self._buckets += buckets
        self._bytes += nbytes
        return ReceiveReport(
            push=end.push,
            version=end.version,
            buckets=buckets,
            tensors=tensors,
            bytes=nbytes,
            seconds=time.perf_counter() - started,
            load_seconds=self._load_seconds,
            wait_seconds=self._stage["wait"],
            record_seconds=self._stage["record"],
            ack_seconds=self._stage["ack"],
            sync_seconds=self._stage["sync"],
            timeline=tuple(timeline),
            began=started,
            fingerprints=prints,
        )

    def _load(self, bucket: wire.Bucket, load_fn: LoadFn) -> tuple[tuple[str, str] | None, int]:
        """Load one bucket; returns (failure as (tensor, message) or None, tensors handed over)."""
        batch = LoadBatch()
        batch.sources_persist = True
        placed = 0
        try:
            buffer = self._mapped[bucket.buffer].tensor
            if bucket.copying:
                self._wait_copies(bucket)
            loading = time.perf_counter()
            for entry in bucket.entries:
                if entry.offset + entry.nbytes > self._bucket_bytes or entry.nbytes < 0:
                    raise ValueError(f"slot of {entry.name!r} lies outside the staging buffer")
                dtype = dtype_by_name(entry.dtype)
                part = _part(entry)
                if entry.spanning:
                    batch.current = entry.name
                    if part is not None:
                        self._span_parts[entry.name] = part
                    target = self._target(entry, dtype, part)
                    if target is None:
                        self._spans.add(_slot(entry, dtype), buffer)
                        continue
                    if target.numel() and entry.nbytes:
                        piece = buffer[entry.offset : entry.offset + entry.nbytes]
                        target[entry.start : entry.start + entry.nbytes].copy_(piece)
                    placed += entry.start + entry.nbytes == entry.total
                else:
                    shape = tuple(entry.shape)
                    key = (bucket.buffer, entry.offset, entry.nbytes, entry.dtype, shape)
                    view = self._views.get(key)
                    if view is None:
                        if len(self._views) >= _MAX_VIEWS:  # layouts keep changing: start over
                            self._views.clear()
                        view = slot_view(buffer, entry.offset, entry.nbytes, dtype, entry.shape)
                        self._views[key] = view
                    batch.append((entry.name, view))
                    if part is not None:
                        batch.parts[entry.name] = part
            batch.current = ""
            completed = self._spans.take([n for n in bucket.completes if n not in self._placed])
            batch.extend(completed)
            for name, _ in completed:
                if name in self._span_parts:
                    batch.parts[name] = self._span_parts[name]
            if batch:
                load_fn(batch)
            recording = time.perf_counter()
            if self._backend is not None:
                self._backend.loads_issued(bucket.buffer)
            done = time.perf_counter()
            self._load_seconds += recording - loading
            self._stage["record"] += done - recording
            self._issued, self._recorded = recording, done
        except Exception as exc:
            names = batch.current or ", ".join(name for name, _ in batch)[:500]
            log.warning("%r: loading %s failed: %r", self, names, exc)
            # Reads queued before the failure must still finish before the buffer is reused.
            if self._backend is not None:
                with contextlib.suppress(Exception):
                    self._backend.loads_issued(bucket.buffer)
            return (names, f"{type(exc).__name__}: {exc}"[:2000]), 0
        return None, len(batch) + placed

    def _wait_copies(self, bucket: wire.Bucket) -> None:
        """Poll (bounded) the copy event of the bucket's buffer: the sender signalled it while
        its copies into the buffer were still running."""
        if not self._polls_copies or self._backend is None:
            raise TransportBrokenError("a bucket still being copied, but we have no copy events")
        landed = functools.partial(self._backend.copies_landed, bucket.buffer)
        try:
            poll_until(landed, within=self._timeout_now)
        except TimeoutError:
            raise TransportTimeoutError(
                f"the sender's copies of bucket {bucket.index} did not finish on the device"
                f" within {self._timeout_now:g} s"
            ) from None
        self._landed = time.perf_counter()

    def _target(
        self, entry: wire.Entry, dtype: torch.dtype, part: Part | None
    ) -> torch.Tensor | None:
        """Where a spanning piece goes straight (None: the scratch buffer). ``place`` is asked
        at a tensor's first piece; its answer holds for the tensor's other pieces."""
        if entry.start:
            return self._placed.get(entry.name)
        if self._place is None:
            return None
        target = self._place(entry.name, dtype, tuple(entry.shape), part)
        if target is None:
            return None
        if target.dtype != torch.uint8 or target.dim() != 1 or target.numel() not in (
            0,
            entry.total,
        ):
            raise ValueError(
                f"place gave {entry.name!r} a destination of {target.dtype} {tuple(target.shape)};"
                f" expected uint8 ({entry.total},) or empty"
            )
        if target.numel() and target.device != self._mapped[0].tensor.device:
            raise ValueError(f"place gave {entry.name!r} a destination on {target.device}")
        self._placed[entry.name] = target
        return target

    def _load_shared(
        self, message: wire.Shared, load_fn: LoadFn
    ) -> tuple[tuple[str, str] | None, int]:
        """One-copy mode: map the trainer's storages (new ones; release the unlisted), load
        every tensor in place from them, and finish the reads on the device before the ack
        (the trainer may change its tensors once every receiver has acked)."""
        batch = LoadBatch()
        try:
            if self._backend is None:
                raise TransportBrokenError("a shared push before the welcome")
            self._shared_batch(message, batch)
            loading = time.perf_counter()
            self._landed = loading
            try:
                load_fn(batch)
            finally:
                recording = time.perf_counter()
                self._backend.finish_loads()  # reads done before the ack, even after a failure
                done = time.perf_counter()
                self._load_seconds += recording - loading
                self._stage["record"] += done - recording
                self._issued, self._recorded = recording, done
        except Exception as exc:
            names = batch.current or ", ".join(name for name, _ in batch)[:500]
            log.warning("%r: loading %s (shared) failed: %r", self, names, exc)
            return (names, f"{type(exc).__name__}: {exc}"[:2000]), 0
        return None, len(batch)

    def _shared_batch(self, message: wire.Shared, batch: LoadBatch) -> None:
        """Fill ``batch`` with the (name, view) pairs of a shared push, its storages mapped. A
        push that repeats the list we hold (``message.repeat``: by its id alone), or lists
        the same storages and entries as it (a trainer pushing the same tensors again: every
        step), gets the last one's pairs, and its ``layout``: a 7B model's 339 views are not
        looked up again before the first copy (with the plan's key by layout and the worker's
        names, 1.4 ms of an H100 host's Python). ``batch`` is the loader's to change; the
        pairs kept are a copy.

        Raises:
            TransportBrokenError: a repeat of a list we do not hold (the sender's mistake).
        """
        last = self._last_shared
        if message.repeat:
            if last is None or last.layout != message.layout:
                held = f"list {last.layout}" if last is not None else "none"
                raise TransportBrokenError(
                    f"the sender repeated one-copy list {message.layout}; this receiver holds"
                    f" {held}"
                )
        elif last is not None and last.storages == message.storages and (
            last.entries == message.entries
        ):
            last = self._last_shared = dataclasses.replace(last, layout=message.layout)
        else:
            self._last_shared = None  # (its views may go now)
            self._new_shared_batch(message, batch)  # (partly filled if it raises: named)
            made = LoadBatch()
            list.extend(made, list.__iter__(batch))
            made.layout = object()  # unique while anyone keys by it
            last = self._last_shared = _SharedLayout(
                message.layout, message.storages, message.entries, made,
                sum(entry.nbytes for entry in message.entries),
            )
        if not batch:
            list.extend(batch, list.__iter__(last.made))
        batch.sources_persist = batch.whole_push = True
        batch.layout = last.made.layout

    def _new_shared_batch(self, message: wire.Shared, batch: LoadBatch) -> None:
        if self._backend is None:
            raise TransportBrokenError("a shared push before the welcome")
        listed = {storage.id: storage for storage in message.storages}
        for ident in [i for i in self._shared if i not in listed]:
            self._shared_views.pop(ident, None)  # the views go before their storage
            self._shared.pop(ident).close()
        for ident, storage in listed.items():
            if ident not in self._shared:
                self._shared[ident] = self._backend.open(
                    storage.descriptor, nbytes=storage.nbytes
                )
        for entry in message.entries:
            dtype = dtype_by_name(entry.dtype)
            if entry.storage == -1 and entry.nbytes == 0:  # an empty tensor
                device = self._mapped[0].tensor.device if self._mapped else None
                batch.append((entry.name, torch.empty(entry.shape, dtype=dtype, device=device)))
                continue
            source = listed.get(entry.storage)
            if source is None or not 0 <= entry.offset <= source.nbytes - entry.nbytes:
                raise ValueError(f"{entry.name!r} lies outside the storages it was sent with")
            views = self._shared_views.setdefault(entry.storage, {})
            key = (entry.offset, entry.nbytes, entry.dtype, tuple(entry.shape))
            view = views.get(key)
            if view is None:
                if len(views) >= _MAX_VIEWS:  # layouts keep changing: start over
                    views.clear()
                buffer = self._shared[entry.storage].tensor
                view = views[key] = slot_view(
                    buffer, entry.offset, entry.nbytes, dtype, entry.shape
                )
            batch.append((entry.name, view))

    def _settle_loads(self) -> None:
        """Best effort: wait for loads already queued on the device (acked or not)."""
        if self._backend is not None:
            with contextlib.suppress(Exception):
                self._backend.finish_loads()

    def _ack(
        self, bucket: wire.Bucket | wire.Shared, failure: tuple[str, str] | None
    ) -> Callable[[int], wire.Message]:
        tensor, error = failure or ("", "")
        index = bucket.index if isinstance(bucket, wire.Bucket) else 0
        layout = self._last_shared.layout if self._last_shared is not None else 0
        return lambda seq: wire.Ack(
            conn=self._conn,
            seq=seq,
            push=bucket.push,
            index=index,
            error=error,
            tensor=tensor,
            layout=layout,
        )

    def _discard_stale(self, message: wire.Bucket | wire.Shared | wire.Prints | wire.End) -> None:
        """A message of a push we already gave up on: release its buffer, load nothing."""
        self._stale += 1
        if isinstance(message, wire.Bucket | wire.Shared):
            self._send(self._ack(message, ("", "stale bucket of an abandoned push")))

    # ---------------------------------------------------------------- socket

    def _send(self, build: Callable[[int], wire.Message]) -> None:
        assert self._sock is not None
        message = build(self._next_out)
        self._next_out += 1
        self._sock.send_multipart(self._sealer.seal(message))

    def _recv(self, timeout: float, what: str, *, handshake: bool = False) -> wire.Message:
        """Next authenticated message in sequence; drops (and counts) everything else."""
        assert self._sock is not None and self._poller is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(self._poller.poll(max(1, int(remaining * 1000)))) if remaining > 0 else {}
            if self._sock in ready:
                self._arrived = time.perf_counter()
                frames = self._sock.recv_multipart()
            elif self._monitor in ready:
                assert self._monitor is not None
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise TransportBrokenError(
                        f"{what}: the sender at {self.address} went away (its process ended?)"
                    )
                continue
            else:
                raise TransportTimeoutError(f"{what} within {timeout:g} s ({self.address})")
            if handshake and frames == [wire.REJECT]:
                raise TransportAuthError(
                    f"the sender at {self.address} rejected our hello: wrong secret for this job?"
                )
            try:
                message = self._sealer.open(frames)
                self._check_sequence(message)
            except TransportAuthError as exc:
                self._auth_failures += 1
                self._auth_log.warning("%r dropped an unauthenticated message: %s", self, exc)
                continue
            return message

    def _check_sequence(self, message: wire.Message) -> None:
        if isinstance(message, wire.Hello | wire.Ready | wire.Ack | wire.Bye):
            raise TransportAuthError(f"unexpected {type(message).__name__}")
        if message.conn != self._conn or message.seq != self._next_in:
            raise TransportAuthError("message out of sequence (replayed?)")
        self._next_in += 1

    # ---------------------------------------------------------------- close

    def __del__(self) -> None:
        if getattr(self, "_sock", None) is not None and not self._closed:
            _unclosed_warning(self)
            with contextlib.suppress(Exception):
                self.close()

    def close(self) -> None:
        """Release the mappings, then tell the sender (final message), then close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._settle_loads()  # queued reads must end before the mappings (and our Bye) go
        self._spans.release()
        self._views.clear()  # views of the buffers go before the buffers
        self._shared_views.clear()
        self._last_shared = None
        for mapped in [*self._mapped, *self._shared.values()]:
            mapped.close()
        self._mapped = []
        self._shared = {}
        if self._monitor is not None:
            assert self._sock is not None
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            if self._backend is not None:  # we were welcomed: say goodbye
                with contextlib.suppress(zmq.ZMQError):
                    self._send(lambda seq: wire.Bye(conn=self._conn, seq=seq))
                self._sock.close()
            else:  # never welcomed: nothing worth lingering for
                self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()


_MAX_VIEWS = 1 << 14
"""Views kept of the staging buffers at most (one per slot of the pushes' layouts)."""


def _unclosed_warning(receiver: WeightReceiver) -> None:
    warnings.warn(f"unclosed {receiver!r}", ResourceWarning, stacklevel=2)


def _part(entry: wire.Entry) -> Part | None:
    if not entry.part:
        return None
    offset, *whole = entry.part
    columns = None
    if entry.columns:
        first, end = entry.columns  # (a sender's ``Piece.part`` checked them; a bad one fails)
        if len(whole) < 2 or not 0 <= first < end <= math.prod(whole[1:]):
            raise ValueError(f"{entry.name!r}: columns {entry.columns} do not fit {whole}")
        columns = (first, end)
    return Part(whole=tuple(whole), offset=offset, columns=columns)


def _slot(entry: wire.Entry, dtype: torch.dtype) -> Slot:
    return Slot(
        name=entry.name,
        dtype=dtype,
        shape=tuple(entry.shape),
        offset=entry.offset,
        nbytes=entry.nbytes,
        start=entry.start,
        total=entry.total,
        spanning=entry.spanning,
    )
