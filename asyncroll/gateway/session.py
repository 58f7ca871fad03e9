"""A gateway session: one agent's conversation, recorded as the exact tokens the engines saw.

How a turn is prepared (``Session.prepare``):
1. Assistant messages the agent sends back unchanged (same content and tool calls as the gateway
   returned) are replaced by the text of the tokens the model generated for them, so the model's
   own tokens are never re-tokenized and a template's re-formatting of tool calls cannot drift.
   So are those it sends back rewritten (tool calls as plain text, whitespace normalised: the
   loose match of ``asyncroll.gateway.matching``), the first recorded reply after the last one
   matched that matches.
2. The conversation is rendered with the chat template. If the text starts with the text the
   current trajectory's tokens stand for, only the rest (the end of the last turn, tool results,
   new user turns, the generation prompt) is tokenized and appended with loss mask 0.
3. Otherwise the template rewrote history (it dropped a reasoning block, the agent edited an
   earlier turn): the trajectory forks. The current one is kept as it is, finished, and a new
   one starts from the newly rendered prompt. Forks are counted.

Invariants:
- ``prepare`` changes nothing; ``commit`` applies a prepared turn together with its generated
  output, so a request that fails (bad parameters, an over-long conversation) leaves the session
  as it was.
- Every trajectory's ``text`` is exactly the decoding of its tokens, piece by piece, and its
  response mask is 1 on the generated tokens only (``ResponseBuilder``'s invariants).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncroll.agent_loop import AgentLoopMetrics, AgentLoopOutput, ResponseBuilder, StopReason
from asyncroll.gateway.chat import AssistantReply, message_key
from asyncroll.gateway.matching import Recorded, matches
from asyncroll.types import TokenOutput

__all__ = ["ChatRenderer", "PreparedTurn", "Session", "SessionResult"]


class ChatRenderer(Protocol):
    """Text and tokens of one model: its chat template and tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
               ) -> str:
        """The conversation as the template renders it, with the generation prompt."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Special tokens kept."""
        ...


_STOP_REASONS: dict[str, StopReason] = {"length": "length", "abort": "abort"}


