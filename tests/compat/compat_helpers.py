"""The compatibility suite's harness: a manager whose replies are scripted, and the checks every
framework's trajectory must pass.

``ScriptedManager`` stands between the gateway and a real ``AsyncServerManager``. For each turn
with a scripted text it replaces the turn's output constraint by a grammar of that one text
(vLLM's structured outputs, ``choice``), so the real engine writes exactly that text, token by
token (its own choice of tokens, its own log probs), then ends the turn with its end-of-turn
token: a random tiny model answers like an agent's model would (a tool call, then an answer).
Before every turn it pushes the same weights as a new version, so each turn's tokens carry a
higher ``global_steps`` than the last.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from asyncroll import AsyncServerManager, TokenOutput
from asyncroll.gateway import SessionResult

CLOCK_CALL = '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
"""A Hermes call of the suite's ``clock`` tool (no arguments)."""

ANSWER = "It is noon."


class ScriptedManager:
    """The manager, with scripted replies and a new version before every turn (see above)."""

    def __init__(self, manager: AsyncServerManager, weights: Mapping[str, Any]) -> None:
        self.manager = manager
        self.weights = weights
        self.script: collections.deque[str] = collections.deque()
        self.calls: list[tuple[list[int], TokenOutput]] = []
        self.asked: list[dict[str, Any]] = []
        """The sampling arguments the gateway asked for, per call (before any script)."""

    @property
    def engines(self) -> Sequence[Any]:
        return self.manager.engines

    async def generate(self, request_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: Mapping[str, Any] | None = None,
                       session_key: str | None = None) -> TokenOutput:
        params = dict(sampling_params or {})
        self.asked.append(dict(params))
        if self.script:
            params["structured_outputs"] = {"choice": [self.script.popleft()]}
            params["temperature"] = 0.0
        steps = (self.manager.global_steps or 0) + 1
        await self.manager.update_weights(self.weights, global_steps=steps)
        output = await self.manager.generate(request_id, prompt_ids=prompt_ids,
                                             sampling_params=params, session_key=session_key)
        self.calls.append((list(prompt_ids), output))
        return output


def check_exact(result: SessionResult, calls: Sequence[tuple[list[int], TokenOutput]], *,
                forks: int = 0) -> None:
    """One trajectory (``forks`` more where the client rewrote history) that is, per call, what
    the gateway added (mask 0) and exactly what the engine generated (mask 1, its log probs and
    versions), with versions that never decrease."""
    assert result.num_forks == forks and len(result.trajectories) == forks + 1
    assert sum(t.num_turns for t in result.trajectories) == len(calls)
    start = 0
    for trajectory in result.trajectories:
        mine = list(calls[start:start + trajectory.num_turns])
        start += trajectory.num_turns
        _check_one(trajectory, mine)


def _check_one(trajectory: Any, calls: list[tuple[list[int], TokenOutput]]) -> None:
    first_prompt, _ = calls[0]
    assert list(trajectory.prompt_ids) == first_prompt
    tokens = list(first_prompt)
    mask: list[int] = []
    for prompt, output in calls:
        assert prompt[:len(tokens)] == tokens, "a later prompt re-tokenized earlier tokens"
        mask += [0] * (len(prompt) - len(tokens)) + [1] * len(output.token_ids)
        tokens = prompt + list(output.token_ids)
    assert list(trajectory.prompt_ids) + list(trajectory.response_ids) == tokens
    assert list(trajectory.response_mask) == mask, "the mask is not 1 exactly on sampled tokens"
    sampled = [i for i, bit in enumerate(mask) if bit]
    assert [trajectory.response_log_probs[i] for i in sampled] == [
        p for _, output in calls for p in output.log_probs]
    assert [trajectory.global_steps[i] for i in sampled] == [
        s for _, output in calls for s in output.global_steps]
    steps = [s for s in trajectory.global_steps if s is not None]
    assert steps == sorted(steps), "versions decrease along the trajectory"
    assert len(set(steps)) == len(calls), "each turn was meant to carry a version of its own"
