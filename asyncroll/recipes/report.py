"""What each recipe step reports, and the plot ``make demo`` writes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncroll.interfaces import UpdateReport
from asyncroll.recipes.rollout import Batch
from asyncroll.trainer import TrainMetrics

__all__ = ["StepRecord", "format_table", "plot"]


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

    @classmethod
    def of(
        cls,
        step: int,
        batch: Batch,
        metrics: TrainMetrics,
        report: UpdateReport,
        *,
        trainer_version: int,
    ) -> StepRecord:
        staleness = batch.staleness(trainer_version)
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
        )


def format_table(records: Sequence[StepRecord]) -> str:
    """One line a step; a ``failed`` column only if some rollout failed."""
    failures = any(r.failed for r in records)
    lines = ["step  reward  stale p50/max  push ms  update ms  resumed  ratio"
             + ("  failed" if failures else "")]
    for r in records:
        lines.append(
            f"{r.step:>4}  {r.reward:6.3f}  {r.staleness_p50:>5.1f}/{r.staleness_max:<3}"
            f"      {r.push_seconds * 1e3:7.1f}  {r.update_seconds * 1e3:9.1f}  {r.resumed:>7}"
            f"  {r.ratio:5.3f}" + (f"  {r.failed:>6}" if failures else "")
        )
    return "\n".join(lines)


def plot(records: Sequence[StepRecord], path: str | Path, *, title: str) -> Path:
    """Reward, staleness and push time per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
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
    figure.suptitle(title)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
