"""What the recipes and the manager count for a training run's report: each engine's busy
time, each step's wall and train time, and a table that reads ``-`` where a KL has no token."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from asyncroll import AsyncServerManager
from asyncroll.interfaces import UpdateReport
from asyncroll.recipes import Batch, StepRecord, format_table
from asyncroll.testing import FakeEngine
from asyncroll.trainer import TrainMetrics, TrainSample
from asyncroll.types import Segment


class _Watched(FakeEngine):
    """Reads the manager's busy time as each request arrives, and once more after a turn."""

    manager: AsyncServerManager
    seen: list[float]

    async def generate(self, request_id: str, **kwargs: Any) -> Segment:
        self.seen.append(self.manager.statistics().busy_seconds[self.name])
        await asyncio.sleep(0)
        self.seen.append(self.manager.statistics().busy_seconds[self.name])
        return await super().generate(request_id, **kwargs)


async def test_busy_seconds_grow_only_while_a_request_is_in_flight() -> None:
    engine = _Watched(name="a")
    async with AsyncServerManager([engine]) as manager:
        engine.manager, engine.seen = manager, []
        assert manager.statistics().busy_seconds == {"a": 0.0}
        await manager.generate("r1", prompt_ids=[5, 6], sampling_params={"max_tokens": 4})
        idle = manager.statistics().busy_seconds["a"]
        await asyncio.sleep(0)
        assert manager.statistics().busy_seconds["a"] == idle  # no spell open: nothing grows
        first, later = engine.seen
        assert 0.0 <= first < later < idle  # a spell open while the request ran, then closed
        await manager.generate("r2", prompt_ids=[5, 6], sampling_params={"max_tokens": 4})
        assert idle <= engine.seen[2] < engine.seen[3]  # the next spell adds to the time kept


def test_a_step_record_carries_its_times_and_the_table_reads_them() -> None:
    sample = TrainSample(group=0, prompt_ids=(1, 2), response_ids=(3, 4, 5),
                         log_probs=(-1.0,) * 3, global_steps=(0,) * 3, reward=1.0)
    report = UpdateReport(global_steps=2, engines=1, seconds=0.05, pause_seconds=0.01,
                          push_seconds=0.03, finish_seconds=0.005,
                          resume_seconds=0.005, push=None)
    metrics = TrainMetrics(loss=0.1, reward=1.0, mean_ratio=1.0, clipped_fraction=0.0)
    record = StepRecord.of(1, Batch(samples=[sample, sample]), metrics, report,
                           trainer_version=1, wall_seconds=2.0, train_seconds=0.5)
    assert (record.tokens, record.wall_seconds, record.train_seconds) == (6, 2.0, 0.5)
    assert record.pause_seconds == 0.01 and math.isnan(record.kl_k3_fresh)
    table = format_table([record])
    header, row = table.splitlines()
    assert "step s" in header and "tok/s" in header and "pause ms" in header
    assert "nan" not in row and row.split()[-1] == "-"  # no trainer log probs: no KL
    assert " 2.00 " in row and " 0.50 " in row and " 3 " in row  # wall, train, tokens/s
