"""The broadcast transport (``asyncroll.transport.broadcast``) on its own: a sender here and
receivers in other processes, on gloo (CPU) and, where two GPUs and vLLM's NCCL communicator
exist, on NCCL (sender on GPU 0, receivers on GPU 1).

Every wait here is on an event (a process's message); the timeouts are hang guards, far above
what any run takes, never what a test measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import multiprocessing as mp
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncroll.errors import TransportBrokenError, WeightSyncError
from asyncroll.transport import LazyTensor, Piece
from asyncroll.transport.broadcast import BroadcastReceiver, layout, open_broadcast_sender

HANG_GUARD_S = 300.0
"""Bound on any wait for another process here: only a hang reaches it."""


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        try:
            import vllm.distributed.device_communicators.pynccl  # noqa: F401
        except ImportError:
            pass
        else:
            devices.append("cuda")
    return devices


def peers(device: str) -> int:
    """Receivers a test can have: NCCL takes one rank a GPU (the sender has GPU 0)."""
    return 2 if device == "cpu" else min(2, torch.cuda.device_count() - 1)


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _receiver(config: dict[str, Any], rank: int, device: str, conn: Any, behaviour: str) -> None:
    """A receiver process driven as an engine drives a worker: each ``receive`` command takes
    one push and reports its digests (or its error); ``close`` leaves the group."""
    if device == "cuda":
        torch.cuda.set_device(0)  # it sees its own GPU only
    where = torch.device("cuda:0" if device == "cuda" else "cpu")
    receiver = BroadcastReceiver.join(config, rank=rank, device=where)
    conn.send(("joined", rank))
    pushes = 0
    while conn.recv() == "receive":
        got: dict[str, str] = {}
        pushes += 1

        def load(
            batch: list[tuple[str, torch.Tensor]], push: int = pushes, got: dict[str, str] = got
        ) -> None:
            if behaviour == "die" and push == 2:
                os._exit(17)  # dies inside the second push, mid-transfer
            if behaviour == "fail" and push == 1:
                raise RuntimeError("this receiver's loader fails")
            for name, tensor in batch:
                got[name] = digest(tensor)
            for name, part in getattr(batch, "parts", {}).items():  # pieces: where they sit
                got[f"part:{name}"] = f"{part.offset} {part.whole} {part.columns}"

        def check(report: Any, push: int = pushes) -> None:
            if behaviour == "reject" and push == 1:
                raise WeightSyncError("this receiver's check of what it loaded fails")

        try:
            report = receiver.receive(load, after=check)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
            continue
        conn.send(("pushed", report.version, got))
    receiver.close()
    conn.send(("closed", rank))


def _tensors(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = {
        "embed": torch.randn(300, 64, generator=g),  # 76.8 kB: larger than a bucket
        "layer.0.w": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(7, generator=g),
        "layer.0.ids": torch.randint(0, 1000, (13,), generator=g),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(16, 24, generator=g).t(),  # not contiguous
        "layer.1.w": torch.randn(64, 64, generator=g).half(),
        "norm": torch.randn(64, generator=g).double(),
    }
    return {name: t.to(device) for name, t in base.items()}


class Receivers:
    def __init__(self, device: str, behaviours: list[str]) -> None:
        self.device = device
        self.behaviours = behaviours
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    async def join(self, config: dict[str, Any]) -> None:
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for rank, behaviour in enumerate(self.behaviours, start=1):
                if self.device == "cuda":
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
                ours, theirs = self.ctx.Pipe()
                proc = self.ctx.Process(target=_receiver, args=(
                    config, rank, self.device, theirs, behaviour), daemon=True)
                proc.start()
                self.procs.append(proc)
                self.conns.append(ours)
        finally:
            if self.device == "cuda":
                if old is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = old
        for conn in self.conns:
            assert (await self.next(conn))[0] == "joined"

    def receive(self) -> None:
        """Every live receiver takes the next push (an engine's ``receive`` RPC)."""
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                conn.send("receive")

    async def next(self, conn: Any) -> tuple[Any, ...]:
        ready = await asyncio.to_thread(conn.poll, HANG_GUARD_S)
        assert ready, "a receiver went silent (hang guard)"
        message: tuple[Any, ...] = conn.recv()
        return message

    async def stop(self) -> None:
        """Every live receiver leaves the group and exits."""
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                conn.send("close")
                assert (await self.next(conn))[0] == "closed"
            proc.join(HANG_GUARD_S)
            if proc.is_alive():
                proc.kill()
                raise AssertionError("a receiver did not exit")


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_layout_buckets_small_tensors_and_sends_large_ones_whole() -> None:
    tensors = _tensors("cpu", 0)
    transfers = layout(tensors, 4096)
    names = [e.name for t in transfers for e in t.entries]
    assert sorted(names) == sorted(tensors)  # every tensor once
    for transfer in transfers:
        if transfer.whole:
            assert len(transfer.entries) == 1 and transfer.nbytes > 4096
        else:
            assert transfer.nbytes <= 4096
            assert all(e.offset % 256 == 0 for e in transfer.entries)
    assert [t.entries[0].name for t in transfers if t.whole] == ["embed", "layer.1.w"]
    # In the given order (a bucket is sent before a larger tensor that follows it): a sharded
    # trainer makes its lazy tensors in that order.
    assert names == list(tensors)


def _lazy(tensor: torch.Tensor, made: list[str], name: str, fail: bool = False) -> LazyTensor:
    """``tensor`` as a ``LazyTensor`` whose make records its name in ``made`` (a failing one
    raises instead)."""

    def make() -> torch.Tensor:
        made.append(name)
        if fail:
            raise RuntimeError(f"{name} cannot be made")
        return tensor

    return LazyTensor(shape=tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device,
                      make=make)


@pytest.mark.process
async def test_lazy_tensors_and_pieces_arrive_made_in_plan_order() -> None:
    """A sharded trainer's push: lazy tensors (gathers) are made as their transfer is packed,
    in ``plan_buckets``'s order (the one every rank follows, whatever its transport), and a
    piece arrives as its own bytes with its place in the whole. A make that fails fails the
    push everywhere, and the rest are still made (the other ranks' gathers wait on them)."""
    receivers = Receivers("cpu", ["ok"])
    tensors = _tensors("cpu", 0)
    del tensors["strided"]  # (a piece's or a made tensor's bytes are contiguous)
    rows = tensors["layer.1.w"][16:32].contiguous()
    async with open_broadcast_sender(receivers=1, device=torch.device("cpu"),
                                     join=receivers.join, bucket_bytes=4096,
                                     peer_timeout=HANG_GUARD_S) as sender:
        for fail in (False, True):
            made: list[str] = []
            given: dict[str, Any] = {
                name: _lazy(t, made, name, fail=fail and name == "layer.0.b")
                if name in ("embed", "layer.0.b", "norm") else t
                for name, t in tensors.items()
            }
            given["layer.1.w"] = Piece(rows, whole=(64, 64), offset=16 * 64)
            receivers.receive()
            if fail:
                with pytest.raises(WeightSyncError, match=r"layer\.0\.b cannot be made"):
                    await sender.push(given, version=2)
                kind, name, _ = await receivers.next(receivers.conns[0])
                assert (kind, name) == ("error", "WeightSyncError")
                assert made == ["embed", "layer.0.b", "norm"]  # the rest made all the same
                continue
            await sender.push(given, version=1)
            assert made == ["embed", "layer.0.b", "norm"]
            kind, version, got = await receivers.next(receivers.conns[0])
            assert (kind, version) == ("pushed", 1)
            expected = {n: digest(t) for n, t in tensors.items() if n != "layer.1.w"}
            expected |= {"layer.1.w": digest(rows),
                         "part:layer.1.w": f"{16 * 64} (64, 64) None"}
            assert got == expected
        receivers.receive()  # the group went on
        await sender.push(tensors, version=3)
        assert (await receivers.next(receivers.conns[0]))[:2] == ("pushed", 3)
        await receivers.stop()


@pytest.mark.process
async def test_pushes_arrive_bitwise_in_every_receiver(device: str) -> None:
    receivers = Receivers(device, ["ok"] * peers(device))
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    async with open_broadcast_sender(receivers=peers(device), device=dev, join=receivers.join,
                                     bucket_bytes=4096, peer_timeout=HANG_GUARD_S) as sender:
        for version, seed in ((3, 0), (4, 1)):
            tensors = _tensors(str(dev), seed)
            receivers.receive()
            report = await sender.push(tensors, version=version)
            assert report.tensors == len(tensors) and report.receivers == peers(device)
            expected = {name: digest(t) for name, t in tensors.items()}
            for conn in receivers.conns:
                kind, got_version, got = await receivers.next(conn)
                assert (kind, got_version) == ("pushed", version)
                assert got == expected
        await receivers.stop()


@pytest.mark.process
async def test_a_sender_failing_mid_push_fails_every_receiver_and_the_group_goes_on(
    device: str,
) -> None:
    receivers = Receivers(device, ["ok"] * peers(device))
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    async with open_broadcast_sender(receivers=peers(device), device=dev, join=receivers.join,
                                     bucket_bytes=4096, peer_timeout=HANG_GUARD_S) as sender:
        tensors = _tensors(str(dev), 0)
        # A tensor with no data (meta) packs like any other until its copy fails.
        broken = {**tensors, "layer.0.b": torch.empty(7, device="meta")}
        receivers.receive()
        with pytest.raises(WeightSyncError, match=r"failed while packing.*meta"):
            await sender.push(broken, version=5)
        for conn in receivers.conns:
            kind, name, message = await receivers.next(conn)
            assert (kind, name) == ("error", "WeightSyncError")
            assert "failed in the sender" in message
        receivers.receive()
        report = await sender.push(tensors, version=6)  # the collectives stayed in step
        assert report.version == 6
        for conn in receivers.conns:
            kind, version, got = await receivers.next(conn)
            assert (kind, version) == ("pushed", 6)
            assert got == {name: digest(t) for name, t in tensors.items()}
        await receivers.stop()


@pytest.mark.parametrize("behaviour", ["fail", "reject"])
@pytest.mark.process
async def test_a_receiver_failing_its_part_fails_the_push_everywhere_and_the_group_goes_on(
    device: str, behaviour: str
) -> None:
    """A loader that raises, or a check of what was loaded (``after``) that fails: that
    receiver says why, every other rank learns from the push's verdict that the push failed
    (so every engine rolls back), and the next push lands everywhere."""
    receivers = Receivers(device, [behaviour, "ok"][: peers(device)])
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    async with open_broadcast_sender(receivers=peers(device), device=dev, join=receivers.join,
                                     bucket_bytes=4096, peer_timeout=HANG_GUARD_S) as sender:
        tensors = _tensors(str(dev), 0)
        receivers.receive()
        with pytest.raises(WeightSyncError, match=r"failed in 1 of \d receivers"):
            await sender.push(tensors, version=1)  # every collective completes
        failed, *ok = receivers.conns
        kind, name, message = await receivers.next(failed)
        why = "loader fails" if behaviour == "fail" else "check of what it loaded fails"
        assert (kind, name) == ("error", "WeightSyncError") and why in message
        for conn in ok:
            kind, name, message = await receivers.next(conn)
            assert (kind, name) == ("error", "WeightSyncError")
            assert "another rank of the push group failed it" in message
        receivers.receive()
        await sender.push(tensors, version=2)
        for conn in receivers.conns:
            assert (await receivers.next(conn))[:2] == ("pushed", 2)
        await receivers.stop()


@pytest.mark.process
async def test_a_receiver_dying_mid_push_fails_the_push_everywhere_and_nothing_hangs(
    device: str,
) -> None:
    receivers = Receivers(device, ["die", "ok"][: peers(device)])
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    # The deadline is what ends a collective a dead peer never joins (NCCL: its small push
    # may fit the dead peer's buffers, but the verdict needs it); gloo sees the connection
    # drop at once.
    deadline = 20.0 if device == "cuda" else HANG_GUARD_S
    async with open_broadcast_sender(receivers=peers(device), device=dev, join=receivers.join,
                                     bucket_bytes=4096, peer_timeout=deadline) as sender:
        tensors = _tensors(str(dev), 0)
        receivers.receive()
        await sender.push(tensors, version=1)
        for conn in receivers.conns:
            assert (await receivers.next(conn))[:2] == ("pushed", 1)
        receivers.receive()
        with pytest.raises(TransportBrokenError):
            await sender.push(tensors, version=2)
        assert sender.group.closed
        if len(receivers.conns) == 2:  # (with one GPU for receivers there is no survivor)
            # The survivor may have taken the whole push before the sender failed (gloo sends
            # to each peer in turn; the update then fails above it, and its engine rolls
            # back), or failed inside it; either way its next receive fails at once.
            survivor = receivers.conns[1]
            message = await receivers.next(survivor)
            if message[0] == "pushed":
                survivor.send("receive")
                message = await receivers.next(survivor)
            kind, name, _ = message
            assert kind == "error"
            assert name in ("TransportBrokenError", "TransportTimeoutError")
    receivers.procs[0].join(HANG_GUARD_S)
    assert receivers.procs[0].exitcode == 17
    await receivers.stop()


@pytest.mark.process
async def test_a_manifest_longer_than_the_control_message_follows_it() -> None:
    from asyncroll.transport.broadcast import CONTROL_BYTES

    receivers = Receivers("cpu", ["ok"])
    tensors = {f"model.layers.{i}.some_long_parameter_name.weight": torch.full((3,), float(i))
               for i in range(CONTROL_BYTES // 40)}
    async with open_broadcast_sender(receivers=1, device=torch.device("cpu"),
                                     join=receivers.join, bucket_bytes=1 << 20,
                                     peer_timeout=HANG_GUARD_S) as sender:
        receivers.receive()
        await sender.push(tensors, version=9)
        kind, version, got = await receivers.next(receivers.conns[0])
        assert (kind, version) == ("pushed", 9)
        assert got == {name: digest(t) for name, t in tensors.items()}
        await receivers.stop()


def _fan_in_receiver(configs: list[dict[str, Any]], conn: Any) -> None:
    """A worker in two push groups (``BroadcastReceivers``): each ``receive`` command takes
    one push from each group, in order, and reports the digests or the error."""
    from asyncroll.transport.broadcast import BroadcastReceivers

    receivers = BroadcastReceivers(
        [BroadcastReceiver.join(config, rank=1, device=torch.device("cpu")) for config in configs]
    )
    conn.send(("joined", 1))
    while conn.recv() == "receive":
        got: dict[str, str] = {}

        def load(batch: list[tuple[str, torch.Tensor]], got: dict[str, str] = got) -> None:
            got.update((name, digest(tensor)) for name, tensor in batch)

        try:
            report = receivers.receive(load, after=lambda report: None)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
            continue
        conn.send(("pushed", report.tensors, got))
    receivers.close()
    conn.send(("closed", 1))


@pytest.mark.process
async def test_a_worker_in_two_push_groups_takes_both_and_a_failure_in_one_fails_both() -> None:
    """``fan_in``'s worker: one push from each group, in order, as one; when the first group's
    push fails (its sender could not pack), the worker still takes the second (its sender's
    collectives complete) and fails it too, so both senders hear of the failure."""
    ctx = mp.get_context("spawn")
    configs: list[dict[str, Any] | None] = [None, None]
    formed = asyncio.Event()
    ours, theirs = ctx.Pipe()
    process: Any = None

    async def join(index: int, config: dict[str, Any]) -> None:
        nonlocal process
        configs[index] = config
        if all(configs):
            process = ctx.Process(target=_fan_in_receiver, args=(configs, theirs), daemon=True)
            process.start()
            formed.set()
        await formed.wait()

    halves = [{"w": torch.arange(8.0), "b": torch.ones(3)}, {"v": torch.arange(4.0)}]
    async with contextlib.AsyncExitStack() as stack:
        openings = [
            stack.enter_async_context(open_broadcast_sender(
                receivers=1, device=torch.device("cpu"), join=functools.partial(join, index),
                bucket_bytes=4096, peer_timeout=HANG_GUARD_S))
            for index in (0, 1)
        ]
        senders = list(await asyncio.gather(*openings))
        receiving = Receivers("cpu", [])
        assert (await receiving.next(ours))[0] == "joined"
        ours.send("receive")
        reports = await asyncio.gather(
            *(sender.push(half, version=1) for sender, half in zip(senders, halves, strict=True))
        )
        assert [r.tensors for r in reports] == [2, 1]
        kind, tensors, got = await receiving.next(ours)
        assert (kind, tensors) == ("pushed", 3)
        assert got == {n: digest(t) for half in halves for n, t in half.items()}
        ours.send("receive")
        broken = {**halves[0], "b": torch.empty(3, device="meta")}
        outcomes = await asyncio.gather(senders[0].push(broken, version=2),
                                        senders[1].push(halves[1], version=2),
                                        return_exceptions=True)
        assert all(isinstance(o, WeightSyncError) for o in outcomes), outcomes
        kind, name, message = await receiving.next(ours)
        assert (kind, name) == ("error", "WeightSyncError") and "failed in the sender" in message
        ours.send("close")
        assert (await receiving.next(ours))[0] == "closed"
    process.join(HANG_GUARD_S)
