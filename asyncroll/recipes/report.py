"""What each recipe step reports, and the plot ``make demo`` writes."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncroll.adapters import AdapterReport
from asyncroll.interfaces import UpdateReport
from asyncroll.mismatch import MismatchSummary, summarize_mismatch
from asyncroll.recipes.rollout import Batch
from asyncroll.trainer import TrainMetrics, TrainSample

__all__ = ["StepRecord", "batch_mismatch", "format_table", "plot"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    step: int
    reward: float
    staleness_p50: float
    staleness_max: int
    push_seconds: float
    update_seconds: float
    resumed: int
    samples: int
    ratio: float
    failed: int = 0
    """Rollouts that failed and were left out of the step's batch (agent loops)."""
    kl_k3: float = float("nan")
    """The rollout/trainer mismatch over the batch's trained tokens (``batch_mismatch``); nan
    where the trainer gives no log probs."""
    kl_k3_fresh: float = float("nan")
    """The same over the tokens of the trainer's own version (staleness 0): near 0 unless the
    pushed weights are not the trainer's. nan where the batch has no such token (a rollout
    that ran ahead of the trainer: every token is at least one version old)."""
    wall_seconds: float = float("nan")
    """From the end of the previous step (or the recipe's start) to the end of this one."""
    train_seconds: float = float("nan")
    """The trainer's step alone."""
    tokens: int = 0
    """Response tokens in the batch (the rollout's output)."""
    pause_seconds: float = float("nan")
    """The update's pause (``UpdateReport.pause_seconds``); ``update_seconds`` holds it."""

    @classmethod
    def of(
        cls,
        step: int,
        batch: Batch,
        metrics: TrainMetrics,
        report: UpdateReport | AdapterReport,
        *,
        trainer_version: int,
        wall_seconds: float = float("nan"),
        train_seconds: float = float("nan"),
    ) -> StepRecord:
        staleness = batch.staleness(trainer_version)
        mismatch = batch_mismatch(batch.samples, metrics, trainer_version=trainer_version)
        fresh = mismatch.by_staleness.get(0) if mismatch is not None else None
        return cls(
            step=step,
            reward=batch.reward,
            staleness_p50=statistics.median(staleness),
            staleness_max=max(staleness),
            push_seconds=report.push_seconds,
            update_seconds=report.seconds,
            resumed=batch.resumed,
            samples=len(batch.samples),
            ratio=metrics.mean_ratio,
            failed=batch.failed,
            kl_k3=mismatch.overall.kl_k3 if mismatch is not None else float("nan"),
            kl_k3_fresh=fresh.kl_k3 if fresh is not None else float("nan"),
            wall_seconds=wall_seconds,
            train_seconds=train_seconds,
            tokens=sum(len(s.response_ids) for s in batch.samples),
            pause_seconds=report.pause_seconds,
        )


def batch_mismatch(
    samples: Sequence[TrainSample], metrics: TrainMetrics, *, trainer_version: int
) -> MismatchSummary | None:
    """The rollout/trainer mismatch of a trained batch, by token staleness (the trainer's
    version minus each token's); None where the trainer gave no log probs."""
    rollout: list[float] = []
    staleness: list[int | None] = []
    for sample in samples:
        for log_prob, version, bit in zip(
            sample.log_probs, sample.global_steps, sample.loss_mask, strict=True
        ):
            if bit:
                rollout.append(log_prob)
                staleness.append(None if version is None else trainer_version - version)
    if not metrics.log_probs or len(metrics.log_probs) != len(rollout):
        return None
    return summarize_mismatch(rollout, metrics.log_probs, staleness=staleness)


def format_table(records: Sequence[StepRecord]) -> str:
    """One line a step; a ``failed`` column only if some rollout failed. A KL over no token
    (no token of staleness 0: the rollout ran ahead) reads ``-``."""
    failures = any(r.failed for r in records)
    lines = ["step  reward  stale p50/max  step s  train s   tok/s  pause ms  push ms  update ms"
             "  resumed  ratio    k3 KL  fresh KL" + ("  failed" if failures else "")]
    for r in records:
        rate = r.tokens / r.wall_seconds if r.wall_seconds > 0 else float("nan")
        lines.append(
            f"{r.step:>4}  {r.reward:6.3f}  {r.staleness_p50:>5.1f}/{r.staleness_max:<3}"
            f"     {r.wall_seconds:6.2f}  {r.train_seconds:7.2f}  {_number(rate, '7.0f')}"
            f"  {r.pause_seconds * 1e3:8.1f}  {r.push_seconds * 1e3:7.1f}"
            f"  {r.update_seconds * 1e3:9.1f}  {r.resumed:>7}  {r.ratio:5.3f}"
            f"  {_number(r.kl_k3, '7.1e')}  {_number(r.kl_k3_fresh, '8.1e')}"
            + (f"  {r.failed:>6}" if failures else "")
        )
    return "\n".join(lines)


def _number(value: float, spec: str) -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if math.isnan(value) else format(value, spec)


def plot(records: Sequence[StepRecord], path: str | Path, *, title: str) -> Path:
    """Reward, staleness, push time and rollout/trainer mismatch per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    axes[0].plot(steps, [r.reward for r in records], marker="o")
    axes[0].set(title="mean reward", xlabel="trainer step")
    axes[1].plot(steps, [r.staleness_p50 for r in records], label="p50")
    axes[1].plot(steps, [r.staleness_max for r in records], label="max")
    axes[1].set(title="staleness (versions)", xlabel="trainer step")
    axes[1].legend()
    axes[2].bar(steps, [r.push_seconds * 1e3 for r in records], label="push")
    axes[2].plot(steps, [r.update_seconds * 1e3 for r in records], color="k", label="update")
    axes[2].set(title="weight update (ms)", xlabel="trainer step")
    axes[2].legend()
    axes[3].plot(steps, [r.kl_k3 for r in records], marker="o", label="all tokens")
    axes[3].plot(steps, [r.kl_k3_fresh for r in records], marker="x", label="staleness 0")
    axes[3].set(title="rollout/trainer k3 KL", xlabel="trainer step")
    axes[3].legend()
    figure.suptitle(title)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
