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

from asyncroll.transport import WeightReceiver, open_weight_sender
from asyncroll.transport.wire import REJECT, Hello, Sealer

Digest = tuple[str, tuple[int, ...], str]


def digest(tensor: torch.Tensor) -> Digest:
    """dtype, shape and sha256 of a tensor's bytes (a bit-exact fingerprint)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(data).hexdigest()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Child:
    def __init__(self, entered: Event | None, release: Event | None) -> None:
        self.receiver: WeightReceiver | None = None
        self.rogues: list[zmq.Socket[bytes]] = []
        self.ctx = zmq.Context()
        self.entered, self.release = entered, release

    def connect(self, config: dict[str, Any], name: str, timeout: float = 10.0) -> dict[str, Any]:
        self.receiver = WeightReceiver.from_config(config, name=name, timeout=timeout)
        self.receiver.connect()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        assert self.receiver is not None
        s = self.receiver.statistics()
        return {name: getattr(s, name) for name in s.__slots__}

    def receive(
        self,
        pushes: int = 1,
        *,
        fail_on: str = "",
        die_on: str = "",
        gate: bool = False,
        device_delay_cycles: int = 0,
        die_at_bucket: int = -1,
    ) -> dict[str, Any]:
        """Receive ``pushes`` pushes; reply with digests of the last one.

        ``device_delay_cycles``: each bucket's loads queue a GPU sleep, then device copies (no
        host sync), so the ack reaches the sender long before the loads run on the device.
        ``die_at_bucket``: SIGKILL ourselves when handed that bucket (counting from 0).
        """
        assert self.receiver is not None
        got: dict[str, Digest] = {}
        kept: dict[str, torch.Tensor] = {}
        rss: list[int] = []
        versions: list[int] = []
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

        for _ in range(pushes):
            got.clear()
            report = self.receiver.receive(load)
            versions.append(report.version)
            timelines.append([dataclasses.asdict(times) for times in report.timeline])
            got.update({name: digest(t) for name, t in kept.items()})
            rss.append(rss_bytes())
        return {
            "digests": dict(got),
            "versions": versions,
            "rss": rss,
            "stats": self.stats(),
            "timelines": timelines,
        }

    def close(self) -> dict[str, Any]:
        assert self.receiver is not None
        self.receiver.close()
        return self.stats()

    def rogue_open(self, address: str, count: int) -> int:
        """Open ``count`` connections to ``address`` and wait until each is established."""
        for _ in range(count):
            sock = self.ctx.socket(zmq.DEALER)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
            sock.connect(address)
            if not monitor.poll(10_000):
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
        answered = bool(sock.poll(10_000)) and sock.recv_multipart() == [REJECT]
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
