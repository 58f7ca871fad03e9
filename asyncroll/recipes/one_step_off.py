"""One-step-off-policy recipe: the rollout of batch k+1 overlaps training on batch k.

The overlapping rollout is a task of a ``TaskGroup`` owned by the recipe: if the trainer, a push
or a rollout fails, or the caller cancels, the rollout in flight is cancelled (the manager
aborts its requests) before the recipe returns; nothing is left running.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from asyncroll.manager import AsyncServerManager
from asyncroll.recipes.protocols import (
    RolloutSource,
    Trainer,
    policy_client,
    policy_version,
    push_policy,
    train_step,
)
from asyncroll.recipes.report import StepRecord
from asyncroll.recipes.rollout import Batch, generate_batch
from asyncroll.recipes.sources import as_rollout_source
from asyncroll.recipes.task import BandTask

__all__ = ["run_one_step_off"]


async def run_one_step_off(
    manager: AsyncServerManager,
    trainer: Trainer,
    source: RolloutSource | BandTask,
    *,
    steps: int,
    batch_groups: int = 4,
    group_size: int = 8,
    seed: int = 0,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> list[StepRecord]:
    """Train for ``steps`` steps; each batch was rolled out by the weights one step old.

    Args: as ``run_fully_async``'s (``seed`` seeds one ``random.Random`` for every prompt).

    Raises:
        ExceptionGroup: a rollout, the trainer or a push failed (the ``TaskGroup``'s errors).
    """
    rng = random.Random(seed)
    source = as_rollout_source(source)

    async def rollout(k: int) -> Batch:
        return await generate_batch(
            client, source, rng, first_group=k * batch_groups, groups=batch_groups,
            group_size=group_size,
        )

    base = policy_version(manager, trainer)  # versions continue from the engines' current one
    client = await policy_client(manager, trainer, global_steps=base)
    records = []
    last = time.perf_counter()
    async with asyncio.TaskGroup() as tasks:
        pending = tasks.create_task(rollout(0))
        for step in range(steps):
            batch = await pending
            if step + 1 < steps:  # start the next rollout before training on this one
                pending = tasks.create_task(rollout(step + 1))
            began = time.perf_counter()
            metrics = await train_step(trainer, batch.samples)
            metrics_seconds = time.perf_counter() - began
            report = await push_policy(manager, trainer, global_steps=base + step + 1)
            now = time.perf_counter()
            record = StepRecord.of(
                step, batch, metrics, report, trainer_version=base + step,
                wall_seconds=now - last, train_seconds=metrics_seconds,
            )
            last = now
            records.append(record)
            on_step(record)
    return records
