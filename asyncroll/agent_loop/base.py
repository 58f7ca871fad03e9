"""The ``AgentLoop`` base class: one instance writes one trajectory through the server manager.

Invariants:
- Every turn of a trajectory is sent with the loop's ``session_key``, so the manager keeps the
  conversation on one engine (its prefix cache holds the earlier turns) while that engine is not
  much busier than the others.
- Request ids are ``{session_key}/{turn}``: unique per turn, readable in engine logs.
- The loop's counters (turns, times, interruptions, tool errors) only grow; ``statistics()`` is a
  snapshot of them and ``finish()`` puts that snapshot into the output.
- Nothing runs outside the caller's task except a turn's concurrent tool calls, which
  ``call_tools`` awaits in a ``TaskGroup``.
"""

from __future__ import annotations

import abc
import itertools
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from asyncroll.agent_loop.output import (
    AgentLoopMetrics,
    AgentLoopOutput,
    ResponseBuilder,
    StopReason,
)
from asyncroll.agent_loop.tools import MalformedToolCall, Tool, ToolCall, ToolResult, call_tools
from asyncroll.types import TokenOutput

__all__ = ["AgentLoop", "ServerManager"]

SampleT = TypeVar("SampleT")


class ServerManager(Protocol):
    """What an agent loop needs of ``AsyncServerManager``."""

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        session_key: str | None = None,
    ) -> TokenOutput: ...


class AgentLoop(abc.ABC, Generic[SampleT]):
    """Subclass it and write ``run``; make one instance per trajectory.

    ```python
    class Answer(AgentLoop[Sample]):
        async def run(self, sample: Sample) -> AgentLoopOutput:
            response = ResponseBuilder(budget=64)
            response.add_model(await self.generate(sample.prompt_ids, {"max_tokens": 64}))
            return self.finish(sample.prompt_ids, response, stop_reason="stop")
    ```
    """

    def __init__(self, manager: ServerManager, *, session_key: str | None = None) -> None:
        """Args:
            manager: Where turns are generated (an ``AsyncServerManager``).
            session_key: Keeps the trajectory's turns on one engine; a fresh one by default.
        """
        self.manager = manager
        self.session_key = session_key if session_key is not None else uuid.uuid4().hex
        self._num_turns = 0
        self._generate_time = 0.0
        self._tool_time = 0.0
        self._num_interrupted = 0
        self._num_cached = 0
        self._num_tool_calls = 0
        self._num_tool_errors = 0

    @abc.abstractmethod
    async def run(self, sample: SampleT) -> AgentLoopOutput:
        """Write the sample's trajectory."""

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} session={self.session_key} turns={self._num_turns} "
            f"tool_calls={self._num_tool_calls}>"
        )

    @property
    def num_turns(self) -> int:
        """Model turns (generate calls) so far."""
        return self._num_turns

    def statistics(self) -> AgentLoopMetrics:
        return AgentLoopMetrics(
            generate_time_s=self._generate_time,
            tool_time_s=self._tool_time,
            num_interrupted=self._num_interrupted,
            num_tool_calls=self._num_tool_calls,
            num_tool_errors=self._num_tool_errors,
            num_cached_tokens=self._num_cached,
        )

    async def generate(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None
    ) -> TokenOutput:
        """Generate one model turn through the manager, in this trajectory's session.

        Raises:
            InvalidRequestError: bad prompt or sampling arguments (e.g. beyond the context).
            NoEngineAvailableError: every engine is dead.
        """
        request_id = f"{self.session_key}/{self._num_turns}"
        self._num_turns += 1
        started = time.perf_counter()
        try:
            output = await self.manager.generate(
                request_id,
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                session_key=self.session_key,
            )
        finally:
            self._generate_time += time.perf_counter() - started
        self._num_interrupted += _interruptions(output)
        self._num_cached += output.num_cached_tokens
        return output

    async def call_tools(
        self,
        calls: Sequence[ToolCall | MalformedToolCall],
        *,
        tools: Mapping[str, Tool],
        call_timeout: float | None,
    ) -> list[ToolResult]:
        """Run one turn's calls concurrently; failures come back as error results.

        Args:
            calls: The turn's parsed calls.
            tools: The tools by name.
            call_timeout: Seconds each call may take; None for no limit.
        """
        started = time.perf_counter()
        try:
            results = await call_tools(tools, calls, call_timeout=call_timeout)
        finally:
            self._tool_time += time.perf_counter() - started
        self._num_tool_calls += len(results)
        self._num_tool_errors += sum(result.is_error for result in results)
        return results

    def finish(
        self,
        prompt_ids: Sequence[int],
        response: ResponseBuilder,
        *,
        stop_reason: StopReason,
    ) -> AgentLoopOutput:
        """The finished trajectory, with this loop's turn count and metrics."""
        return response.build(
            prompt_ids=prompt_ids,
            num_turns=self._num_turns,
            stop_reason=stop_reason,
            metrics=self.statistics(),
        )


def _interruptions(output: TokenOutput) -> int:
    """Weight updates that cut into one turn: resumes (``abort`` mode), or version changes
    inside the turn (``keep`` mode freezes the request, so the manager resumes nothing)."""
    steps = output.global_steps
    changes = sum(before != after for before, after in itertools.pairwise(steps))
    return max(output.num_preempted, changes)
