"""Child-process entry points for the transport tests (spawned: they must be importable).

A child runs ``serve``: it obeys commands from the test over a multiprocessing pipe and answers
each with ``("ok", value)`` or ``("error", type name, message)``. It plays a receiver, a rogue
peer, or a sender that the test kills.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import pickle
import signal
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncroll.transport import ShmBackend, WeightReceiver, open_weight_sender
from asyncroll.transport.backends import MappedBuffer, StagingBuffer
from asyncroll.transport.wire import REJECT, Hello, Sealer

Digest = tuple[str, tuple[int, ...], str]


def digest(tensor: torch.Tensor) -> Digest:
    """dtype, shape and sha256 of a tensor's bytes (a bit-exact fingerprint)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(data).hexdigest()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Shadowed:
    """A staging buffer the sender packs into privately (``tensor``: the shadow) while the
    receivers map another (``descriptor``); ``LaggingCopiesShm`` moves the bytes across."""

    def __init__(self, real: StagingBuffer, shadow: StagingBuffer) -> None:
        self.real, self.shadow = real, shadow
        self.also: list[StagingBuffer] = []
        """Released with this one (the event table rides with the first buffer)."""

    @property
    def tensor(self) -> torch.Tensor:
        return self.shadow.tensor

    @property
    def descriptor(self) -> bytes:
        return self.real.descriptor

    def unlink(self) -> None:
        for buffer in (self.real, self.shadow, *self.also):
            buffer.unlink()

    def close(self) -> None:
        for buffer in (self.real, self.shadow, *self.also):
            buffer.close()


class LaggingCopiesShm(ShmBackend):
    """Shared memory whose copies land late, as a GPU's do, behind per-buffer copy events.

    The sender packs each bucket into a private shadow of its buffer; the bytes reach the buffer
    that receivers map only when the buffer's copy event is polled the second time after it was
    recorded (``copies_landed``, by a receiver), or when the sender waits for its copies
    (``copies_done``/``finish_copies``). So a receiver that read a bucket before its copy event
    fired would read the previous bucket's bytes, and the digests would tell. Events are a
    shared table of (pending, polls) per buffer.
    """

    async_copies = True

    def __init__(self) -> None:
        super().__init__()
        self._buffers: list[_Shadowed] = []
        self._mapped: list[MappedBuffer] = []
        self._shadows: list[MappedBuffer] = []
        self._table: Any = None
        self.early_polls = 0
        """Receiver: polls that found a bucket's copies still running."""

    # sender
    def allocate(self, *, nonce: str, index: int, nbytes: int) -> StagingBuffer:
        real = super().allocate(nonce=nonce, index=index, nbytes=nbytes)
        shadow = super().allocate(nonce=nonce, index=1000 + index, nbytes=nbytes)
        self._buffers.append(_Shadowed(real, shadow))
        return self._buffers[-1]

    def export_copy_events(self, buffers: int) -> list[bytes]:
        nonce = self._buffers[0].real.descriptor.decode().rsplit("-", 2)[1]
        self._table = super().allocate(nonce=nonce, index=9999, nbytes=16 * buffers)
        self._table.tensor.zero_()
        self._buffers[0].also.append(self._table)
        handles = []
        for i, buffer in enumerate(self._buffers):
            handles.append(b"|".join([self._table.descriptor, b"%d" % i, buffer.shadow.descriptor]))
        return handles

    def record_copies(self, buffer: int) -> object:
        self._events()[buffer] = torch.tensor([1, 0])
        return buffer

    def mark_copies(self) -> object:
        return -1

    def copies_done(self, marker: object) -> bool:
        self._land_all()
        return True

    def finish_copies(self, marker: object, *, within: float) -> None:
        self._land_all()

    def _land_all(self) -> None:
        """Every shadow to its buffer (a buffer a receiver still reads gets the same bytes: a
        shadow is rewritten only after every receiver acked what its buffer held)."""
        for buffer in self._buffers:
            buffer.real.tensor.copy_(buffer.shadow.tensor)
        if self._table is not None:
            self._events()[:, 0] = 0

    def _events(self) -> torch.Tensor:
        return self._table.tensor.view(torch.int64).view(-1, 2)

    # receiver
    def open(self, descriptor: bytes, *, nbytes: int) -> MappedBuffer:
        mapped = super().open(descriptor, nbytes=nbytes)
        self._mapped.append(mapped)
        return mapped

    def open_copy_events(self, handles: list[bytes]) -> bool:
        nbytes = self._mapped[0].tensor.numel()
        for handle in handles:
            table, _index, shadow = handle.split(b"|")
            if self._table is None:
                self._table = super().open(table, nbytes=16 * len(handles))
            self._shadows.append(super().open(shadow, nbytes=nbytes))
        return True

    def copies_landed(self, buffer: int) -> bool:
        events = self._events()
        if not events[buffer, 0]:
            return True
        events[buffer, 1] += 1
        if events[buffer, 1] < 2:
            self.early_polls += 1
            return False
        self._mapped[buffer].tensor.copy_(self._shadows[buffer].tensor)
        events[buffer, 0] = 0
        return True

    def close_events(self) -> None:
        for mapped in [*self._shadows, *([self._table] if self._table is not None else [])]:
            mapped.close()


