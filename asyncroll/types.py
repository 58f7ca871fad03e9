"""Values that cross the layers: frozen, slotted, keyword-only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EngineStatistics",
    "FinishReason",
    "ManagerStatistics",
    "PauseMode",
    "Segment",
    "TokenOutput",
    "version_range",
]

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]


def version_range(global_steps: Sequence[int | None]) -> tuple[int | None, int | None]:
    """The oldest and newest trainer step among per-token versions (None where none is known)."""
    known = [step for step in global_steps if step is not None]
    return (min(known), max(known)) if known else (None, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """What one engine produced for one request between dispatch and finish (or abort).

    Invariant: ``len(token_ids) == len(log_probs) == len(global_steps)``.
    ``global_steps[i]`` is the trainer step whose weights produced token ``i`` (``None`` for
    weights no trainer step labelled, e.g. the checkpoint the engine started from unlabelled).
    """

    request_id: str
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    global_steps: tuple[int | None, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int = 0

    @property
    def weight_version(self) -> int | None:
        """The version of the last token (the one in force when the segment ended)."""
        return self.global_steps[-1] if self.global_steps else None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatistics:
    """A snapshot of one engine's state, as the adapter sees it."""

    in_flight: int
    paused: bool
    asleep: bool
    dead: bool
    global_steps: int | None
    num_requests: int
    num_aborted: int
    num_rejected: int
    holding: bool = False
    """A push failed without a backup: requests wait until a push succeeds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenOutput:
    """One complete generation, however many segments and engines it took.

    Invariant: ``len(token_ids) == len(log_probs) == len(global_steps)``; ``global_steps[i]`` is
    the trainer step whose weights produced token ``i``, and never decreases along the output.
    """

    request_id: str
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    global_steps: tuple[int | None, ...]
    finish_reason: FinishReason
    num_preempted: int
    engines: tuple[str, ...]
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def min_global_steps(self) -> int | None:
        return version_range(self.global_steps)[0]

    @property
    def max_global_steps(self) -> int | None:
        return version_range(self.global_steps)[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerStatistics:
    """A snapshot of the server manager."""

    in_flight: int
    in_flight_per_engine: dict[str, int]
    alive_engines: int
    global_steps: int | None
    updating: bool
    num_requests: int
    num_preempted: int
    num_engine_failovers: int
    num_updates: int
    sticky_sessions: int
    num_reprefill_tokens: int = 0
    """Prompt + partial-output tokens resubmitted (``abort``-mode resumes and failovers)."""
