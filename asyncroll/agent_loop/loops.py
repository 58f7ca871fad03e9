"""The built-in loops: one model turn, and model turns interleaved with tool calls.

Invariants of ``ToolAgentLoop`` (the response budget is ``max_response_tokens``):
- Each turn's prompt is the sample's prompt followed by the response so far, token for token
  (nothing is re-tokenized): the engine's prefix cache holds the earlier turns, and the trained
  sequence is exactly the one the model saw.
- Model turns and tool results share the budget: each turn asks for at most the tokens left,
  and a turn's tool results are inserted only if at least one token is left after them for the
  model's next turn; otherwise they are dropped and the trajectory ends with ``"length"``. The
  response therefore never exceeds the budget, and never ends with tool tokens.
- Tool tokens have mask 0 and carry the ``global_steps`` of the turn that made the calls. A
  weight update that lands while a tool runs touches no engine request; the next turn is
  dispatched after it and carries the new version.
- A tool that raises or times out, an unknown tool and a malformed call each become an error
  result the model reads in its next turn; the rollout goes on.
- The caller's ``sampling_params`` are never mutated; ``max_tokens`` is the loop's to set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncroll.agent_loop.base import AgentLoop, ServerManager
from asyncroll.agent_loop.output import AgentLoopOutput, ResponseBuilder, Sample, StopReason
from asyncroll.agent_loop.registry import register_agent_loop
from asyncroll.agent_loop.tools import Tool, ToolCallParser
from asyncroll.errors import InvalidRequestError
from asyncroll.types import TokenOutput

__all__ = ["SingleTurnAgentLoop", "ToolAgentLoop"]


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop[Sample]):
    """One model turn: the response is the model's output, all mask 1."""

    def __init__(
        self,
        manager: ServerManager,
        *,
        session_key: str | None = None,
        max_response_tokens: int,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
            max_response_tokens: The response budget (the turn's ``max_tokens``).
            sampling_params: vLLM sampling arguments other than ``max_tokens``.
        """
        super().__init__(manager, session_key=session_key)
        self.max_response_tokens = max_response_tokens
        self.sampling_params = _checked_params(sampling_params)
        ResponseBuilder(budget=max_response_tokens)  # validates the budget now

    async def run(self, sample: Sample) -> AgentLoopOutput:
        response = ResponseBuilder(budget=self.max_response_tokens)
        output = await self.generate(
            sample.prompt_ids, {**self.sampling_params, "max_tokens": response.remaining}
        )
        response.add_model(output)
        return self.finish(sample.prompt_ids, response, stop_reason=output.finish_reason)


@register_agent_loop("tool")
class ToolAgentLoop(AgentLoop[Sample]):
    """Model turns and tool calls until the model stops calling, or a limit ends it."""

    def __init__(
        self,
        manager: ServerManager,
        *,
        session_key: str | None = None,
        tools: Mapping[str, Tool],
        parser: ToolCallParser,
        max_response_tokens: int,
        max_turns: int = 8,
        tool_timeout: float | None = 60.0,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
            tools: The tools by name.
            parser: Reads calls out of a turn and encodes results.
            max_response_tokens: The response budget, model and tool tokens together; prompt
                + budget must fit the engines' context (the first turn is refused otherwise).
            max_turns: Most model turns; a call made in the last one is not run.
            tool_timeout: Seconds each tool call may take (None: no limit).
            sampling_params: vLLM sampling arguments other than ``max_tokens``; the parser's
                stop tokens are added to ``stop_token_ids``.
        """
        super().__init__(manager, session_key=session_key)
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise InvalidRequestError(f"max_turns must be a positive int, not {max_turns!r}")
        if tool_timeout is not None and not tool_timeout > 0:
            raise InvalidRequestError(f"tool_timeout must be positive, not {tool_timeout!r}")
        ResponseBuilder(budget=max_response_tokens)  # validates the budget now
        self.tools = dict(tools)
        self.parser = parser
        self.max_response_tokens = max_response_tokens
        self.max_turns = max_turns
        self.tool_timeout = tool_timeout
        self.sampling_params = _checked_params(sampling_params)

    def turn_sampling_params(self, turn: int) -> dict[str, Any]:
        """Sampling arguments of model turn ``turn`` (from 0), before the loop adds
        ``max_tokens`` and the parser's stop tokens. Override to vary them by turn."""
        return dict(self.sampling_params)

    async def run(self, sample: Sample) -> AgentLoopOutput:
        prompt = list(sample.prompt_ids)
        response = ResponseBuilder(budget=self.max_response_tokens)
        for turn in range(self.max_turns):
            output = await self.generate(
                prompt + response.token_ids, self._params(turn, response.remaining)
            )
            response.add_model(output)
            calls = self.parser.parse(output.token_ids)
            stop = self._stop_reason(output, made_calls=bool(calls), response=response, turn=turn)
            if stop is not None:
                return self.finish(prompt, response, stop_reason=stop)
            results = await self.call_tools(calls, tools=self.tools, call_timeout=self.tool_timeout)
            inserted = self.parser.encode_results(results)
            if len(inserted) >= response.remaining:
                return self.finish(prompt, response, stop_reason="length")
            response.add_environment(inserted)
        raise AssertionError("unreachable: the last turn always stops")

    def _params(self, turn: int, remaining: int) -> dict[str, Any]:
        params = self.turn_sampling_params(turn)
        stops = {*(params.get("stop_token_ids") or ()), *self.parser.stop_token_ids}
        if stops:
            params["stop_token_ids"] = sorted(stops)
        params["max_tokens"] = remaining
        return params

    def _stop_reason(
        self, output: TokenOutput, *, made_calls: bool, response: ResponseBuilder, turn: int
    ) -> StopReason | None:
        """Why the trajectory ends after this turn, or None if its calls are to be run."""
        if output.finish_reason != "stop":
            return output.finish_reason
        if not made_calls:
            return "stop"
        if turn + 1 == self.max_turns:
            return "max_turns"
        if response.remaining == 0:
            return "length"
        return None


def _checked_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    resolved = dict(params or {})
    if "max_tokens" in resolved:
        raise InvalidRequestError(
            "sampling_params may not set max_tokens: the loop's max_response_tokens is the "
            "budget of the whole response"
        )
    return resolved
