"""``DistributedWeightPusher`` refuses bad input before any collective or pause (one process, a
world of one rank; the two-rank behaviour is in ``test_distributed.py``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncroll import DistributedWeightPusher, InvalidRequestError
from asyncroll.testing.fake_engine import FakeEngine


def test_without_torch_distributed_it_says_so() -> None:
    assert not dist.is_initialized()
    with pytest.raises(InvalidRequestError, match="init_process_group"):
        DistributedWeightPusher([FakeEngine(name="e")])


@pytest.mark.usefixtures("world_of_one")
def test_engines_belong_to_the_coordinator_only() -> None:
    with pytest.raises(InvalidRequestError, match="coordinator rank, and only there"):
        DistributedWeightPusher([])
    with pytest.raises(InvalidRequestError, match="not a rank of 1"):
        DistributedWeightPusher([FakeEngine(name="e")], coordinator=1)
    for buffers in (None, 0, True):  # on every rank, before any sender opens
        with pytest.raises(InvalidRequestError, match="buffers must be an int of at least 1"):
            DistributedWeightPusher([FakeEngine(name="e")], buffers=buffers)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="backend must be auto, shm, cuda_ipc or"):
        DistributedWeightPusher([FakeEngine(name="e")], backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="fan_in=True sends through push groups"):
        DistributedWeightPusher([FakeEngine(name="e")], fan_in=True)
    for bad in ("yes", 1, 0, None):
        with pytest.raises(InvalidRequestError, match="column_blocks must be True, False or"):
            DistributedWeightPusher([FakeEngine(name="e")], column_blocks=bad)  # type: ignore[arg-type]


def test_column_blocks_auto_exchanges_the_large_row_parallel_tensors() -> None:
    """``column_blocks="auto"`` (the default) exchanges a row-parallel tensor of at least
    32 MiB as column blocks and gathers a smaller one; True and False choose for every size.
    At the measured shapes (bf16): the 32B's o and down are exchanged (1.77x faster on four
    H200s), the 1.5B's and the 30B-A3B's (its o, its 3 MiB experts) gathered (faster there)."""
    from asyncroll.distributed import COLUMN_BLOCK_BYTES, _exchanges_columns

    def row_parallel(rows: int, columns: int) -> torch.Tensor:
        return torch.empty(rows, columns, dtype=torch.bfloat16, device="meta")

    assert COLUMN_BLOCK_BYTES == 32 << 20
    assert _exchanges_columns("auto", row_parallel(1024, 16384))  # 32 MiB exactly
    assert not _exchanges_columns("auto", row_parallel(1024, 16383))
    assert _exchanges_columns(True, row_parallel(8, 8))
    assert not _exchanges_columns(False, row_parallel(5120, 27648))
    shapes = {"32b o": (5120, 5120), "32b down": (5120, 27648), "7b down": (3584, 18944),
              "7b o": (3584, 3584), "1.5b down": (1536, 8960), "1.5b o": (1536, 1536),
              "30b-a3b o": (2048, 4096), "30b-a3b expert down": (2048, 768)}
    exchanged = {name for name, shape in shapes.items()
                 if _exchanges_columns("auto", row_parallel(*shape))}
    assert exchanged == {"32b o", "32b down", "7b down"}
    # By the bytes pushed: a float32 master pushed as bfloat16 counts as bfloat16.
    master = torch.empty(1536, 8960, dtype=torch.float32, device="meta")  # 1.5B down: 52.5 MiB
    assert _exchanges_columns("auto", master)
    assert not _exchanges_columns("auto", master, torch.bfloat16)


@pytest.mark.usefixtures("world_of_one")
def test_fan_in_refuses_what_it_cannot_send_as_each_ranks_own_rows() -> None:
    """Before anything pauses (the ranks agree on it): a sharded tensor that is not
    ``Shard(0)`` over every rank; a plain tensor is the coordinator's to send."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from asyncroll.distributed import _fan_in_refusal

    mesh = init_device_mesh("cpu", (1,))
    rows = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    assert _fan_in_refusal({"w": rows, "b": torch.ones(3)}, 1) is None
    refusal = _fan_in_refusal({"w": rows, "r": replicated}, 1)
    assert refusal is not None and "'r'" in refusal and "Shard(0) over all 1 ranks" in refusal


@pytest.mark.usefixtures("world_of_one")
async def test_bad_updates_are_refused_before_anything_runs() -> None:
    pusher = DistributedWeightPusher([FakeEngine(name="e")])
    weight = torch.zeros(4, 4)
    cases = [
        ([("w", weight), ("w", weight)], {}, "given twice"),
        ([("w", "not a tensor")], {}, "not a tensor"),
        ([], {}, "no tensors"),
        ([("w", weight)], {"changed": True}, "changed=True"),
        ([("w", weight)], {"global_steps": -1}, "global_steps"),
        ([("w", weight)], {"mode": "stale"}, "mode must be one of abort, keep, recompute"),
        ([("w", weight)], {"mode": "inflight"}, "not yet offered for a sharded push"),
    ]
    for tensors, options, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            await pusher.update(tensors, **{"global_steps": 1, **options})  # type: ignore[arg-type]
    await pusher.aclose()


