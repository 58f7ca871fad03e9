"""Rollout sources: where a recipe's scored groups come from.

- ``BandTaskSource``: one sampled turn per rollout through ``manager.generate`` (request ids
  ``g{group}-s{i}``), scored by a ``BandTask``: the recipes' original path, token for token.
- ``AgentLoopSource``: any agent loop (a registered name, or a class) through
  ``run_agent_loops``, each trajectory scored by a reward function; the loop's
  ``response_mask`` becomes the sample's ``loss_mask``, so the trainer learns only from the
  tokens the model sampled.

Invariants:
- A group's rollouts run in ``TaskGroup``s in the caller's task: if one raises, or the caller
  is cancelled, none is left running (the manager aborts their requests).
- A failed agent-loop rollout is never silently lost. It is logged (a warning, with its error)
  and left out of the group, and the recipe counts it (``Batch.failed``, ``StepRecord.failed``):
  a batch trains on the trajectories that finished. A group whose every rollout failed raises
  an ``ExceptionGroup`` of their errors: a broken loop, tool set-up or prompt stops the run
  instead of training on nothing. An error of the reward function is raised as is.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncroll.agent_loop import (
    AgentLoop,
    AgentLoopFailure,
    AgentLoopOutput,
    Sample,
    ServerManager,
    agent_loop_class,
    run_agent_loops,
)
from asyncroll.recipes.protocols import RolloutSource
from asyncroll.recipes.task import BandTask
from asyncroll.trainer import TrainSample
from asyncroll.types import TokenOutput

__all__ = ["AgentLoopSource", "BandTaskSource", "Reward", "as_rollout_source"]

logger = logging.getLogger(__name__)

Reward = Callable[[Sample, AgentLoopOutput], float]
"""Scores one trajectory: the prompt it answered (with its ``data``) and the loop's output."""


def as_rollout_source(source: RolloutSource | BandTask) -> RolloutSource:
    """A recipe's source: a ``BandTask`` (what recipes took before sources) is wrapped."""
    return BandTaskSource(source) if isinstance(source, BandTask) else source


@dataclass(frozen=True, slots=True)
class BandTaskSource:
    """Single-turn rollouts of a ``BandTask``'s prompts, scored by the task."""

    task: BandTask

    def prompt(self, rng: random.Random) -> Sample:
        return Sample(prompt_ids=tuple(self.task.prompt(rng)))

    async def rollout(
        self, manager: ServerManager, prompt: Sample, *, group: int, size: int
    ) -> list[TrainSample]:
        async with asyncio.TaskGroup() as tasks:
            turns = [
                tasks.create_task(manager.generate(
                    f"g{group}-s{i}", prompt_ids=prompt.prompt_ids,
                    sampling_params=self.task.sampling_params(),
                ))
                for i in range(size)
            ]
        return [self._scored(prompt, turn.result(), group) for turn in turns]

    def _scored(self, prompt: Sample, output: TokenOutput, group: int) -> TrainSample:
        return TrainSample(
            group=group,
            prompt_ids=prompt.prompt_ids,
            response_ids=output.token_ids,
            log_probs=output.log_probs,
            global_steps=output.global_steps,
            reward=self.task.reward(output.token_ids),
            num_preempted=output.num_preempted,
        )


class AgentLoopSource:
    """Rollouts written by an agent loop, scored by ``reward``.

    ```python
    source = AgentLoopSource(
        "tool", prompts=lambda rng: rng.choice(dataset), reward=lambda sample, out: ...,
        loop_kwargs={"tools": tools, "parser": parser, "max_response_tokens": 256},
    )
    await run_fully_async(manager, trainer, source, steps=100)
    ```
    """

    def __init__(
        self,
        loop: str | Callable[..., AgentLoop[Sample]],
        *,
        prompts: Callable[[random.Random], Sample],
        reward: Reward,
        loop_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
            loop: A registered loop name (``"single_turn"``, ``"tool"``, yours), or a loop
                class (or factory) called as ``loop(manager, session_key=..., **loop_kwargs)``.
            prompts: Draws a group's prompt from the recipe's seeded ``random.Random``.
            reward: Scores each finished trajectory (called in the event loop: keep it quick).
            loop_kwargs: The loop's configuration (tools, parser, budget, sampling params).

        Raises:
            InvalidRequestError: ``loop`` names no registered loop.
        """
        if isinstance(loop, str):
            agent_loop_class(loop)  # an unknown name fails here, not in the first rollout
        self.loop = loop
        self.prompts = prompts
        self.reward = reward
        self.loop_kwargs = dict(loop_kwargs or {})

    def __repr__(self) -> str:
        name = self.loop if isinstance(self.loop, str) else getattr(self.loop, "__name__", "?")
        return f"<AgentLoopSource loop={name}>"

    def prompt(self, rng: random.Random) -> Sample:
        return self.prompts(rng)

    async def rollout(
        self, manager: ServerManager, prompt: Sample, *, group: int, size: int
    ) -> list[TrainSample]:
        """Raises:
            ExceptionGroup: every rollout of the group failed (their errors).
        """
        results = await run_agent_loops(
            manager, [prompt] * size, loop=self.loop, loop_kwargs=self.loop_kwargs,
            max_concurrency=max(size, 1), progress=False,
        )
        outputs = [r for r in results if isinstance(r, AgentLoopOutput)]
        failures = [r.error for r in results if isinstance(r, AgentLoopFailure)]
        if failures and not outputs:
            raise ExceptionGroup(f"every rollout of group {group} failed", failures)
        if failures:
            logger.warning(
                "group %d: %d of %d rollouts failed and are left out of the batch: %s",
                group, len(failures), size, "; ".join(map(repr, failures)),
            )
        return [self._scored(prompt, output, group) for output in outputs]

    def _scored(self, prompt: Sample, output: AgentLoopOutput, group: int) -> TrainSample:
        return TrainSample(
            group=group,
            prompt_ids=output.prompt_ids,
            response_ids=output.response_ids,
            log_probs=output.response_log_probs,
            global_steps=output.global_steps,
            reward=self.reward(prompt, output),
            loss_mask=output.response_mask,
            num_preempted=output.metrics.num_interrupted,
        )
