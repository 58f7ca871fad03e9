"""Values that cross the layers: frozen, slotted, keyword-only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EngineStatistics", "FinishReason", "PauseMode", "Segment"]

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]


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