def test_column_windows_only_where_every_rank_serves_workers_reading_the_same_columns() -> None:
    """The row-parallel exchange's choice (``_column_windows``): per rank the columns its
    workers read (worker ``i`` served by rank ``i % world``), or None to gather instead."""
    from asyncroll.distributed import _column_windows

    tp2 = [(0, 4032, 0, 32), (32, 4064, 32, 64)]  # (first, end, first column, end column)
    assert _column_windows(tp2, 2) == [(0, 32), (32, 64)]
    assert _column_windows(tp2 + tp2, 2) == [(0, 32), (32, 64)]  # two engines of TP=2
    assert _column_windows(tp2[:1], 2) is None  # rank 1 serves no worker
    assert _column_windows([tp2[0], tp2[0], tp2[1], tp2[1]], 2) is None  # a rank: two windows
    assert _column_windows([(0, 4096), (0, 4096)], 2) is None  # rows: not columns


@pytest.mark.usefixtures("world_of_one")
async def test_a_rank_whose_sender_fails_still_joins_every_collective_of_the_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank whose previous sender fails to close, or whose new one cannot open, joins the
    same collectives as the others (the configs, then the statuses) before it raises: a rank
    that skipped one would leave the others in it until the deadline, then mismatch the next
    (seen once in the two-rank tests: a 120 s stall, then a failed update)."""
    import asyncroll.distributed
    from asyncroll import WeightSyncError

    pusher = DistributedWeightPusher([FakeEngine(name="e")])
    gathered: list[object] = []
    real_gather = pusher._all_gather

    async def counted(value: object) -> list[object]:
        gathered.append(value)
        return await real_gather(value)

    async def close_fails() -> None:
        raise RuntimeError("the old sender's reader failed")

    old = contextlib.AsyncExitStack()
    old.push_async_callback(close_fails)

    def open_fails(**_: object) -> object:
        raise OSError("no shared memory left")

    monkeypatch.setattr(pusher, "_all_gather", counted)
    pusher._stack = old
    monkeypatch.setattr(asyncroll.distributed, "open_weight_sender", open_fails)
    with pytest.raises(WeightSyncError, match=r"could not attach to every rank.*no shared memory"):
        await pusher._connect([1])
    assert gathered == [None, "rank 0: OSError: no shared memory left"]


class _OneWorkerPort:
    """A weight port of one worker whose receiver is real (``WeightReceiver``): it connects to
    the sender it is attached to, and closes at a detach."""

    num_workers = 1

    def __init__(self) -> None:
        self.attached_to: object | None = None
        self.receiver: Any = None

    async def attach(self, config: dict[str, Any], *, owner: object) -> None:
        import asyncio

        from asyncroll.transport import WeightReceiver

        await self.detach()
        self.receiver = WeightReceiver.from_config(config, name="worker")
        await asyncio.to_thread(self.receiver.connect)
        self.attached_to = owner

    async def detach(self) -> None:
        self.attached_to = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class _OneWorkerEngine:
    name = "one-worker"
    is_dead = False

    def __init__(self) -> None:
        self.weights = _OneWorkerPort()


@pytest.mark.usefixtures("world_of_one")
async def test_a_connect_another_rank_failed_leaves_the_coordinator_to_connect_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another rank's sender could not open, while the coordinator's engines attached to its
    own and its channel adopted it: the connect raises on every rank, and the coordinator's
    channel lets the engines go, so the next update connects again (it once kept the adopted
    sender: the next updates pushed to it while the other ranks' workers were gone)."""
    from asyncroll import WeightSyncError

    engine = _OneWorkerEngine()
    pusher = DistributedWeightPusher([engine])  # type: ignore[list-item]
    real_gather = pusher._all_gather

    async def another_rank_failed(value: object) -> list[object]:
        found = await real_gather(value)
        return [*found, "rank 1: OSError: no shared memory left"] if value == "connected" else found

    monkeypatch.setattr(pusher, "_all_gather", another_rank_failed)
    assert pusher._needs_connect()
    with pytest.raises(WeightSyncError, match=r"could not attach to every rank: rank 1: OSError"):
        await pusher._connect([1])
    assert pusher._needs_connect()
    assert engine.weights.attached_to is None and engine.weights.receiver is None
    monkeypatch.setattr(pusher, "_all_gather", real_gather)
    await pusher._connect([1])  # and it does
    assert not pusher._needs_connect() and engine.weights.attached_to is pusher._pusher.channel
    await pusher.aclose()
    assert engine.weights.attached_to is None
