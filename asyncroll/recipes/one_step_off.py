"""One-step-off-policy recipe: the rollout of batch k+1 overlaps training on batch k."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from asyncroll.manager import AsyncServerManager
from asyncroll.recipes.report import StepRecord
from asyncroll.recipes.rollout import Batch, generate_batch
from asyncroll.recipes.task import BandTask
from asyncroll.trainer import ReferenceTrainer

__all__ = ["run_one_step_off"]


async def run_one_step_off(
    manager: AsyncServerManager,
    trainer: ReferenceTrainer,
    task: BandTask,
    *,
    steps: int,
    batch_groups: int = 4,
    group_size: int = 8,
    seed: int = 0,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> list[StepRecord]:
    rng = random.Random(seed)

    def rollout(k: int) -> asyncio.Future[Batch]:
        return asyncio.ensure_future(generate_batch(
            manager, task, rng, first_group=k * batch_groups, groups=batch_groups,
            group_size=group_size,
        ))

    base = manager.global_steps or 0  # versions continue from the engines' current one
    records = []
    pending = rollout(0)
    for step in range(steps):
        batch = await pending
        pending = rollout(step + 1)  # start the next rollout before training on this one
        try:
            metrics = await asyncio.to_thread(trainer.step, batch.samples)
            weights = trainer.named_parameters()
            report = await manager.update_weights(weights, global_steps=base + step + 1)
        except BaseException:
            pending.cancel()
            raise
        record = StepRecord.of(step, batch, metrics, report, trainer_version=base + step)
        records.append(record)
        on_step(record)
    pending.cancel()
    return records
