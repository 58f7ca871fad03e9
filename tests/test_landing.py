"""A full-weight push landed on a thread of its own (``asyncroll.receive.landing``), without
vLLM: a real sender and receiver over shared memory, in one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from asyncroll.errors import WeightSyncError
from asyncroll.fingerprints import fingerprints
from asyncroll.receive.landing import WeightLanding
from asyncroll.transport import ShmBackend, WeightReceiver, WeightSender, open_weight_sender
from asyncroll.transport.piece import Piece

KB = 1 << 10


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A few tensors, one larger than a bucket (it travels in pieces, reassembled)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 96, generator=generator),  # 24 KiB: spans buckets
        "q": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
        "norm": torch.randn(16, generator=generator),
    }


@pytest.fixture
async def landed() -> AsyncIterator[tuple[WeightSender, WeightLanding, list[int]]]:
    prepared: list[int] = []
    async with open_weight_sender(
        backend=ShmBackend(), bucket_bytes=16 * KB, receivers=1, ack_timeout=30
    ) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="r0", timeout=30)
        await asyncio.gather(asyncio.to_thread(receiver.connect), sender.wait_receivers(1))
        landing = WeightLanding(receiver, torch.device("cpu"),
                                prepare=lambda: prepared.append(1))
        try:
            yield sender, landing, prepared
        finally:
            await asyncio.to_thread(landing.close)


async def test_a_push_lands_checked_and_replays_as_one_persistent_batch(
    landed: tuple[WeightSender, WeightLanding, list[int]],
) -> None:
    """The push returns once the landing checked it against the fingerprints (its verdict)
    and prepared; its replay hands every tensor, equal to the pushed one, in one batch that
    is the whole push and whose sources persist. A second push of other values lands in the
    same memory, under the same layout."""
    sender, landing, prepared = landed
    layouts, addresses = [], []
    for seed in (1, 2):
        tensors = weights(seed)
        push = sender.next_push
        await sender.push(tensors, version=seed, fingerprints=fingerprints(tensors),
                          verdicts=True)
        assert prepared == [1] * seed
        landed_push = landing.take(push)
        assert landed_push is not None and landing.take(push) is None  # taken once
        batches: list[list[tuple[str, torch.Tensor]]] = []
        report = landed_push.replay(batches.append)
        assert report.version == seed and set(report.fingerprints) == set(tensors)
        (batch,) = batches
        assert batch.whole_push and batch.sources_persist  # type: ignore[attr-defined]
        got = dict(batch)
        assert got.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(got[name], tensor), name
        layouts.append(landed_push.layout)
        addresses.append({name: t.data_ptr() for name, t in batch})
    assert layouts[0] is layouts[1] and addresses[0] == addresses[1]
    assert landing.arena_bytes == sum(t.numel() * t.element_size() for t in weights(0).values())


async def test_a_tensor_that_differs_from_its_fingerprint_is_refused_and_the_next_lands(
    landed: tuple[WeightSender, WeightLanding, list[int]],
) -> None:
    sender, landing, prepared = landed
    tensors = weights(3)
    prints = fingerprints(tensors)
    prints["q"] = bytes(len(prints["q"]))
    push = sender.next_push
    with pytest.raises(WeightSyncError, match=r"differ from what was pushed.*'q'"):
        await sender.push(tensors, version=1, fingerprints=prints, verdicts=True)
    assert landing.take(push) is None and prepared == []  # nothing to commit, no backup
    del prints["q"]
    with pytest.raises(WeightSyncError, match=r"without a fingerprint.*'q'"):
        await sender.push(tensors, version=2, fingerprints=prints, verdicts=True)
    push = sender.next_push
    await sender.push(tensors, version=3, fingerprints=fingerprints(tensors), verdicts=True)
    landed_push = landing.take(push)
    assert landed_push is not None and landed_push.report.version == 3
    assert (landing.landed, landing.failed) == (1, 2)


async def test_pieces_of_tensors_do_not_land(
    landed: tuple[WeightSender, WeightLanding, list[int]],
) -> None:
    """A sharded trainer's pieces would need a load plan to place them: a landing refuses
    them, naming one, and lands nothing."""
    sender, landing, _ = landed
    whole = torch.randn(8, 4)
    push = sender.next_push
    with pytest.raises(WeightSyncError, match="pieces of tensors"):
        await sender.push({"w": Piece(whole[:4].contiguous(), whole=(8, 4), offset=0)}, version=1,
                          verdicts=True)
    assert landing.take(push) is None


def test_the_switch_interval_is_short_while_any_push_lands_and_restored_after() -> None:
    """``eager_switches``: overlapping landings (two threads) keep the short interval until
    the last one ends; then the interval before them is back."""
    import sys
    import threading

    from asyncroll.receive.landing import SWITCH_SECONDS, eager_switches

    before = sys.getswitchinterval()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with eager_switches():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(30)
        with eager_switches():
            assert sys.getswitchinterval() <= SWITCH_SECONDS
        assert sys.getswitchinterval() <= SWITCH_SECONDS  # the other still lands
    finally:
        release.set()
        thread.join(30)
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "soon"])
def test_a_switch_interval_that_is_not_a_positive_number_falls_back(text: str) -> None:
    from asyncroll.receive.landing import _switch_seconds

    assert _switch_seconds(text) == 0.0005
    assert _switch_seconds("0.002") == 0.002 and _switch_seconds(None) == 0.0005


def test_a_landing_thread_on_the_host_runs_its_openmp_regions_alone() -> None:
    """``one_openmp_thread``: the calling thread's OpenMP regions get one thread, and every
    other thread keeps its own (torch's own setting would have shrunk the main thread's MKL
    pool too). A second thread running parallel ops beside an engine cost the engine's step
    loop 15-18% on the 2-core machine (a torch loop: 0.82 and 0.85 of its rate with such a
    thread open, 0.97 with this, 0.98 with a thread that ran no op; 12 pairs each)."""
    import ctypes
    import threading

    from asyncroll.transport.openmp import one_openmp_thread

    try:
        max_threads = ctypes.CDLL(None).omp_get_max_threads
    except AttributeError:
        pytest.skip("no OpenMP runtime in this process")
    main_before, torch_before = max_threads(), torch.get_num_threads()
    seen: list[tuple[bool, int]] = []

    def landing() -> None:
        found = one_openmp_thread()
        torch.ones(1 << 16).add_(1)  # a parallel op, run here alone
        seen.append((found, max_threads()))

    thread = threading.Thread(target=landing)
    thread.start()
    thread.join(30)
    assert seen == [(True, 1)]
    assert max_threads() == main_before and torch.get_num_threads() == torch_before


def test_the_senders_packing_thread_runs_its_openmp_regions_alone() -> None:
    """The sender's packer (``Staging.packer``) copies on the host single-threaded: a team
    of its own would slow the trainer's threads (``one_openmp_thread``)."""
    import ctypes
    import uuid

    from asyncroll.transport.backends import ShmBackend
    from asyncroll.transport.staging import Staging

    try:
        max_threads = ctypes.CDLL(None).omp_get_max_threads
    except AttributeError:
        pytest.skip("no OpenMP runtime in this process")
    staging = Staging(ShmBackend(), nonce=uuid.uuid4().hex[:8], count=1, bucket_bytes=1 << 16,
                      group_of=lambda name: None, close_timeout=5.0)
    try:
        assert staging.packer.submit(max_threads).result(30) == 1
    finally:
        staging.release()
