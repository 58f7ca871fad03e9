"""How long a bucket's signal and its ack take through the sender's control plane.

Every bucket of a staged push makes one round trip: the sender signals it (a ``Bucket``), the
receiver answers (an ``Ack``), and the sender's push wakes. This measures that round trip with a
receiver that loads nothing, three ways, in one run, the same sealed messages each time:

* ours: ``peers.ControlPlane`` (its ``send``, then ``wait`` until the ack is in);
* baseline: a ``zmq.asyncio`` poller task and an ``asyncio.Condition`` (the control plane's
  reader until session 17);
* limit: two blocking sockets, no event loop.

    python bench/control_latency.py [--pings 3000] [--loop asyncio|uvloop] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from asyncroll.transport import wire
from asyncroll.transport.peers import ControlPlane, PeerHooks
from asyncroll.transport.security import JobIdentity

WARMUP = 200


def receiver(address: str, secret: bytes) -> None:
    """A receiver that loads nothing: hello, ready, then an ack for every bucket until End."""
    sealer = wire.Sealer(secret, role="receiver")
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    conn, seq = os.urandom(8), 0

    def send(build: Callable[[int], wire.Message]) -> None:
        nonlocal seq
        sock.send_multipart(sealer.seal(build(seq)))
        seq += 1

    send(lambda s: wire.Hello(conn=conn, seq=s, name="bench", pid=os.getpid()))
    sealer.open(sock.recv_multipart())  # the welcome
    send(lambda s: wire.Ready(conn=conn, seq=s))
    while True:
        message = sealer.open(sock.recv_multipart())
        if isinstance(message, wire.End):
            break
        assert isinstance(message, wire.Bucket)
        send(lambda s, m=message: wire.Ack(conn=conn, seq=s, push=m.push, index=m.index))
    sock.close(linger=1000)


def bucket(conn: bytes, seq: int, index: int) -> wire.Bucket:
    return wire.Bucket(
        conn=conn, seq=seq, push=1, version=1, index=index, buffer=index % 2, entries=[],
        completes=[],
    )


def start_receiver(address: str, secret: bytes) -> mp.process.BaseProcess:
    process = mp.get_context("spawn").Process(target=receiver, args=(address, secret))
    process.start()
    return process


async def ours(pings: int) -> list[float]:
    identity = JobIdentity.generate()
    acked = [-1]

    def on_ack(_: bytes, ack: wire.Ack) -> None:
        acked[0] = ack.index

    hooks = PeerHooks(
        welcome=lambda p, s: wire.Welcome(conn=p.conn, seq=s, backend="none", bucket_bytes=0,
                                          buffers=[]),
        open_load_events=lambda handles: None,
        on_ack=on_ack,
        on_drop=lambda peer, reason: None,
    )
    owner = _Owner()
    control = ControlPlane(identity=identity, hooks=hooks, owner=owner)
    control.start()
    process = start_receiver(control.address, identity.secret)
    try:
        await control.wait(lambda: control.ready_count() == 1, within=120)
        peer = control.ready_peers()[0]
        times = []
        for i in range(pings):
            t0 = time.perf_counter()
            await control.send(peer, lambda p, s, i=i: bucket(p.conn, s, i))
            await control.wait(lambda i=i: acked[0] >= i, within=30)
            times.append(time.perf_counter() - t0)
        await control.send(
            peer, lambda p, s: wire.End(conn=p.conn, seq=s, push=1, version=1, buckets=pings)
        )
    finally:
        process.join(30)
        await control.aclose(within=0.1)
        control.release()
    return times


class _Owner:
    """What the control plane names in its errors."""


class _Handshake:
    """The sender's side of the handshake, for the two hand-written senders."""

    def __init__(self, secret: bytes) -> None:
        self.sealer = wire.Sealer(secret, role="sender")
        self.identity = b""
        self.conn = b""
        self.next_out = 0

    def frames(self, build: Callable[[bytes, int], wire.Message]) -> list[bytes]:
        message = build(self.conn, self.next_out)
        self.next_out += 1
        return [self.identity, *self.sealer.seal(message)]

    def on_hello(self, frames: list[bytes]) -> list[bytes]:
        self.identity = frames[0]
        hello = self.sealer.open(frames[1:])
        assert isinstance(hello, wire.Hello)
        self.conn = hello.conn
        return self.frames(
            lambda c, s: wire.Welcome(conn=c, seq=s, backend="none", bucket_bytes=0, buffers=[])
        )


