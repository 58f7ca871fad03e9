"""``DistributedWeightPusher`` refuses bad input before any collective or pause (one process, a
world of one rank; the two-rank behaviour is in ``test_distributed.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncroll import DistributedWeightPusher, InvalidRequestError
from asyncroll.testing.fake_engine import FakeEngine


def test_without_torch_distributed_it_says_so() -> None:
    assert not dist.is_initialized()
    with pytest.raises(InvalidRequestError, match="init_process_group"):
        DistributedWeightPusher([FakeEngine(name="e")])


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_engines_belong_to_the_coordinator_only() -> None:
    with pytest.raises(InvalidRequestError, match="coordinator rank, and only there"):
        DistributedWeightPusher([])
    with pytest.raises(InvalidRequestError, match="not a rank of 1"):
        DistributedWeightPusher([FakeEngine(name="e")], coordinator=1)
    for buffers in (None, 0, True):  # on every rank, before any sender opens
        with pytest.raises(InvalidRequestError, match="buffers must be an int of at least 1"):
            DistributedWeightPusher([FakeEngine(name="e")], buffers=buffers)  # type: ignore[arg-type]


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
