"""Run an agent loop over many samples, a bounded number at a time.

Invariants:
- The result list has one entry per sample, in sample order: an ``AgentLoopOutput``, or an
  ``AgentLoopFailure`` carrying the sample's index and the exception its loop raised. One
  failing sample never loses the others.
- At most ``max_concurrency`` loops run at once: that many workers, owned by one ``TaskGroup``
  in the caller's task, pull sample indices in order; none outlives the call.
- A bad loop configuration raises before any sample runs (every loop is built up front).
- Cancelling the caller cancels every running loop (their requests are aborted by the manager,
  their tool calls cancelled) and re-raises; nothing is left running.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

from asyncroll.agent_loop.base import AgentLoop, ServerManager
from asyncroll.agent_loop.output import AgentLoopOutput
from asyncroll.agent_loop.registry import agent_loop_class
from asyncroll.errors import InvalidRequestError

__all__ = ["AgentLoopFailure", "run_agent_loops"]

logger = logging.getLogger(__name__)

SampleT = TypeVar("SampleT")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopFailure:
    """Stands in a failed sample's place in ``run_agent_loops``'s results."""

    index: int
    error: Exception


async def run_agent_loops(
    manager: ServerManager,
    samples: Sequence[SampleT],
    *,
    loop: str | Callable[..., AgentLoop[SampleT]],
    loop_kwargs: Mapping[str, Any] | None = None,
    max_concurrency: int = 64,
    progress: bool = True,
) -> list[AgentLoopOutput | AgentLoopFailure]:
    """Roll every sample out with a fresh loop; each trajectory is its own manager session.

    Failures come back in place rather than as a raised ``ExceptionGroup``: a training step
    wants the finished trajectories of a batch even if one sample broke, and decides itself
    whether to drop, retry or stop (``[r for r in results if isinstance(r, AgentLoopFailure)]``).

    Args:
        manager: Where turns are generated (an ``AsyncServerManager``).
        samples: The samples, in the order of the results.
        loop: A registered loop name, or a loop class (or factory) called as
            ``loop(manager, session_key=..., **loop_kwargs)``.
        loop_kwargs: The loop's configuration.
        max_concurrency: Most loops running at once.
        progress: Show a progress bar (tqdm, on stderr).

    Raises:
        InvalidRequestError: unknown loop name, bad ``max_concurrency``, or a loop
            configuration its class rejects.
    """
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int):
        raise InvalidRequestError(f"max_concurrency must be an int, not {max_concurrency!r}")
    if max_concurrency < 1:
        raise InvalidRequestError(
            f"max_concurrency must be a positive int, not {max_concurrency!r}"
        )
    factory = agent_loop_class(loop) if isinstance(loop, str) else loop
    run_id = uuid.uuid4().hex[:8]
    try:
        loops = [
            factory(manager, session_key=f"{run_id}-{index}", **(loop_kwargs or {}))
            for index in range(len(samples))
        ]
    except TypeError as exc:
        raise InvalidRequestError(f"bad agent loop configuration: {exc}") from exc
    results: list[AgentLoopOutput | AgentLoopFailure | None] = [None] * len(samples)
    indices = iter(range(len(samples)))
    with tqdm(total=len(samples), disable=not progress, desc="rollout", unit="sample") as bar:

        async def worker() -> None:
            for index in indices:  # shared by the workers: each sample is taken once
                results[index] = await _run_one(loops[index], samples[index], index)
                bar.update(1)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(max_concurrency, len(samples))):
                group.create_task(worker())
    finished = [result for result in results if result is not None]
    assert len(finished) == len(samples), "every sample resolves exactly once"
    return finished


async def _run_one(
    loop: AgentLoop[SampleT], sample: SampleT, index: int
) -> AgentLoopOutput | AgentLoopFailure:
    try:
        return await loop.run(sample)
    except Exception as exc:
        logger.warning("agent loop %r failed on sample %d: %r", loop, index, exc)
        return AgentLoopFailure(index=index, error=exc)
