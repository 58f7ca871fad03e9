"""Fingerprints on the wire and on the GPU: they reach every receiver whole, whatever the
number of buckets (sent mid-push, after the middle bucket's signal); on a GPU one Triton kernel
reads every sample from a table of their addresses, exactly what ``torch.cat`` reads."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from asyncroll.fingerprints import SAMPLES, Fingerprinter, _joined, fingerprints
from asyncroll.transport import ShmBackend, WeightReceiver
from asyncroll.transport.sender import open_weight_sender

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_cuda_gather_kernel_reads_what_cat_reads(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [(300, 7), (5,), (64,), (1000, 33), (2, 3, 4)]
    tensors = {f"t{i}": (torch.randn(s, generator=g, device="cuda") * 50).to(dtype)
               for i, s in enumerate(sizes)}
    tensors["strided"] = (torch.randn(40, 50, device="cuda") * 50).to(dtype)[:, ::3]
    check = Fingerprinter()
    expected = check(tensors)  # through the kernel (one dtype, one device)
    prepared = check._last
    assert prepared is not None and prepared.table is not None  # the kernel ran
    plain = _joined(prepared.samples, dtype)
    assert b"".join(expected.values()) == plain
    assert all(len(f) <= SAMPLES * tensors[n].element_size() for n, f in expected.items())
    assert check.differing(tensors, expected) == []
    tensors["t3"][0, 0] += 1
    tensors["t1"].view(-1)[2] += 1  # a 5-element tensor: all sampled
    assert check.differing(tensors, expected) == ["t1", "t3"]


@needs_cuda
def test_cuda_tensors_on_two_devices_or_cpu_skip_the_kernel() -> None:
    mixed = {"gpu": torch.ones(100, device="cuda"), "cpu": torch.ones(100)}
    check = Fingerprinter()
    assert check(mixed)["gpu"] == check(mixed)["cpu"]
    assert check._last is not None and check._last.table is None


@needs_cuda
def test_cuda_an_early_read_sees_the_work_queued_before_it_not_after() -> None:
    """``read_early`` queues the read behind the copies already on the stream (a read that ran
    first would see zeros), and the next check of the same mapping uses it: it answers for
    the tensors as they were then, not for a change queued after it."""
    g = torch.Generator(device="cuda").manual_seed(1)
    sources = {"big": torch.randn(8192, 8192, generator=g, device="cuda").to(torch.bfloat16),
               "small": torch.randn(7, generator=g, device="cuda").to(torch.bfloat16)}
    expected = fingerprints(sources)
    targets = {name: torch.zeros_like(t) for name, t in sources.items()}
    check = Fingerprinter()
    assert check.differing(targets, expected) == ["big", "small"]  # zeros, and a table made
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the copies below start well after read_early returns
    for name, t in targets.items():
        t.copy_(sources[name])
    assert check.read_early(targets)
    targets["big"].view(-1)[0] += 1  # queued after the read: not in it
    assert check.differing(targets, expected) == [] and check.early_reads == 1
    assert check.differing(targets, expected) == ["big"]  # read again: sees the change
    assert check.early_reads == 1
    other = dict(targets)  # another mapping: its check does not use the early read
    assert check.read_early(targets)
    assert check.differing(other, expected) == ["big"] and check.early_reads == 1
    targets["big"].view(-1)[0] -= 1
    assert check.read_early(targets)  # reads the restored value ...
    targets["big"].view(-1)[0] += 1
    check.discard_early()  # ... but is discarded: the check reads afresh
    assert check.differing(targets, expected) == ["big"] and check.early_reads == 1


def test_an_early_read_where_the_kernel_does_not_apply_queues_nothing() -> None:
    tensors = {"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(3)}
    check = Fingerprinter()
    assert not check.read_early(tensors)
    expected = fingerprints(tensors)
    assert check.differing(tensors, expected) == [] and check.early_reads == 0
    tensors["a"][0] = -1
    assert check.differing(tensors, expected) == ["a"]


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096], ids=["one-bucket", "many-buckets"])
async def test_fingerprints_reach_the_receiver_whole_once_a_push(bucket_bytes: int) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(300 + 11 * i, generator=g).to(torch.bfloat16)
               for i in range(20)}
    prints = fingerprints(tensors)
    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=bucket_bytes,
                                  receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="prints")
        loaded: dict[str, torch.Tensor] = {}

        def serve() -> list[object]:
            receiver.connect()
            return [
                receiver.receive(lambda batch: loaded.update((n, t.clone()) for n, t in batch))
                for _ in range(3)
            ]

        worker = asyncio.ensure_future(asyncio.to_thread(serve))
        try:
            first = await sender.push(tensors, version=1, fingerprints=prints)
            changed = {**tensors, "w3": tensors["w3"] + 1}
            await sender.push(changed, version=2, fingerprints=fingerprints(changed))
            await sender.push(tensors, version=3)  # not fingerprinted
            reports = await worker
        finally:
            await asyncio.to_thread(receiver.close)
    assert (first.buckets == 1) is (bucket_bytes == 1 << 20) and first.buckets >= 1
    got = [r.fingerprints for r in reports]  # type: ignore[attr-defined]
    assert got[0] == prints
    assert got[1] == fingerprints(changed) and got[1]["w3"] != prints["w3"]
    assert got[2] == {}
    assert fingerprints(loaded) == prints  # what arrived is what was fingerprinted


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096], ids=["one-bucket", "many-buckets"])
async def test_prints_given_as_a_callable_are_taken_after_the_first_signal_and_arrive(
    bucket_bytes: int,
) -> None:
    # The sender calls them once its first buckets are signalled (their reads overlap the
    # receivers' copies); the receiver gets them as if given at once. A callable that
    # raises fails the push, the receiver told by its End, and the next push works.
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": torch.randn(300 + 11 * i, generator=g) for i in range(20)}
    prints = fingerprints(tensors)
    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=bucket_bytes,
                                  receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="later")
        arrived: list[int] = []

        def serve() -> list[object]:
            receiver.connect()
            out: list[object] = []
            for _ in range(3):
                try:
                    out.append(receiver.receive(lambda batch: arrived.append(len(batch))))
                except Exception as exc:  # the failing push's End
                    out.append(exc)
            return out

        seen: list[float] = []

        def later() -> dict[str, bytes]:
            seen.append(time.perf_counter())
            return prints

        def broken() -> dict[str, bytes]:
            raise RuntimeError("the prints broke")

        worker = asyncio.ensure_future(asyncio.to_thread(serve))
        try:
            report = await sender.push(tensors, version=1, fingerprints=later)
            assert len(seen) == 1 and report.timeline[0].copied <= seen[0]  # once, after
            with pytest.raises(RuntimeError, match="the prints broke"):
                await sender.push(tensors, version=2, fingerprints=broken)
            await sender.push(tensors, version=3, fingerprints=later)
            results = await worker
        finally:
            await asyncio.to_thread(receiver.close)
    assert results[0].fingerprints == prints  # type: ignore[attr-defined]
    assert isinstance(results[1], Exception) and "the prints broke" in str(results[1])
    assert results[2].fingerprints == prints  # type: ignore[attr-defined]
    assert len(seen) == 2
