"""Fully-async recipe: rollout never stops; the trainer consumes batches as they complete.

Staleness is bounded by the rollouter (``max_staleness`` versions); requests in flight at an
update are resumed by the manager. The loop is the algorithm; mechanism lives in the library.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncroll.manager import AsyncServerManager
from asyncroll.recipes.report import StepRecord
from asyncroll.recipes.rollout import open_rollouter
from asyncroll.recipes.task import BandTask
from asyncroll.trainer import ReferenceTrainer

__all__ = ["run_fully_async"]


async def run_fully_async(
    manager: AsyncServerManager,
    trainer: ReferenceTrainer,
    task: BandTask,
    *,
    steps: int,
    batch_groups: int = 4,
    group_size: int = 8,
    max_staleness: int = 2,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> list[StepRecord]:
    base = manager.global_steps or 0  # versions continue from the engines' current one
    records = []
    async with open_rollouter(
        manager, task, batch_groups=batch_groups, group_size=group_size,
        max_staleness=max_staleness, concurrency=batch_groups * 2,
    ) as rollouter:
        for step in range(steps):
            batch = await rollouter.next_batch()
            metrics = await asyncio.to_thread(trainer.step, batch.samples)
            weights = trainer.named_parameters()
            report = await manager.update_weights(weights, global_steps=base + step + 1)
            await rollouter.set_trainer_version(step + 1)
            record = StepRecord.of(step, batch, metrics, report, trainer_version=base + step)
            records.append(record)
            on_step(record)
    return records