class _Child:
    def __init__(self, entered: Event | None, release: Event | None) -> None:
        self.receiver: WeightReceiver | None = None
        self.lagging: LaggingCopiesShm | None = None
        self.rogues: list[zmq.Socket[bytes]] = []
        self.ctx = zmq.Context()
        self.entered, self.release = entered, release

    def connect(
        self, config: dict[str, Any], name: str, timeout: float = 60.0, backend: str = ""
    ) -> dict[str, Any]:
        """``backend="lagging"``: receive with ``LaggingCopiesShm`` (polling copy events)."""
        options: dict[str, Any] = {}
        if backend == "lagging":
            lagging = self.lagging = LaggingCopiesShm()
            options["backend_factory"] = lambda _name: lagging
        self.receiver = WeightReceiver.from_config(config, name=name, timeout=timeout, **options)
        self.receiver.connect()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        assert self.receiver is not None
        s = self.receiver.statistics()
        out = {name: getattr(s, name) for name in s.__slots__}
        if self.lagging is not None:
            out["early_polls"] = self.lagging.early_polls
        return out

    def receive(
        self,
        pushes: int = 1,
        *,
        fail_on: str = "",
        die_on: str = "",
        gate: bool = False,
        device_delay_cycles: int = 0,
        die_at_bucket: int = -1,
        push: int = 0,
        refuse_version: int | None = None,
    ) -> dict[str, Any]:
        """Receive ``pushes`` pushes; reply with digests of the last one.

        ``device_delay_cycles``: each bucket's loads queue a GPU sleep, then device copies (no
        host sync), so the ack reaches the sender long before the loads run on the device.
        ``die_at_bucket``: SIGKILL ourselves when handed that bucket (counting from 0).
        ``push``: the id of the first push to take (``WeightReceiver.receive``).
        ``refuse_version``: the receiver's check (``receive(check=)``) fails a push of that
        version, after every byte of it was loaded and acked.
        """
        assert self.receiver is not None
        got: dict[str, Digest] = {}
        kept: dict[str, torch.Tensor] = {}
        rss: list[int] = []
        versions: list[int] = []
        sizes: list[int] = []
        timelines: list[list[dict[str, float]]] = []
        buckets = 0

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal buckets
            if buckets == die_at_bucket:
                os.kill(os.getpid(), signal.SIGKILL)
            buckets += 1
            if gate and self.entered is not None and self.release is not None:
                self.entered.set()
                self.release.wait(30)
            if device_delay_cycles:
                torch.cuda._sleep(device_delay_cycles)
            for name, tensor in batch:
                if name == die_on:
                    os.kill(os.getpid(), signal.SIGKILL)
                if name == fail_on:
                    raise ValueError(f"refusing {name}")
                if device_delay_cycles:
                    kept[name] = tensor.clone()  # queued behind the sleep
                else:
                    got[name] = digest(tensor)

        def check(report: Any) -> None:
            if report.version == refuse_version:
                raise ValueError(f"refusing version {report.version}")

        for _ in range(pushes):
            got.clear()
            report = self.receiver.receive(load, push=push, check=check)
            push = 0
            versions.append(report.version)
            sizes.append(report.bytes)
            timelines.append([dataclasses.asdict(times) for times in report.timeline])
            got.update({name: digest(t) for name, t in kept.items()})
            rss.append(rss_bytes())
        return {
            "digests": dict(got),
            "versions": versions,
            "bytes": sizes,
            "rss": rss,
            "stats": self.stats(),
            "timelines": timelines,
        }

    def close(self) -> dict[str, Any]:
        assert self.receiver is not None
        self.receiver.close()
        if self.lagging is not None:
            self.lagging.close_events()
        return self.stats()

    def rogue_open(self, address: str, count: int) -> int:
        """Open ``count`` connections to ``address`` and wait until each is established."""
        for _ in range(count):
            sock = self.ctx.socket(zmq.DEALER)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
            sock.connect(address)
            if not monitor.poll(60_000):
                raise TimeoutError("rogue could not connect")
            recv_monitor_message(monitor)
            sock.disable_monitor()
            monitor.close()
            self.rogues.append(sock)
        return len(self.rogues)

    def rogue_send(self, attack: str, marker: str) -> bool:
        """Send one attack on a fresh rogue connection; True if the sender answered REJECT."""
        sock = self.rogues.pop(0)
        sock.send_multipart(attack_frames(attack, marker))
        answered = bool(sock.poll(60_000)) and sock.recv_multipart() == [REJECT]
        sock.close(linger=0)
        return answered


class _CreatesFile:
    """Unpickling this would create ``path``: the payload of the crafted-pickle attack."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


ATTACKS = ("pickle", "pickle-with-mac", "wrong-secret-hello", "garbage", "garbage-3", "empty")


def attack_frames(attack: str, marker: str) -> list[bytes]:
    crafted = pickle.dumps(_CreatesFile(marker))
    wrong = Sealer(b"w" * 32, role="receiver")
    return {
        "pickle": [crafted],
        "pickle-with-mac": [os.urandom(32), crafted],
        "wrong-secret-hello": wrong.seal(Hello(conn=os.urandom(16), seq=0, name="rogue", pid=1)),
        "garbage": [os.urandom(200)],
        "garbage-3": [os.urandom(32), os.urandom(64), b"\x00" * 10],
        "empty": [b""],
    }[attack]


async def _sender_until_killed(conn: Connection) -> None:
    async with open_weight_sender(bucket_bytes=1 << 16, receivers=1, connect_timeout=30) as sender:
        conn.send(("ok", (sender.receiver_config(), str(sender.runtime_dir))))
        await sender.wait_receivers(1)
        conn.send(("ok", "sealed"))
        await asyncio.Event().wait()  # until SIGKILL


def serve(conn: Connection, entered: Event | None = None, release: Event | None = None) -> None:
    """Child main loop: run commands until "exit" (or until a test kills us)."""
    child = _Child(entered, release)
    while True:
        command, args, kwargs = conn.recv()
        if command == "exit":
            return
        if command == "sender":
            asyncio.run(_sender_until_killed(conn))
            return
        try:
            conn.send(("ok", getattr(child, command)(*args, **kwargs)))
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
