"""What an agent loop consumes and produces: samples, the response builder, the output.

Invariants of every ``AgentLoopOutput`` (checked when one is made):
- ``response_ids``, ``response_mask``, ``response_log_probs`` and ``global_steps`` have one entry
  per response token.
- ``response_mask[i]`` is 1 for a token the model sampled, 0 for a token the loop inserted
  (tool results, environment feedback); a masked token's log prob is 0.0.
- A masked token carries the ``global_steps`` of the model turn it answers (the last model token
  before it), so ``global_steps`` never decreases along a response built by ``ResponseBuilder``.
- ``ResponseBuilder`` never holds more than its budget: model and inserted tokens both count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from asyncroll.errors import InvalidRequestError
from asyncroll.types import TokenOutput, version_range

__all__ = ["AgentLoopMetrics", "AgentLoopOutput", "ResponseBuilder", "Sample", "StopReason"]

StopReason = Literal["stop", "length", "max_turns", "abort"]
"""Why a trajectory ended: the model stopped without a tool call; the response budget (or the
context) ran out; the loop reached its turn limit; the manager returned an aborted turn (only
with ``partial_rollout=False``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One prompt to roll out, with whatever the loop or the reward needs (``data``)."""

    prompt_ids: tuple[int, ...]
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopMetrics:
    """What one trajectory cost. Times are wall-clock seconds in the loop's task."""

    generate_time_s: float
    """Time spent awaiting the manager (includes waiting at its gate during weight updates)."""
    tool_time_s: float
    num_interrupted: int
    """Weight updates that landed inside a model turn, summed over turns: per turn, the
    manager's ``num_preempted`` (``abort`` mode) or the version changes along its tokens
    (``keep`` mode), whichever is larger. Updates during tool calls interrupt nothing."""
    num_tool_calls: int
    num_tool_errors: int
    """Calls that raised, timed out, named no known tool or could not be parsed."""
    num_cached_tokens: int
    """Prompt tokens the engines served from their prefix cache, over all turns."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopOutput:
    """One finished trajectory: the prompt, the response and per-token training labels.

    ``reward`` is a slot for the reward function: ``output.with_reward(r)``.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_mask: tuple[int, ...]
    response_log_probs: tuple[float, ...]
    global_steps: tuple[int | None, ...]
    num_turns: int
    stop_reason: StopReason
    metrics: AgentLoopMetrics
    reward: float | None = None

    def __post_init__(self) -> None:
        lengths = {
            len(self.response_ids),
            len(self.response_mask),
            len(self.response_log_probs),
            len(self.global_steps),
        }
        if len(lengths) != 1:
            raise InvalidRequestError(
                "response_ids, response_mask, response_log_probs and global_steps must have "
                f"equal lengths, got {sorted(lengths)}"
            )
        for position, (bit, log_prob) in enumerate(
            zip(self.response_mask, self.response_log_probs, strict=True)
        ):
            if bit not in (0, 1) or (bit == 0 and log_prob != 0.0):
                raise InvalidRequestError(
                    f"position {position}: mask {bit!r} with log prob {log_prob!r}"
                )

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def min_global_steps(self) -> int | None:
        return version_range(self.global_steps)[0]

    @property
    def max_global_steps(self) -> int | None:
        return version_range(self.global_steps)[1]

    def with_reward(self, reward: float) -> AgentLoopOutput:
        return replace(self, reward=reward)


_LAST: Any = object()
"""Default of ``add_environment``'s ``global_steps``: the version of the last token."""


class ResponseBuilder:
    """Accumulates one trajectory's response, turn by turn, within a token budget.

    Owned by one loop in one task. ``add_model`` and ``add_environment`` raise
    ``InvalidRequestError`` (and add nothing) if the tokens would overrun the budget.
    """

    __slots__ = ("_global_steps", "_log_probs", "_mask", "_token_ids", "budget")

    def __init__(self, *, budget: int) -> None:
        """Args:
            budget: Most response tokens, model and inserted tokens together.
        """
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise InvalidRequestError(f"the response budget must be a positive int, not {budget!r}")
        self.budget = budget
        self._token_ids: list[int] = []
        self._mask: list[int] = []
        self._log_probs: list[float] = []
        self._global_steps: list[int | None] = []

    def __len__(self) -> int:
        return len(self._token_ids)

    def __repr__(self) -> str:
        return f"<ResponseBuilder {len(self)}/{self.budget} tokens, {sum(self._mask)} sampled>"

    @property
    def token_ids(self) -> list[int]:
        """A copy of the response so far."""
        return list(self._token_ids)

    @property
    def remaining(self) -> int:
        return self.budget - len(self._token_ids)

    @property
    def last_global_steps(self) -> int | None:
        return self._global_steps[-1] if self._global_steps else None

    def add_model(self, output: TokenOutput) -> None:
        """Append a turn the model generated (mask 1, its log probs and versions)."""
        self._check_room(len(output.token_ids))
        self._token_ids += output.token_ids
        self._mask += [1] * len(output.token_ids)
        self._log_probs += output.log_probs
        self._global_steps += output.global_steps

    def add_environment(
        self, token_ids: Sequence[int], *, global_steps: int | None = _LAST
    ) -> None:
        """Append tokens the model did not sample (mask 0, log prob 0.0).

        Args:
            token_ids: The inserted tokens.
            global_steps: Their version label; by default the last token's (the turn whose
                output they answer).
        """
        self._check_room(len(token_ids))
        steps = self.last_global_steps if global_steps is _LAST else global_steps
        self._token_ids += token_ids
        self._mask += [0] * len(token_ids)
        self._log_probs += [0.0] * len(token_ids)
        self._global_steps += [steps] * len(token_ids)

    def build(
        self,
        *,
        prompt_ids: Sequence[int],
        num_turns: int,
        stop_reason: StopReason,
        metrics: AgentLoopMetrics,
    ) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=tuple(prompt_ids),
            response_ids=tuple(self._token_ids),
            response_mask=tuple(self._mask),
            response_log_probs=tuple(self._log_probs),
            global_steps=tuple(self._global_steps),
            num_turns=num_turns,
            stop_reason=stop_reason,
            metrics=metrics,
        )

    def _check_room(self, count: int) -> None:
        if count > self.remaining:
            raise InvalidRequestError(
                f"{count} more tokens overrun the response budget ({self.remaining} of "
                f"{self.budget} left)"
            )
