"""Another user's process on the host must not inject weights or run code in ours.

Rogue peers here are real processes (the shared children of test_transport) and raw sockets.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
import transport_helpers as helpers
import zmq
from test_transport import KB, Child, ChildError, digests, model_tensors, on_disk, pair

from asyncroll.errors import TransportAuthError, TransportTimeoutError
from asyncroll.transport import ShmBackend, open_weight_sender, wire
from asyncroll.transport.security import JobIdentity, make_runtime_dir, restricted_loads

__all__ = ["pair"]


def shm_segments(nonce: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"asyncroll-{nonce}-*"))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_runtime_dir_socket_and_shm_are_private() -> None:
    async with open_weight_sender(bucket_bytes=16 * KB) as sender:
        assert mode(sender.runtime_dir) == 0o700
        socket_path = Path(sender.address.removeprefix("ipc://"))
        assert socket_path.parent == sender.runtime_dir and sender.nonce in str(socket_path)
        assert stat.S_ISSOCK(os.stat(socket_path).st_mode) and mode(socket_path) == 0o600
        segments = shm_segments(sender.nonce)
        assert len(segments) == 2
        assert all(mode(s) == 0o600 and s.stat().st_uid == os.getuid() for s in segments)


def test_runtime_dir_is_never_reused(tmp_path: Path) -> None:
    (tmp_path / "asyncroll-abc").mkdir(mode=0o777)
    with pytest.raises(FileExistsError):
        make_runtime_dir("abc", tmp_path)
    assert mode(make_runtime_dir("def", tmp_path)) == 0o700


def test_receiver_refuses_a_segment_that_is_not_private(tmp_path: Path) -> None:
    path = tmp_path / "asyncroll-0123-0"
    path.write_bytes(b"\0" * 1024)
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="not private"):
        ShmBackend().open(str(path).encode(), nbytes=1024)
    with pytest.raises(ValueError, match="not an asyncroll"):
        ShmBackend().open(b"/etc/passwd", nbytes=1)


@pytest.mark.process
async def test_rogue_process_injects_nothing_and_the_push_is_exact(
    pair: tuple[Child, Child], tmp_path: Path
) -> None:
    receiver, rogue = pair
    marker = str(tmp_path / "pwned")
    tensors = model_tensors(seed=3)
    async with open_weight_sender(bucket_bytes=16 * KB, receivers=1, ack_timeout=30) as sender:
        # Before the legitimate receiver: one connection per attack, each answered REJECT
        # (which proves the sender read and dropped it), plus three kept for the push.
        attacks = list(helpers.ATTACKS)
        await rogue.acall("rogue_open", sender.address, len(attacks) + 3)
        for attack in attacks:
            assert await rogue.acall("rogue_send", attack, marker), attack
        await receiver.acall("connect", sender.receiver_config(), "legit")
        receiver.start("receive", pushes=2)
        push = asyncio.ensure_future(sender.push(tensors, version=1))
        during = ["pickle-with-mac", "wrong-secret-hello", "garbage"]
        for attack in during:  # concurrent with the push, on connections made before the seal
            assert await rogue.acall("rogue_send", attack, marker), attack
        await push
        await sender.push(tensors, version=2)
        reply = await asyncio.to_thread(receiver.result)
        await receiver.acall("close")
        stats = sender.statistics()
    assert not on_disk(marker)
    assert reply["digests"] == digests(tensors)  # exactly our tensors, nothing injected
    assert reply["versions"] == [1, 2] and reply["stats"]["auth_failures"] == 0
    assert stats.auth_failures == len(attacks) + len(during)
    assert stats.pushes == 2 and stats.failed_pushes == 0


@pytest.mark.process
async def test_receiver_with_the_wrong_secret_fails_on_both_sides(child: Child) -> None:
    # The impostor is refused first (its own error says so), then the sender's wait for a
    # receiver expires and names the failure it saw before the wait: event-ordered, so a slow
    # child cannot turn the authentication error into a plain timeout.
    async with open_weight_sender(bucket_bytes=16 * KB, connect_timeout=0.2) as sender:
        config = sender.receiver_config() | {"secret": os.urandom(32).hex()}
        child.start("connect", config, "impostor")
        with pytest.raises(ChildError, match=r"TransportAuthError.*wrong secret") as info:
            await asyncio.to_thread(child.result)
        assert info.value.kind == "TransportAuthError"
        with pytest.raises(TransportAuthError, match="failed authentication"):
            await sender.wait_receivers(1)
        with pytest.raises(TransportTimeoutError):  # told once: the next wait is a plain timeout
            await sender.wait_receivers(1)
        assert sender.statistics().receivers == 0


@pytest.fixture
def child(pair: tuple[Child, Child]) -> Child:
    return pair[0]


async def test_replayed_and_reordered_messages_are_dropped() -> None:
    identity = JobIdentity.generate()
    async with open_weight_sender(bucket_bytes=16 * KB, close_timeout=10) as sender:
        sender_secret = bytes.fromhex(str(sender.receiver_config()["secret"]))
        sealer = wire.Sealer(sender_secret, role="receiver")
        conn = os.urandom(16)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(sender.address)
        hello = sealer.seal(wire.Hello(conn=conn, seq=0, name="raw", pid=os.getpid()))
        sock.send_multipart(hello)
        assert await asyncio.to_thread(sock.poll, 10_000)
        welcome = wire.Sealer(sender_secret, role="receiver")  # opens sender -> receiver
        assert isinstance(welcome.open(sock.recv_multipart()), wire.Welcome)
        ready = sealer.seal(wire.Ready(conn=conn, seq=1))
        sock.send_multipart(ready)
        await sender.wait_receivers(1)
        sock.send_multipart(ready)  # replay
        sock.send_multipart(hello)  # replayed hello on a live connection
        sock.send_multipart(sealer.seal(wire.Ready(conn=conn, seq=7)))  # out of order
        sock.send_multipart(sealer.seal(wire.Ready(conn=os.urandom(16), seq=2)))  # other conn
        sock.send_multipart(sealer.seal(wire.Bye(conn=conn, seq=2)))  # in order: accepted
        await sender.aclose()  # waits for the bye, so everything before it was read
        assert sender.statistics().auth_failures == 4
        sock.close(linger=0)
        ctx.term()
    assert "secret" not in repr(identity) and identity.secret.hex() not in repr(identity)


def test_sealed_messages_resist_forgery_and_reflection() -> None:
    secret = os.urandom(32)
    sender, receiver = wire.Sealer(secret, role="sender"), wire.Sealer(secret, role="receiver")
    message = wire.Ack(conn=b"c" * 16, seq=3, push=1, index=0)
    frames = receiver.seal(message)
    assert sender.open(frames) == message
    with pytest.raises(TransportAuthError, match="bad MAC"):
        receiver.open(frames)  # reflected back to its author
    with pytest.raises(TransportAuthError, match="bad MAC"):
        sender.open([frames[0], frames[1][:-1] + b"\x01"])  # tampered
    with pytest.raises(TransportAuthError, match="bad MAC"):
        wire.Sealer(os.urandom(32), role="sender").open(frames)  # wrong secret
    with pytest.raises(TransportAuthError, match="malformed"):
        sender.open([frames[1]])
    assert secret.hex() not in repr(sender)


def test_restricted_unpickler_refuses_code_even_when_authenticated(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(helpers._CreatesFile(str(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        restricted_loads(crafted)
    import_os = pickle.dumps(os.system)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        restricted_loads(import_os)
    assert not marker.exists()
    handle_like = (torch.Tensor, torch.Size([4]), (1,), 0, torch.uint8, b"\x00" * 64, 4, True)
    assert restricted_loads(pickle.dumps(handle_like)) == handle_like
