"""Values that cross the layers: frozen, slotted, keyword-only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncroll.transport import PushReport

__all__ = [
    "EngineStatistics",
    "Delivery",
    "FinishReason",
    "HistogramSnapshot",
    "ManagerStatistics",
    "PauseMode",
    "Segment",
    "TokenOutput",
    "UpdateReport",
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
    waiting: int = 0
    """Requests waiting to be admitted (paused, asleep or holding)."""


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
class Delivery:
    """What one engine's workers took in a push, summed over its workers."""

    version: int
    """The push's version (``global_steps``; -1 for None)."""
    workers: int
    tensors: int
    """Tensors received (counted once per worker: a tensor-parallel engine of 2 counts each
    tensor twice)."""
    bytes: int
    verified: int
    """Tensors whose loaded bytes were checked against the trainer's fingerprints (and
    matched: a mismatch fails the push)."""
    not_verifiable: int
    """Tensors the workers could not find whole in the model (fused or sharded pieces loaded
    by the model's own loaders), so not checked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """One weight update: what it published and moved, and where its time went (seconds),
    pause to resume."""

    global_steps: int | None
    """The version published (None: the labels were kept)."""
    engines: int
    seconds: float
    pause_seconds: float
    push_seconds: float
    finish_seconds: float
    """The commit: each engine's label and new prefix-cache epoch (``WeightPort.commit``)."""
    resume_seconds: float
    push: PushReport | None
    tensors: int = 0
    """Tensors pushed (to each engine)."""
    bytes: int = 0
    """Bytes pushed (to each engine)."""
    deliveries: Mapping[str, Delivery] = field(default_factory=dict)
    """Engine name -> what its workers took (engines whose workers report it; gathered after
    the resume, so not part of ``seconds``)."""
    pieces: Mapping[str, str] = field(default_factory=dict)
    """A sharded trainer's (``DistributedWeightPusher``): the tensors that travelled without a
    gather, each as ``"rows"`` (every rank its own rows) or ``"columns"`` (the column blocks
    the ranks exchanged); every other sharded tensor was gathered whole."""
    group_seconds: tuple[float, ...] = ()
    """A rolling update's (``AsyncServerManager(rolling=k)``): each group's update, in order;
    the stage seconds above are their sums (so ``gb_per_s`` is per group, over them all),
    ``seconds`` the whole roll."""

    @property
    def gb_per_s(self) -> float:
        """Bytes pushed per second of the push stage (to each engine), in GB/s."""
        return self.bytes / self.push_seconds / 1e9 if self.push_seconds > 0 else 0.0

    @property
    def verified(self) -> int:
        """Tensors checked against the trainer's fingerprints, over every engine's workers."""
        return sum(d.verified for d in self.deliveries.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramSnapshot:
    """Observations counted into buckets: ``counts[i]`` of them were ``<= bounds[i]`` and
    above the bound before; ``counts[-1]``, above the last bound (one more count than bounds).
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def quantile(self, q: float) -> float:
        """The bucket bound below which a share ``q`` of the observations lie (an upper bound
        on the quantile; ``inf`` if it lies above the last bound, ``nan`` if none)."""
        if not self.count:
            return float("nan")
        seen = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += n
            if seen >= q * self.count:
                return bound
        return float("inf")


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
    num_rejected: int = 0
    """Calls refused for bad input (``InvalidRequestError``), by the manager or an engine."""
    num_failed_updates: int = 0
    recent_updates: tuple[UpdateReport, ...] = ()
    """The last successful weight updates' reports, oldest first (at most 32)."""
    update_seconds: Mapping[str, HistogramSnapshot] = field(default_factory=dict)
    """Every successful update's seconds by stage: ``pause``, ``push``, ``finish``
    (the commit), ``resume`` and ``total``."""
    pushed_bytes: int = 0
    """Bytes pushed to each engine, summed over the successful updates."""
    verified_tensors: int = 0
    """Tensors whose load was checked against the trainer's fingerprints, over every update
    and worker."""
    token_staleness: HistogramSnapshot | None = None
    """Tokens returned, by staleness: how many versions the weights that produced each were
    behind the published version when its output was returned (tokens of unknown version
    are not counted)."""
    busy_seconds: Mapping[str, float] = field(default_factory=dict)
    """Per engine, the seconds it had at least one of this manager's requests in flight (paused
    for an update included): over a span of wall time, its busy share."""
