"""Whether a message an agent sends is a turn the gateway recorded, and which session a
conversation sent without a session id continues. Pure functions, no I/O.

Agents send their whole conversation every turn. A message matches a recorded one:
- strictly: equal ``message_key`` (role, content, tool calls with arguments compared as JSON);
- loosely, for clients that rewrite history: the same role and the same text once whitespace is
  left out (clients strip, re-indent and join messages with newlines). A reply the gateway gave
  with tool calls also matches an assistant message whose text holds every call's id (each id
  is random, so only a copy of that reply holds them: smolagents re-sends calls as the text
  ``Calling tools: [{'id': 'call_...', ...}]``) and the reply's content; a reply without calls
  also matches the text its tokens stand for (a client that appends the stop string it was
  stopped by).

Invariants:
- ``continued_session`` returns the session whose recorded conversation is the longest one the
  sent conversation extends (every recorded message matched in order, and more sent after
  them); of sessions tied on that, the one that runs no turn and has been idle longest (tied
  sessions recorded the same messages, so which one goes on changes nothing that is recorded);
  None where no session's conversation is extended (a new conversation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncroll.gateway.chat import message_key

__all__ = ["Candidate", "Recorded", "continued_session", "extends", "matches", "opening",
           "normalised"]


@dataclass(frozen=True, slots=True)
class Recorded:
    """One message of a session's conversation: one the agent sent, or a reply it was given
    (with ``raw``, the text of the reply's generated tokens)."""

    message: dict[str, Any]
    raw: str | None = None
    key: str = field(default="", compare=False)

    @classmethod
    def of(cls, message: dict[str, Any], raw: str | None = None) -> Recorded:
        return cls(message, raw, message_key(message))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A session that could go on: its id, recorded conversation, idle time and whether it runs
    a turn now."""

    session_id: str
    record: Sequence[Recorded]
    last_used: float
    busy: bool


def normalised(text: object) -> str:
    """``text`` without its whitespace (a non-string: empty)."""
    return "".join(text.split()) if isinstance(text, str) else ""


def opening(messages: Sequence[Mapping[str, Any]]) -> str:
    """What a conversation opens with (its first message that is not a system prompt, as
    loosely compared): the index the gateway keeps sessions under."""
    first = next((m for m in messages if m.get("role") != "system"), messages[0])
    return f"{first.get('role')}:{normalised(first.get('content'))}"


def matches(sent: Mapping[str, Any], sent_key: str, recorded: Recorded) -> bool:
    """Whether ``sent`` is ``recorded`` (see the module docstring)."""
    if sent_key and sent_key == recorded.key:
        return True
    message = recorded.message
    if sent.get("role") != message.get("role"):
        return False
    text = normalised(sent.get("content"))
    calls = message.get("tool_calls") or ()
    if recorded.raw is None or not calls:
        return text == normalised(message.get("content")) or (
            recorded.raw is not None and not sent.get("tool_calls")
            and text == normalised(recorded.raw))
    ids = [call.get("id") for call in calls]
    return all(isinstance(i, str) and i in text for i in ids) \
        and normalised(message.get("content")) in text


def extends(sent: Sequence[Mapping[str, Any]], keys: Sequence[str],
            record: Sequence[Recorded]) -> bool:
    """Whether the sent conversation is ``record`` followed by more messages."""
    return len(sent) > len(record) and all(
        matches(message, key, recorded)
        for message, key, recorded in zip(sent, keys, record, strict=False))


def continued_session(sent: Sequence[Mapping[str, Any]], keys: Sequence[str],
                      candidates: Iterable[Candidate]) -> str | None:
    """The session ``sent`` continues (see the module invariants), or None."""
    best: tuple[int, bool, float] | None = None
    chosen = None
    for candidate in candidates:
        if not extends(sent, keys, candidate.record):
            continue
        rank = (len(candidate.record), not candidate.busy, -candidate.last_used)
        if best is None or rank > best:
            best, chosen = rank, candidate.session_id
    return chosen
