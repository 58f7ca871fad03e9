"""Tool calls: what a parser finds in a turn, how a call runs, what goes back to the model.

Invariants:
- ``call_tool`` never raises an ``Exception``: a tool that raises, outlives its timeout, is
  unknown, or was called malformed becomes a ``ToolResult`` with ``is_error=True`` whose content
  says why. Cancellation (``CancelledError``) is never swallowed.
- ``call_tools`` returns one result per call, in call order; concurrent calls of one turn run in
  a ``TaskGroup`` owned by the caller's task, so none outlives the turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "MalformedToolCall",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "call_tool",
    "call_tools",
]

logger = logging.getLogger(__name__)

Tool = Callable[..., Awaitable[Any]]
"""An async callable, called with the call's arguments as keywords. A ``str`` result goes back
to the model as is; anything else as JSON."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A well-formed call the model made."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class MalformedToolCall:
    """Something the model meant as a call that the parser could not read."""

    reason: str
    raw: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """What a call returned, as text for the model; ``is_error`` if it did not succeed."""

    name: str
    content: str
    is_error: bool = False


class ToolCallParser(Protocol):
    """Reads calls out of a turn's tokens and turns results into tokens for the next turn."""

    @property
    def stop_token_ids(self) -> Sequence[int]:
        """Tokens that end a turn once a call is complete (added to every turn's stop set)."""
        ...

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall | MalformedToolCall]:
        """The calls in one turn's output, in order; empty if the turn made none."""
        ...

    def encode_results(self, results: Sequence[ToolResult]) -> list[int]:
        """The tokens inserted after a turn to report its calls' results."""
        ...


async def call_tool(
    tools: Mapping[str, Tool], call: ToolCall | MalformedToolCall, *, call_timeout: float | None
) -> ToolResult:
    """Run one call; any failure becomes an error result (see the module invariants).

    Args:
        tools: The tools by name.
        call: The parsed call.
        call_timeout: Seconds the call may take; None for no limit.
    """
    if isinstance(call, MalformedToolCall):
        return _error("", f"malformed tool call: {call.reason}")
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools))
        return _error(call.name, f"unknown tool {call.name!r} (tools: {known})")
    deadline = asyncio.timeout(call_timeout)
    try:
        async with deadline:
            value = await tool(**call.arguments)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and deadline.expired():
            return _error(call.name, f"tool {call.name!r} timed out after {call_timeout} s")
        logger.info("tool %r raised %r", call.name, exc)
        return _error(call.name, f"tool {call.name!r} raised {type(exc).__name__}: {exc}")
    return ToolResult(name=call.name, content=_as_text(value))


async def call_tools(
    tools: Mapping[str, Tool],
    calls: Sequence[ToolCall | MalformedToolCall],
    *,
    call_timeout: float | None,
) -> list[ToolResult]:
    """Run a turn's calls concurrently; results in call order."""
    if len(calls) == 1:
        return [await call_tool(tools, calls[0], call_timeout=call_timeout)]
    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(call_tool(tools, call, call_timeout=call_timeout)) for call in calls
        ]
    return [task.result() for task in tasks]


def _error(name: str, message: str) -> ToolResult:
    return ToolResult(name=name, content=f"error: {message}", is_error=True)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)
