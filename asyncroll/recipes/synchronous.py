"""Synchronous recipe (the baseline): rollout, then train, then push.

``hybrid=True`` is the colocated pattern: the engines sleep while the trainer runs (on GPU this
frees their memory), wake their weights for the push, then their KV cache and scheduling.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from asyncroll.errors import InvalidRequestError
from asyncroll.interfaces import UpdatableEngine
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
from asyncroll.recipes.rollout import generate_batch
from asyncroll.recipes.sources import as_rollout_source
from asyncroll.recipes.task import BandTask

__all__ = ["run_synchronous"]


async def run_synchronous(
    manager: AsyncServerManager,
    trainer: Trainer,
    source: RolloutSource | BandTask,
    *,
    steps: int,
    batch_groups: int = 4,
    group_size: int = 8,
    seed: int = 0,
    hybrid: bool = False,
    on_step: Callable[[StepRecord], None] = lambda record: None,
) -> list[StepRecord]:
    """Rollout, then train, then push, ``steps`` times: every batch is on-policy.

    Args: as ``run_fully_async``'s (``seed`` seeds one ``random.Random`` for every prompt);
        ``hybrid`` sleeps every engine while the trainer runs.

    Raises:
        InvalidRequestError: ``hybrid`` with an engine that cannot sleep.
        ExceptionGroup: a rollout failed (the ``TaskGroup``'s errors).
    """
    rng = random.Random(seed)
    source = as_rollout_source(source)
    engines = [e for e in manager.engines if isinstance(e, UpdatableEngine)]
    if hybrid and len(engines) != len(manager.engines):
        raise InvalidRequestError("hybrid mode sleeps and wakes engines: every engine must "
                                  "be an UpdatableEngine")
    base = policy_version(manager, trainer)  # versions continue from the engines' current one
    client = await policy_client(manager, trainer, global_steps=base)
    records = []
    last = time.perf_counter()
    for step in range(steps):
        batch = await generate_batch(
            client, source, rng, first_group=step * batch_groups, groups=batch_groups,
            group_size=group_size,
        )
        if hybrid:
            await asyncio.gather(*(e.sleep(1) for e in engines))
        began = time.perf_counter()
        metrics = await train_step(trainer, batch.samples)
        metrics_seconds = time.perf_counter() - began
        if hybrid:
            await asyncio.gather(*(e.wake_up(["weights"]) for e in engines))
        report = await push_policy(manager, trainer, global_steps=base + step + 1)
        if hybrid:
            await asyncio.gather(*(e.wake_up(["kv_cache", "scheduling"]) for e in engines))
        now = time.perf_counter()
        record = StepRecord.of(
            step, batch, metrics, report, trainer_version=base + step,
            wall_seconds=now - last, train_seconds=metrics_seconds,
        )
        last = now
        records.append(record)
        on_step(record)
    return records
