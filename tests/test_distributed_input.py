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
