"""A recipe ``RolloutSource`` whose rollouts are agents talking to the gateway.

A group is ``size`` sessions of one prompt, each driven by one call of your agent (any code that
speaks the OpenAI API to ``session.base_url``), run concurrently; a finished session becomes one
``TrainSample`` per trajectory (one, unless the session forked), all with the session's reward.

Invariants:
- Every session the source opens is finished, whether its agent returned, raised or was
  cancelled; an agent that raises loses its own sample only (counted as failed by the recipe).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from asyncroll.agent_loop import Sample, ServerManager
from asyncroll.gateway.chat import ChatRequestError
from asyncroll.gateway.server import Gateway, GatewaySession
from asyncroll.gateway.session import SessionResult
from asyncroll.trainer import TrainSample

__all__ = ["GatewaySource"]

logger = logging.getLogger(__name__)

Agent = Callable[[GatewaySession, Sample], Awaitable[float | None]]
"""Runs one episode against ``session.base_url``; may return the reward."""

Reward = Callable[[Sample, SessionResult], float]


class GatewaySource:
    """Rollouts written by an OpenAI-API agent through a ``Gateway``.

    ```python
    async def agent(session: GatewaySession, sample: Sample) -> float:
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key="-")
        reply = await client.chat.completions.create(model="policy", messages=[...])
        return score(reply)

    source = GatewaySource(gateway, agent, prompts=lambda rng: Sample(prompt_ids=(), data=...))
    await run_fully_async(manager, trainer, source, steps=100)
    ```
    """

    def __init__(
        self,
        gateway: Gateway,
        agent: Agent,
        *,
        prompts: Callable[[random.Random], Sample],
        reward: Reward | None = None,
    ) -> None:
        """Args:
            gateway: The serving gateway (its manager is the recipe's).
            agent: One episode; returns the reward unless ``reward`` is given.
            prompts: Draws a group's prompt from the recipe's seeded ``random.Random``.
            reward: Scores a finished session; overrides what the agent returned.
        """
        self.gateway = gateway
        self.agent = agent
        self.prompts = prompts
        self.reward = reward

    def __repr__(self) -> str:
        return f"<GatewaySource {self.gateway!r}>"

    def prompt(self, rng: random.Random) -> Sample:
        return self.prompts(rng)

    async def rollout(
        self, manager: ServerManager, prompt: Sample, *, group: int, size: int
    ) -> list[TrainSample]:
        """Raises:
            ExceptionGroup: every agent of the group failed (their errors).
        """
        async with asyncio.TaskGroup() as tasks:
            episodes = [tasks.create_task(self._episode(prompt)) for _ in range(size)]
        results = [task.result() for task in episodes]
        failures = [r for r in results if isinstance(r, Exception)]
        finished = [r for r in results if isinstance(r, SessionResult)]
        if failures and not finished:
            raise ExceptionGroup(f"every agent of group {group} failed", failures)
        if failures:
            logger.warning("group %d: %d of %d agents failed: %s", group, len(failures), size,
                           "; ".join(map(repr, failures)))
        return [
            TrainSample(
                group=group, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                log_probs=t.response_log_probs, global_steps=t.global_steps,
                reward=result.reward or 0.0, loss_mask=t.response_mask,
                num_preempted=t.metrics.num_interrupted,
            )
            for result in finished
            for t in result.trajectories
            if t.response_ids
        ]

    async def _episode(self, prompt: Sample) -> SessionResult | Exception:
        """One agent's session; any failure comes back as the exception (the group goes on)."""
        try:
            session = self.gateway.open_session(data={"sample": prompt.data})
        except ChatRequestError as exc:  # too many sessions open
            return exc
        returned: float | None = None
        error: Exception | None = None
        try:
            returned = await self.agent(session, prompt)
        except Exception as exc:
            error = exc
        finally:
            result = await asyncio.shield(self._finish(session.id))
        if error is not None or isinstance(result, Exception):
            return error or result
        reward = self.reward(prompt, result) if self.reward is not None else returned
        return SessionResult(session_id=result.session_id,
                             trajectories=tuple(t.with_reward(reward or 0.0)
                                                for t in result.trajectories),
                             num_forks=result.num_forks, reward=reward, data=result.data)

    async def _finish(self, session_id: str) -> SessionResult | Exception:
        try:
            return await self.gateway.finish_session(session_id)
        except ChatRequestError as exc:  # the agent finished it itself: its data is gone
            return exc
