"""The weight sender's control plane: one ZeroMQ ROUTER socket, its receivers, one reader.

``ControlPlane`` binds the socket in a private runtime directory and reads it from the event
loop (``start``, then ``aclose``): a reader callback on the socket's file descriptor
authenticates every incoming frame, keeps each receiver's handshake and sequence numbers, and
turns acks and departures into state that ``wait`` callers wait on. What a receiver is told and
what its acks mean belong to the data plane, which passes them in as ``PeerHooks``.

An ack is on the push's critical path once per bucket, so the reader is lean: no task, no
``zmq.asyncio`` poller, no lock. The loop calls ``_on_readable`` when the socket signals; it
drains what is queued and wakes the waiters, which run on the next turn of the loop. (A
bucket's signal and its ack took 231 us through a ``zmq.asyncio`` poller task and an
``asyncio.Condition``, 163 us this way, and 93 us between two blocking sockets, on an H100's
host: ``bench/control_latency.py``, docs/performance.md.)

Invariants:

* every frame is authenticated (MAC, then the connection's sequence number) before it changes
  any state; a frame that fails is dropped and counted, never acked, and never disturbs a push;
  its connection gets one constant reject, so a receiver with the wrong secret fails fast;
* a frame larger than ``MAX_FRAME_BYTES`` drops its connection (no memory DoS);
* a receiver is ready only once it has mapped the buffers and its load events (if any) opened;
* a receiver that leaves (bye, disconnect, unreachable) is dropped once: ``on_drop`` runs once,
  and its late frames are ignored;
* every change wakes the waiters, and every wait is bounded by its caller; if the reader fails,
  it does not die silently: the waiters raise its error;
* ZeroMQ's descriptor signals edges, and any use of the socket (a send) may take an edge: after
  each send we look for queued input ourselves and schedule a read;
* one reader call reads at most ``_READ_BATCH`` messages, then yields the loop (a flood of
  frames cannot starve the other tasks);
* after ``seal``, the socket file and the runtime directory are unlinked and no new receiver is
  welcomed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from asyncroll.errors import TransportAuthError, TransportBrokenError, TransportClosedError
from asyncroll.transport import wire
from asyncroll.transport.security import JobIdentity, RateLimitedLog, make_runtime_dir

__all__ = ["MAX_FRAME_BYTES", "ControlPlane", "ControlStatistics", "Peer", "PeerHooks"]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES: Final = 1 << 20
"""Largest frame a peer may send us; bigger ones drop the peer's connection (no memory DoS)."""

_READ_BATCH: Final = 64
"""Messages one reader call reads before it yields the loop."""
_FULL_QUEUE_RETRY: Final = 0.02
"""Seconds a send to a peer whose queue is full waits for a change before it tries again."""
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
"""Plain ints: the reader tests them per message, and zmq's enum flags cost a microsecond."""


