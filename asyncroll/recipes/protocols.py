"""The two seams of every recipe: what it needs of a trainer, and of a rollout source.

A recipe drives any ``Trainer`` (``asyncroll.trainer.ReferenceTrainer`` is one) and any
``RolloutSource`` (``asyncroll.recipes.sources`` has two: a single-turn toy task, and any agent
loop). Invariants:
- A source draws a group's prompt synchronously (``prompt``), so the recipe fixes the order in
  which prompts come off its seeded ``random.Random`` before any rollout runs, however the
  rollouts interleave.
- ``Trainer.step`` blocks; recipes call it through ``train_step``, in a worker thread, and never
  return while it runs: a cancelled ``train_step`` lets the step finish (a thread cannot be
  stopped), then re-raises, so no step mutates the model behind the caller's back.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from asyncroll.agent_loop import Sample, ServerManager
from asyncroll.trainer import TrainMetrics, TrainSample

if TYPE_CHECKING:
    import torch

    from asyncroll.adapters import AdapterReport
    from asyncroll.interfaces import UpdateReport
    from asyncroll.manager import AsyncServerManager

__all__ = [
    "RolloutSource", "Trainer", "policy_client", "policy_version", "push_policy", "train_step",
]


class Trainer(Protocol):
    """What a recipe needs of a trainer."""

    def step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        """One optimiser step on a batch (blocking; recipes run it in a thread). Train only on
        tokens with ``loss_mask`` 1; the others are context."""
        ...

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights to push, as ``manager.update_weights`` takes them."""
        ...

    # A trainer of a LoRA adapter also has ``adapter`` ((name, AdapterConfig), or None) and
    # ``adapter_tensors()``: the recipes then push the adapter (``push_policy``) and roll out
    # under it (``policy_client``). Not in the Protocol: most trainers have neither.


class RolloutSource(Protocol):
    """Where a recipe's scored groups come from: one prompt, several rollouts of it."""

    def prompt(self, rng: random.Random) -> Sample:
        """A group's prompt, drawn from ``rng`` (seeded by the recipe)."""
        ...

    async def rollout(
        self, manager: ServerManager, prompt: Sample, *, group: int, size: int
    ) -> list[TrainSample]:
        """``size`` rollouts of ``prompt``, scored, each a ``TrainSample`` of ``group``.

        Returns fewer than ``size`` only where rollouts failed; the recipe counts each missing
        one as failed (``Batch.failed``). Raises if none could be made.
        """
        ...


async def train_step(trainer: Trainer, samples: Sequence[TrainSample]) -> TrainMetrics:
    """``trainer.step(samples)`` in a worker thread, so rollouts go on while it trains.

    Raises:
        CancelledError: once the step has finished (see the module invariants).
    """
    step = asyncio.create_task(asyncio.to_thread(trainer.step, samples))
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        await asyncio.wait([step])  # shield marks the step's own error as retrieved
        raise


async def push_policy(
    manager: AsyncServerManager, trainer: Trainer, *, global_steps: int
) -> UpdateReport | AdapterReport:
    """Push what ``trainer`` trains: its LoRA adapter (``manager.update_adapter``, no engine
    pauses) where it trains one, else its weights (``manager.update_weights``)."""
    adapter = getattr(trainer, "adapter", None)
    if adapter is None:
        return await manager.update_weights(trainer.named_parameters(), global_steps=global_steps)
    name, config = adapter
    tensors = trainer.adapter_tensors()  # type: ignore[attr-defined]
    return await manager.update_adapter(name, tensors, config=config, global_steps=global_steps)


async def policy_client(
    manager: AsyncServerManager, trainer: Trainer, *, global_steps: int
) -> ServerManager:
    """What rollouts call: the manager, or, where ``trainer`` trains a LoRA adapter, the
    manager's view that runs every call under it (``AsyncServerManager.with_adapter``), once
    the adapter's first revision (``global_steps``) is in the engines."""
    adapter = getattr(trainer, "adapter", None)
    if adapter is None:
        return manager
    await push_policy(manager, trainer, global_steps=global_steps)
    return manager.with_adapter(adapter[0])


def policy_version(manager: AsyncServerManager, trainer: Trainer) -> int:
    """The version a recipe's steps count on from: the engines' weights', or, where
    ``trainer`` trains an adapter, the newest of that and the adapter's last revision (a
    second run on the same manager goes on from there)."""
    base = manager.global_steps or 0
    adapter = getattr(trainer, "adapter", None)
    revision = manager.adapters.get(adapter[0]) if adapter is not None else None
    if revision is not None and revision.global_steps is not None:
        base = max(base, revision.global_steps)
    return base