@dataclass(slots=True, kw_only=True)
class _Trajectory:
    prompt_ids: list[int]
    text: str
    response: ResponseBuilder
    num_turns: int = 0
    stop_reason: StopReason = "stop"
    generate_time_s: float = 0.0
    num_interrupted: int = 0
    num_tool_calls: int = 0
    num_cached_tokens: int = 0

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response.token_ids

    def output(self, reward: float | None) -> AgentLoopOutput:
        metrics = AgentLoopMetrics(
            generate_time_s=self.generate_time_s, tool_time_s=0.0,
            num_interrupted=self.num_interrupted, num_tool_calls=self.num_tool_calls,
            num_tool_errors=0, num_cached_tokens=self.num_cached_tokens,
        )
        out = self.response.build(prompt_ids=self.prompt_ids, num_turns=self.num_turns,
                                  stop_reason=self.stop_reason, metrics=metrics)
        return out if reward is None else out.with_reward(reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedTurn:
    """What ``Session.prepare`` decided; ``prompt_ids`` go to the engines."""

    prompt_ids: list[int]
    rendered: str
    suffix_ids: list[int]
    """Tokens appended to the current trajectory (empty on a fork or a first turn)."""
    fork: bool
    """The current trajectory does not prefix the rendered prompt: a new one starts."""
    epoch: int
    """The session's number of commits when prepared; a commit of a stale turn is refused."""
    sent: tuple[Recorded, ...] = ()
    """The conversation as the agent sent it (the session's record once committed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionResult:
    """A finished session as training data: one ``AgentLoopOutput`` per trajectory, in order
    (more than one only where the session forked), each carrying the session's reward."""

    session_id: str
    trajectories: tuple[AgentLoopOutput, ...]
    num_forks: int
    reward: float | None
    data: dict[str, Any] = field(default_factory=dict)


class Session:
    """One conversation's recorded tokens. Owned by the gateway; one turn at a time."""

    def __init__(self, session_id: str, renderer: ChatRenderer, *, budget: int,
                 data: dict[str, Any] | None = None) -> None:
        self.id = session_id
        self.data = dict(data or {})
        self.renderer = renderer
        self._budget = budget
        self._finished: list[_Trajectory] = []
        self._current: _Trajectory | None = None
        self._replies: dict[str, list[int]] = {}
        """message_key of a returned assistant message -> the index in ``_given`` of each reply
        with that key, in order (two replies may read the same to the agent)."""
        self._given: list[Recorded] = []
        """Every reply given, in order, with the text of its generated tokens."""
        self.record: tuple[Recorded, ...] = ()
        """The conversation as of the last turn: what the agent sent, then the reply."""
        self.num_forks = 0
        self.num_turns = 0
        self.created = self.last_used = time.monotonic()

    def __repr__(self) -> str:
        return (f"<Session {self.id} turns={self.num_turns} "
                f"trajectories={len(self._finished) + (self._current is not None)} "
                f"forks={self.num_forks}>")

    def prepare(self, messages: Sequence[dict[str, Any]],
                tools: Sequence[dict[str, Any]] | None, *,
                keys: Sequence[str] | None = None) -> PreparedTurn:
        """The prompt for the next turn (see the module docstring); changes nothing.

        ``keys``: the messages' ``message_key``s, where the caller has them already (without,
        only assistant messages are keyed: the others are matched loosely, which for them is
        their text without whitespace)."""
        if keys is None:
            keys = [message_key(m) if m["role"] == "assistant" else "" for m in messages]
        sent = tuple(Recorded(message, None, key) for message, key in zip(messages, keys,
                                                                          strict=True))
        rendered = self.renderer.render(self._substituted(sent), tools)
        current = self._current
        if current is not None and rendered.startswith(current.text):
            suffix = self.renderer.encode(rendered[len(current.text):])
            return PreparedTurn(prompt_ids=current.all_ids() + suffix, rendered=rendered,
                                suffix_ids=suffix, fork=False, epoch=self.num_turns, sent=sent)
        prompt = self.renderer.encode(rendered)
        return PreparedTurn(prompt_ids=prompt, rendered=rendered, suffix_ids=[],
                            fork=current is not None, epoch=self.num_turns, sent=sent)

    def commit(self, turn: PreparedTurn, output: TokenOutput, reply: AssistantReply,
               *, seconds: float) -> None:
        """Record a generated turn and the reply the agent was given.

        Raises:
            RuntimeError: another turn was committed since ``turn`` was prepared.
        """
        if turn.epoch != self.num_turns:
            raise RuntimeError("the session moved on since this turn was prepared")
        current = self._current
        if current is None or turn.fork:
            if current is not None:
                self._finished.append(current)
                self.num_forks += 1
            current = self._current = _Trajectory(
                prompt_ids=list(turn.prompt_ids), text=turn.rendered,
                response=ResponseBuilder(budget=self._budget),
            )
        elif turn.suffix_ids:
            current.response.add_environment(turn.suffix_ids)
            current.text = turn.rendered
        reply_text, end = self._split(output.token_ids)
        current.response.add_model(output)
        current.text += reply_text + end
        current.num_turns += 1
        current.stop_reason = _STOP_REASONS.get(output.finish_reason, "stop")
        current.generate_time_s += seconds
        current.num_interrupted += output.num_preempted
        current.num_tool_calls += len(reply.tool_calls)
        current.num_cached_tokens += output.num_cached_tokens
        given = Recorded.of(reply.message(), reply_text)
        self._replies.setdefault(given.key, []).append(len(self._given))
        self._given.append(given)
        self.record = (*turn.sent, given)
        self.last_used = time.monotonic()
        self.num_turns += 1

    def reply_text(self, token_ids: Sequence[int]) -> str:
        """A turn's text without its end-of-turn token, as the reply is parsed from."""
        return self._split(token_ids)[0]

    def result(self, reward: float | None) -> SessionResult:
        trajectories = [*self._finished, *([self._current] if self._current else [])]
        return SessionResult(
            session_id=self.id,
            trajectories=tuple(t.output(reward) for t in trajectories),
            num_forks=self.num_forks, reward=reward, data=self.data,
        )

    def _substituted(self, sent: Sequence[Recorded]) -> list[dict[str, Any]]:
        out = []
        seen: dict[str, int] = {}
        last = -1
        for item in sent:
            message, given = item.message, None
            if message["role"] == "assistant":
                indices = self._replies.get(item.key, ())
                index = seen[item.key] = seen.get(item.key, -1) + 1
                given = indices[index] if index < len(indices) else self._loose(item, last)
            if given is None:
                out.append(message)
                continue
            last = given
            out.append({"role": "assistant", "content": self._given[given].raw})
        return out

    def _loose(self, item: Recorded, last: int) -> int | None:
        """The first reply after ``last`` that ``item`` matches loosely, if any."""
        for index in range(last + 1, len(self._given)):
            if matches(item.message, item.key, self._given[index]):
                return index
        return None

    def _split(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """A turn's text without its end-of-turn token, and that token's text ("" if the turn
        did not end with one): together exactly the text its tokens stand for."""
        if token_ids and token_ids[-1] in self.renderer.eos_token_ids:
            return self.renderer.decode(token_ids[:-1]), self.renderer.decode(token_ids[-1:])
        return self.renderer.decode(token_ids), ""