@dataclass(slots=True, kw_only=True)
class Peer:
    """One receiver's connection: who it is and where its sequence numbers stand."""

    identity: bytes
    conn: bytes
    name: str
    pid: int
    next_in: int = 1
    next_out: int = 0
    ready: bool = False
    load_events: list[object] | None = None
    """Device events the peer records after loading each buffer (None: it syncs before acks)."""
    polls_copies: bool = False
    """The peer polls our copy events before reading a bucket: it may be signalled early."""
    shared_layout: int = 0
    """The one-copy list the peer holds (``wire.Ack.layout`` of its last ack), which a
    push of the same list repeats by its id alone; 0: none."""

    def describe(self) -> str:
        return f"receiver {self.name!r} (pid {self.pid})"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerHooks:
    """The data plane's part in a receiver's life; the control plane calls nothing else of it."""

    welcome: Callable[[Peer, int], wire.Welcome]
    """The welcome (backend, bucket bytes, buffer descriptors) for a peer, given its ``seq``."""
    open_load_events: Callable[[list[bytes]], list[object] | None]
    """Open a ready peer's load-event handles; raises if they are unusable."""
    on_ack: Callable[[bytes, wire.Ack], None]
    """An authenticated ack from the peer of that identity."""
    on_verdict: Callable[[bytes, wire.Verdict], None]
    """An authenticated verdict (``wire.Verdict``) from the peer of that identity."""
    on_drop: Callable[[Peer, str], None]
    """A peer left (it is gone from ``peers``), with the reason."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlStatistics:
    peers: int
    """Receivers connected and authenticated."""
    ready: int
    """Of those, the ones that mapped the buffers."""
    auth_failures: int
    """Frames dropped because they failed authentication (forged, replayed, garbage)."""
    sealed: bool
    closed: bool


class ControlPlane:
    """The sender's socket and receivers. ``owner`` names the closed transport in errors."""

    def __init__(
        self,
        *,
        identity: JobIdentity,
        hooks: PeerHooks,
        owner: object,
        runtime_base: Path | None = None,
    ) -> None:
        self._sealer = wire.Sealer(identity.secret, role="sender")
        self._hooks = hooks
        self._owner = weakref.ref(owner)
        self._auth_log = RateLimitedLog(log)
        self._peers: dict[bytes, Peer] = {}
        self._seen_conns: set[bytes] = set()
        self._rejected: set[bytes] = set()
        self._conn_of: dict[int, bytes] = {}  # connection fd -> peer identity
        self._origin: dict[bytes, str] = {}  # peer identity -> kernel-reported credentials
        self._gone: set[bytes] = set()  # peers that left: their late frames are ignored
        self._auth_failures = 0
        self._sealed = self._closed = False
        self._fatal: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop that reads the sockets (set by ``start``)."""
        self._fds: list[int] = []
        """The sockets' descriptors the loop watches (none once we stop reading)."""
        self._read_scheduled = False
        self._send_turn = asyncio.Lock()
        self._queued_sends = 0
        """Sends waiting for a full queue (later ones queue behind them)."""
        self._dir = make_runtime_dir(identity.nonce, runtime_base)
        self._socket_path = self._dir / "ctl.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._monitor: zmq.Socket[bytes] | None = None
        try:
            self._bind()
        except BaseException:
            self.release()
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

    # ---------------------------------------------------------------- what the sender uses

    @property
    def address(self) -> str:
        return f"ipc://{self._socket_path}"

    @property
    def runtime_dir(self) -> Path:
        return self._dir

    @property
    def peers(self) -> Mapping[bytes, Peer]:
        """Authenticated receivers by identity (ready or not); those that left are gone."""
        return self._peers

    @property
    def sealed(self) -> bool:
        return self._sealed

    @property
    def closed(self) -> bool:
        return self._closed

    def ready_peers(self) -> list[Peer]:
        return [peer for peer in self._peers.values() if peer.ready]

    def ready_count(self) -> int:
        return sum(peer.ready for peer in self._peers.values())

    def describe(self, identity: bytes) -> str:
        """A peer's name for messages; an unauthenticated one by identity and credentials."""
        peer = self._peers.get(identity)
        if peer is not None:
            return peer.describe()
        return f"<unauthenticated {identity.hex()}, {self._origin.get(identity, 'unknown origin')}>"

    def statistics(self) -> ControlStatistics:
        return ControlStatistics(
            peers=len(self._peers),
            ready=self.ready_count(),
            auth_failures=self._auth_failures,
            sealed=self._sealed,
            closed=self._closed,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = "closed" if s.closed else ("sealed" if s.sealed else "open")
        return f"<ControlPlane {self.address} {state} peers={s.peers} ready={s.ready}>"

    def start(self) -> None:
        """Read the sockets from the running loop from now on (idempotent); ``aclose`` stops."""
        if self._loop is not None:
            return
        assert self._monitor is not None
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        try:
            for sock in (self._sock, self._monitor):
                fd = cast(int, sock.getsockopt(zmq.FD))
                loop.add_reader(fd, self._on_readable)
                fds.append(fd)
        except BaseException:
            for fd in fds:
                loop.remove_reader(fd)
            raise
        self._loop, self._fds = loop, fds
        self._read_scheduled = True  # an edge may have passed before we watched
        loop.call_soon(self._on_readable)

    def check_usable(self, *, closing: bool = False) -> None:
        """Raise unless the reader runs (and, unless ``closing``, we are open and unbroken).

        Raises:
            TransportClosedError: closed, or the reader was never started.
            TransportBrokenError: the reader failed.
        """
        if self._closed and not closing:
            raise TransportClosedError(f"{self._owner_text()} is closed")
        if self._fatal is not None and not closing:
            raise self._fatal
        if self._loop is None:
            raise TransportClosedError("the sender's reader is not running: use open_weight_sender")

    async def wait(
        self, predicate: Callable[[], bool], *, within: float, closing: bool = False
    ) -> None:
        """Wait for ``predicate``, re-checked on every change; raise if we close or break.

        Raises:
            TimeoutError: not within ``within`` seconds.
            TransportClosedError, TransportBrokenError: as ``check_usable``.
        """

        async with asyncio.timeout(within):
            while True:
                self.check_usable(closing=closing)
                if predicate():
                    return
                await self._next_change()

    async def send(self, peer: Peer, build: Callable[[Peer, int], wire.Message]) -> None:
        """Seal and send ``build(peer, seq)``; a peer we cannot reach is dropped. Waits only
        while the peer's queue is full (ZeroMQ's high-water mark).

        Raises:
            TransportBrokenError: the peer is unreachable.
            TransportClosedError: we are closed.
        """
        frames = self._frames(peer, build)
        if not self._queued_sends and self._try_send(peer, frames):
            return
        # A full queue (rare: not the hot path). Sends wait in turn, so that each peer gets
        # its messages in sequence.
        self._queued_sends += 1
        try:
            async with self._send_turn:
                while True:
                    # Closed or broken first: a send that waited its turn behind a failed one
                    # fails too, even if the socket's I/O thread has freed a slot since.
                    if self._fatal is not None:
                        raise self._fatal
                    if not self._fds:
                        raise TransportClosedError(f"{self._owner_text()} is closed")
                    if self._try_send(peer, frames):
                        break
                    # The socket signals (a change) when the queue drains, but that signal may
                    # already have been taken (the check for input after the failed send):
                    # wait for the next change, or try again soon.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_FULL_QUEUE_RETRY):
                            await self._next_change()
        finally:
            self._queued_sends -= 1

    def _frames(self, peer: Peer, build: Callable[[Peer, int], wire.Message]) -> list[bytes]:
        message = build(peer, peer.next_out)
        peer.next_out += 1
        return [peer.identity, *self._sealer.seal(message)]

    def _try_send(self, peer: Peer, frames: list[bytes]) -> bool:
        """Send now; False where the peer's queue is full.

        Raises:
            TransportBrokenError: the peer is unreachable (it is dropped).
            TransportClosedError: we are closed.
        """
        try:
            self._sock.send_multipart(frames, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if self._closed:
                raise TransportClosedError(f"{self._owner_text()} is closed") from exc
            self._drop(peer.identity, f"{peer.describe()} is unreachable ({exc})")
            raise TransportBrokenError(f"{peer.describe()} is unreachable") from exc
        finally:  # a send, even one that fails, may take the edge of input queued meanwhile
            self._schedule_read()
        return True

    def seal(self) -> None:
        """Unlink the socket file and the runtime directory; welcome nobody new. Idempotent."""
        self._sealed = True
        self._unlink_names()

    async def aclose(self, *, within: float) -> None:
        """Refuse new work, wait (at most ``within``) for every receiver's bye, stop the reader.

        Raises:
            TransportClosedError: the reader was never started.
        """
        self._closed = True
        try:
            self._notify()  # a push waiting on acks raises TransportClosedError
            with contextlib.suppress(TimeoutError):
                await self.wait(
                    lambda: not self._peers or self._fatal is not None,  # no reader: no byes
                    within=within,
                    closing=True,
                )
        finally:
            self._stop_reading()

    def release(self) -> None:
        """Synchronous, idempotent teardown: close the sockets, unlink every name on disk
        (whatever state the sockets are in: a finalizer may have closed them first).

        From another thread while the loop runs (a finalizer), the sockets are closed on the
        loop's thread: the reader may be using them (ZeroMQ sockets are not thread-safe), and
        the loop must stop watching their descriptors before they close."""
        self._closed = True
        loop = self._loop
        if self._fds and loop is not None and loop.is_running() and not self._on_loop_thread():
            try:
                loop.call_soon_threadsafe(self._release_sockets)
            except RuntimeError:  # the loop closed meanwhile
                pass
            else:
                self._unlink_names()
                return
        self._release_sockets()

    def _release_sockets(self) -> None:
        self._stop_reading()
        if self._on_loop_thread():
            self._notify()  # a send waiting on a full queue raises TransportClosedError
        try:
            with contextlib.suppress(zmq.ZMQError):
                if self._monitor is not None and not self._sock.closed:
                    self._sock.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._ctx.term()
        finally:
            self._unlink_names()

    def _owner_text(self) -> str:
        owner = self._owner()
        return repr(owner) if owner is not None else "<weight sender (gone)>"

    # ---------------------------------------------------------------- the reader

    def _on_readable(self) -> None:
        """The loop's reader callback: read what is queued (a batch), then wake the waiters."""
        self._read_scheduled = False
        monitor = self._monitor
        if not self._fds or monitor is None or self._sock.closed:
            return  # we stopped reading (the loop may still hold this call)
        try:
            for _ in range(_READ_BATCH):
                if _has_input(monitor):
                    self._on_monitor_event(monitor.recv_multipart(_NOBLOCK))
                elif _has_input(self._sock):
                    self._dispatch(self._sock.recv_multipart(_NOBLOCK, copy=False))
                else:
                    break
            else:
                self._schedule_read(now=True)  # more queued: the rest after other tasks run
        except Exception as exc:  # the reader must not fail silently: waiters see it
            if self._closed and self._sock.closed:
                return  # released under it (an unclosed sender's finalizer): nobody waits
            log.exception("weight sender reader failed")
            self._fatal = TransportBrokenError(f"weight sender reader failed: {exc!r}")
            self._stop_reading()
        self._notify()

    def _schedule_read(self, *, now: bool = False) -> None:
        """Read soon where input is queued (``now``: it is) that no edge will announce."""
        if self._read_scheduled or not self._fds or self._loop is None:
            return
        try:
            queued = now or _has_input(self._sock)
        except zmq.ZMQError:  # closed under us: nothing more to read
            return
        if queued:
            self._read_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _stop_reading(self) -> None:
        """Stop watching the sockets (idempotent; before they close, from any thread)."""
        loop, fds, self._fds = self._loop, self._fds, []
        if loop is None or not fds or loop.is_closed():
            return
        here = self._on_loop_thread()
        for fd in fds:
            with contextlib.suppress(Exception):  # a loop shutting down under us
                if here or not loop.is_running():
                    loop.remove_reader(fd)
                else:
                    loop.call_soon_threadsafe(loop.remove_reader, fd)
        if here:
            self._notify()

    def _on_loop_thread(self) -> bool:
        try:
            return self._loop is not None and asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _notify(self) -> None:
        """Wake every waiter (each re-checks its predicate)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _next_change(self) -> None:
        """Return after the next change (a message read, a departure, close, failure)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError):  # woken: no longer listed
                self._waiters.remove(waiter)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            identity = self._conn_of.pop(int(event["value"]), None)
            if identity is not None:
                self._rejected.discard(identity)
                self._origin.pop(identity, None)
                if identity in self._peers:
                    self._drop(identity, f"{self.describe(identity)} disconnected")

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if identity not in self._origin:
            self._learn_origin(identity, frames[-1])
        if identity in self._gone:
            return
        try:
            message = self._sealer.open([frame.bytes for frame in frames[1:]])
            self._check_sequence(identity, message)
        except TransportAuthError as exc:
            self._reject(identity, str(exc))
            return
        if isinstance(message, wire.Hello):
            self._welcome(identity, message)
        elif isinstance(message, wire.Ready):
            self._on_ready(self._peers[identity], message)
        elif isinstance(message, wire.Ack):
            self._hooks.on_ack(identity, message)
        elif isinstance(message, wire.Verdict):
            self._hooks.on_verdict(identity, message)
        elif isinstance(message, wire.Bye):
            self._drop(identity, f"{self.describe(identity)} closed")

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

    def _reject(self, identity: bytes, reason: str) -> None:
        self._auth_failures += 1
        self._auth_log.warning(
            "dropped an unauthenticated message from peer %s: %s", self.describe(identity), reason
        )
        if identity not in self._peers and identity not in self._rejected:
            self._rejected.add(identity)  # one constant answer per connection, so it fails fast
            with contextlib.suppress(zmq.ZMQError):  # a full queue too: it fails at its timeout
                self._sock.send_multipart([identity, wire.REJECT], zmq.NOBLOCK)

    def _welcome(self, identity: bytes, hello: wire.Hello) -> None:
        if self._sealed:
            self._reject(identity, "sealed: no new receivers are accepted")
            return
        self._seen_conns.add(hello.conn)
        peer = Peer(identity=identity, conn=hello.conn, name=hello.name, pid=hello.pid)
        self._peers[identity] = peer
        log.info("%s connected", peer.describe())
        with contextlib.suppress(TransportBrokenError, TransportClosedError):
            if not self._try_send(peer, self._frames(peer, self._hooks.welcome)):  # a new queue
                self._drop(identity, f"{peer.describe()} is unreachable (its queue is full)")

    def _on_ready(self, peer: Peer, ready: wire.Ready) -> None:
        if ready.events:
            try:
                peer.load_events = self._hooks.open_load_events(ready.events)
            except Exception as exc:  # it would ack before its loads are done: unusable
                log.warning("%s sent unusable load events: %r", peer.describe(), exc)
                self._drop(peer.identity, f"{peer.describe()} sent unusable load events")
                return
        peer.polls_copies = ready.polls_copies
        peer.ready = True

    def _drop(self, identity: bytes, reason: str) -> None:
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        self._gone.add(identity)
        log.info("%s", reason)
        self._hooks.on_drop(peer, reason)

    def _unlink_names(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket_path)
        shutil.rmtree(self._dir, ignore_errors=True)


def _has_input(sock: zmq.Socket[bytes]) -> bool:
    """A message is queued (this also takes the descriptor's edge: see the invariants)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)
