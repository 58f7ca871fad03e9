"""The sender's control plane when a receiver's queue is full (ZeroMQ's high-water mark).

A real ``ControlPlane`` and a raw receiver socket in this process, which stops reading. The
plane's send queue is made small, so that sends block after a few messages (the only way
white-box: the plane has no option for it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import zmq

from asyncroll.errors import TransportClosedError
from asyncroll.transport import wire
from asyncroll.transport.peers import ControlPlane, Peer, PeerHooks
from asyncroll.transport.security import JobIdentity

BIG = "x" * 400_000
"""A message this large fills the socket buffers after a few."""


class _Owner:
    """What the plane names in its errors."""


@dataclass
class Setup:
    control: ControlPlane
    peer: Peer
    raw: zmq.Socket[bytes]
    opener: wire.Sealer
    blocked: asyncio.Event
    """Set when a send found the queue full."""


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    identity = JobIdentity.generate()
    hooks = PeerHooks(
        welcome=lambda p, s: wire.Welcome(conn=p.conn, seq=s, backend="none", bucket_bytes=0,
                                          buffers=[]),
        open_load_events=lambda handles: None,
        on_ack=lambda identity, ack: None,
        on_verdict=lambda identity, verdict: None,
        on_drop=lambda peer, reason: None,
    )
    owner = _Owner()
    control = ControlPlane(identity=identity, hooks=hooks, owner=owner)
    control._sock.setsockopt(zmq.SNDHWM, 1)  # before the receiver connects: its pipe's limit
    blocked = asyncio.Event()
    try_send = control._try_send

    def watched(peer: Peer, frames: list[bytes]) -> bool:
        sent = try_send(peer, frames)
        if not sent:
            blocked.set()
        return sent

    control._try_send = watched  # type: ignore[method-assign]
    control.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.RCVHWM, 1)
    raw.setsockopt(zmq.RCVBUF, 4096)
    raw.connect(control.address)
    sealer = wire.Sealer(identity.secret, role="receiver")
    opener = wire.Sealer(identity.secret, role="receiver")
    conn = os.urandom(16)
    try:
        raw.send_multipart(sealer.seal(wire.Hello(conn=conn, seq=0, name="raw", pid=os.getpid())))
        assert await asyncio.to_thread(raw.poll, 30_000)
        assert isinstance(opener.open(raw.recv_multipart()), wire.Welcome)
        raw.send_multipart(sealer.seal(wire.Ready(conn=conn, seq=1)))
        await control.wait(lambda: control.ready_count() == 1, within=30)
        yield Setup(control, control.ready_peers()[0], raw, opener, blocked)
    finally:
        await control.aclose(within=0.1)
        control.release()
        raw.close(linger=0)
        ctx.term()


def _bucket(index: int) -> Callable[[Peer, int], wire.Message]:
    return lambda p, seq: wire.Bucket(
        conn=p.conn, seq=seq, push=1, version=1, index=index, buffer=0, entries=[],
        completes=[BIG],
    )


QUEUED = 16
"""Sends queued behind the first one that found the queue full: 6.4 MB, more than the
socket buffers between the two ends can take while the receiver reads nothing, so the last
of them waits whatever ZeroMQ's I/O thread still moves meanwhile."""


async def _fill(setup: Setup) -> list[asyncio.Task[None]]:
    """Send until a send finds the queue full; ``QUEUED`` more sends queue behind it."""
    sends: list[asyncio.Task[None]] = []
    while not setup.blocked.is_set():
        assert len(sends) < 1000, "the queue never filled"
        sends.append(asyncio.create_task(setup.control.send(setup.peer, _bucket(len(sends)))))
        await asyncio.sleep(0)  # one loop turn: the new task runs until it sends or blocks
    for _ in range(QUEUED):
        sends.append(asyncio.create_task(setup.control.send(setup.peer, _bucket(len(sends)))))
    await asyncio.sleep(0)
    assert not sends[-1].done()  # (the first of the queue may still get through: see QUEUED)
    return sends


async def test_sends_to_a_full_queue_wait_and_arrive_in_sequence(setup: Setup) -> None:
    sends = await _fill(setup)
    indices, seqs = [], []
    for _ in sends:  # the receiver reads again: every send completes, in order
        assert await asyncio.to_thread(setup.raw.poll, 30_000), f"got {indices}"
        message = setup.opener.open(setup.raw.recv_multipart())
        assert isinstance(message, wire.Bucket)
        indices.append(message.index)
        seqs.append(message.seq)
    await asyncio.wait_for(asyncio.gather(*sends), 30)
    assert indices == list(range(len(sends)))
    assert seqs == list(range(seqs[0], seqs[0] + len(sends)))


async def test_a_send_waiting_on_a_full_queue_fails_when_the_plane_closes(setup: Setup) -> None:
    sends = await _fill(setup)
    await setup.control.aclose(within=0.1)
    results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 30)
    # Every send ends (none hangs); the sends the closing found waiting fail with a typed
    # error: the last one at least (see QUEUED), and every send after a failed one (they wait
    # in turn). The socket's I/O thread may still free a slot or two for the first of them.
    failed = [i for i, r in enumerate(results) if r is not None]
    assert all(isinstance(results[i], TransportClosedError) for i in failed), results
    assert failed and failed == list(range(failed[0], len(results))), results
