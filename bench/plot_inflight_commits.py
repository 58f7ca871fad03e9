"""Plot what an inflight update cost the engine, by policy, from rollout runs of
``bench/gpu_e2e.py --sections rollout`` (their JSON): the commit's RPC in the worker, and the
gap between the two engine steps that hold it beyond a step drawn by its length
(``commit_stall_beyond_biased_step_ms``), one bar per run and round.

    python bench/plot_inflight_commits.py OUT.png RUN.json[@LABEL] ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def values(path: str, key: str) -> list[tuple[str, str, int | None, Any]]:
    """(run label, policy, round or None, value) of ``key`` in one rollout run's JSON
    (``RUN.json[@LABEL]``): each round's where the run has rounds, else its one result's."""
    file, _, label = path.partition("@")
    rollout: dict[str, Any] = json.loads(Path(file).read_text())["rollout"]
    label = label or Path(file).stem
    rounds = rollout.get("rounds")
    if rounds:
        return [(label, policy, number + 1, value)
                for policy, row in rounds.items()
                for number, value in enumerate(row.get(f"{key}, each round") or [])]
    return [(label, policy, None, result.get(key))
            for policy, result in rollout["results"].items()]


def rows(path: str) -> list[tuple[str, str, float, float | None]]:
    """(run label, policy, RPC ms, stall beyond a biased step ms) of each policy and round."""
    beyond = {(policy, number): value for _, policy, number, value
              in values(path, "commit_stall_beyond_biased_step_ms")}
    return [(label if number is None else f"{label} r{number}", policy, received["rpc"],
             beyond.get((policy, number)))
            for label, policy, number, received in values(path, "receive_ms")
            if received and "rpc" in received]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = sys.argv[1], sys.argv[2:]
    data = [row for path in paths for row in rows(path)]
    policies = list(dict.fromkeys(policy for _, policy, _, _ in data))
    runs = list(dict.fromkeys(run for run, _, _, _ in data))
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    width = 0.8 / max(1, len(runs))
    for index, run in enumerate(runs):
        for axis, column in zip(axes, (2, 3), strict=True):
            values = {p: r[column] for r in data if r[0] == run for p in [r[1]]}
            xs = [i + index * width for i, p in enumerate(policies) if values.get(p) is not None]
            ys = [values[p] for p in policies if values.get(p) is not None]
            axis.bar(xs, ys, width=width, label=run)
    titles = ("the commit's RPC in the worker (ms)",
              "engine gap holding it, beyond a length-biased step (ms)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(policies))])
        axis.set_xticklabels(policies, rotation=15)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)  # every run has its RPC; older ones lack the right panel
    figure.suptitle("inflight updates on one H200 (0.5B shape, 256 callers): received in the "
                    "commit against landed first")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