async def baseline(pings: int, address: str, secret: bytes) -> list[float]:
    """The reader as it was: a zmq.asyncio poller task and a condition."""
    shake = _Handshake(secret)
    sock = zmq.asyncio.Context().socket(zmq.ROUTER)
    sock.bind(address)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    changed = asyncio.Condition()
    state = {"ready": False, "acked": -1}

    async def read_forever() -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                await monitor.recv_multipart()
            if sock in ready:
                frames = await sock.recv_multipart()
                if not shake.identity:
                    await sock.send_multipart(shake.on_hello(frames))
                else:
                    message = shake.sealer.open(frames[1:])
                    if isinstance(message, wire.Ready):
                        state["ready"] = True
                    elif isinstance(message, wire.Ack):
                        state["acked"] = message.index
            async with changed:
                changed.notify_all()

    reader = asyncio.create_task(read_forever())
    process = start_receiver(address, secret)
    try:
        async with changed:
            await changed.wait_for(lambda: state["ready"])
        times = []
        for i in range(pings):
            t0 = time.perf_counter()
            await sock.send_multipart(shake.frames(lambda c, s, i=i: bucket(c, s, i)))
            async with changed:
                await changed.wait_for(lambda i=i: state["acked"] >= i)
            times.append(time.perf_counter() - t0)
        await sock.send_multipart(
            shake.frames(lambda c, s: wire.End(conn=c, seq=s, push=1, version=1, buckets=pings))
        )
    finally:
        process.join(30)
        reader.cancel()
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    return times


def limit(pings: int, address: str, secret: bytes) -> list[float]:
    """Two blocking sockets: what the round trip costs without an event loop."""
    shake = _Handshake(secret)
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    process = start_receiver(address, secret)
    try:
        sock.send_multipart(shake.on_hello(sock.recv_multipart()))
        assert isinstance(shake.sealer.open(sock.recv_multipart()[1:]), wire.Ready)
        times = []
        for i in range(pings):
            t0 = time.perf_counter()
            sock.send_multipart(shake.frames(lambda c, s, i=i: bucket(c, s, i)))
            while True:
                ack = shake.sealer.open(sock.recv_multipart()[1:])
                if isinstance(ack, wire.Ack) and ack.index >= i:
                    break
            times.append(time.perf_counter() - t0)
        sock.send_multipart(
            shake.frames(lambda c, s: wire.End(conn=c, seq=s, push=1, version=1, buckets=pings))
        )
    finally:
        process.join(30)
        sock.close(linger=0)
    return times


def summary(times: list[float]) -> dict[str, float]:
    kept = sorted(times[WARMUP:])
    return {
        "median_us": round(statistics.median(kept) * 1e6, 1),
        "p90_us": round(kept[int(len(kept) * 0.9)] * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pings", type=int, default=3000)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--rounds", type=int, default=2, help="each way this many times, in turn")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.pings <= WARMUP:
        parser.error(f"--pings must exceed the {WARMUP} warm-up pings")
    run = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run
    results: dict[str, list[dict[str, float]]] = {"ours": [], "baseline": [], "limit": []}
    with tempfile.TemporaryDirectory() as tmp:
        secret = JobIdentity.generate().secret
        for r in range(args.rounds):
            print(f"round {r + 1}: ours, baseline, limit ...", file=sys.stderr, flush=True)
            results["ours"].append(summary(run(ours(args.pings))))
            address = f"ipc://{tmp}/b{r}.sock"
            results["baseline"].append(summary(run(baseline(args.pings, address, secret))))
            results["limit"].append(summary(limit(args.pings, f"ipc://{tmp}/l{r}.sock", secret)))
    best = {k: min(v, key=lambda x: x["median_us"]) for k, v in results.items()}
    print(f"\nbucket signal + ack round trip, {args.pings} pings, {args.loop} loop "
          f"(median of each way's best round; p90 beside it)\n")
    print("| way | median us | p90 us | vs limit |")
    print("|---|---|---|---|")
    for way in ("ours", "baseline", "limit"):
        b = best[way]
        ratio = b["median_us"] / best["limit"]["median_us"]
        print(f"| {way} | {b['median_us']:.0f} | {b['p90_us']:.0f} | {ratio:.2f}x |")
    print(f"\nours / baseline: {best['ours']['median_us'] / best['baseline']['median_us']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"loop": args.loop, "pings": args.pings,
                                         "rounds": results, "best": best}, indent=1))


if __name__ == "__main__":
    main()
