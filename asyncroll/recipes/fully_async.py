"""Fully-async recipe: rollout never stops; the trainer consumes batches as they complete.

Staleness is bounded by the rollouter (``max_staleness`` versions); requests in flight at an
update are resumed by the manager. The loop is the algorithm; mechanism lives in the library.
"""

from __future__ import annotations

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
from asyncroll.recipes.rollout import open_rollouter
from asyncroll.recipes.task import BandTask

__all__ = ["run_fully_async"]


async def run_fully_async(
    manager: AsyncServerManager,
    trainer: Trainer,
    source: RolloutSource | BandTask,
    *,
    steps: int,
    batch_groups: int = 4,
    group_size: int = 8,
    max_staleness: int = 2,
    seed: int = 0,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> list[StepRecord]:
    """Train for ``steps`` steps while rollouts run ahead, at most ``max_staleness`` versions.

    Args:
        manager: Routes the rollouts; every step's weights are pushed through it.
        trainer: Trains on each batch (``ReferenceTrainer``, or any ``Trainer``).
        source: Makes the scored groups (``AgentLoopSource``, ``BandTaskSource``, a ``BandTask``).
        steps: Trainer steps, one weight push each.
        batch_groups: Groups (prompts) per batch.
        group_size: Rollouts per group.
        max_staleness: Most trainer versions a batch's oldest token may lag behind.
        seed: Seeds the prompts (group ``g`` draws from ``seed * 1_000_003 + g``).
        on_step: Called with each step's record.

    Raises:
        ExceptionGroup: a rollout, the trainer or a push failed; the rollouts are cancelled.
    """
    base = policy_version(manager, trainer)  # versions continue from the engines' current one
    client = await policy_client(manager, trainer, global_steps=base)
    records = []
    last = time.perf_counter()
    async with open_rollouter(
        client, source, batch_groups=batch_groups, group_size=group_size,
        max_staleness=max_staleness, concurrency=batch_groups * 2, seed=seed,
    ) as rollouter:
        for step in range(steps):
            batch = await rollouter.next_batch()
            began = time.perf_counter()
            metrics = await train_step(trainer, batch.samples)
            metrics_seconds = time.perf_counter() - began
            report = await push_policy(manager, trainer, global_steps=base + step + 1)
            await rollouter.set_trainer_version(step + 1)
            now = time.perf_counter()
            record = StepRecord.of(
                step, batch, metrics, report, trainer_version=base + step,
                wall_seconds=now - last, train_seconds=metrics_seconds,
            )
            last = now
            records.append(record)
            on_step(record)
    return records
