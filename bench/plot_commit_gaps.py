"""Plot what the gap between two engine steps holds when an inflight commit runs in it, from
rollout runs of ``bench/gpu_e2e.py --sections rollout`` (their JSON, ``commit_gap_split_ms``):
the step before it, the engine's own work up to the commit's RPC, the RPC, and the work after
it up to the next step; beside each, the same gap with no commit (a step, then the work
between two steps). One stacked bar per policy, run and round.

    python bench/plot_commit_gaps.py OUT.png RUN.json[@LABEL] ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plot_inflight_commits import values

PARTS = (
    ("step before", "the step before", "#4c72b0"),
    ("step end -> RPC called", "up to the RPC", "#dd8452"),
    ("RPC", "the commit's RPC", "#c44e52"),
    ("RPC returned -> next step", "after the RPC", "#937860"),
)
ORDINARY = (
    ("no commit: step", "#4c72b0"),
    ("no commit: step end -> next step", "#8c8c8c"),
)


def splits(path: str) -> list[tuple[str, dict[str, float]]]:
    """(bar label, split) for each policy and round of one run."""
    return [(f"{label}\n{policy}" + ("" if number is None else f" r{number}"), split)
            for label, policy, number, split in values(path, "commit_gap_split_ms")
            if split and "RPC" in split]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(sys.argv) < 3:
        sys.exit(__doc__)
    bars = [bar for path in sys.argv[2:] for bar in splits(path)]
    if not bars:
        sys.exit("no commit_gap_split_ms in these runs")
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(bars)), 5.5))
    width = 0.38
    tallest = 0.0
    for i, (_, split) in enumerate(bars):
        bottom = 0.0
        for key, name, color in PARTS:
            value = split.get(key, 0.0)
            ax.bar(i - width / 2, value, width, bottom=bottom, color=color,
                   label=name if i == 0 else None)
            bottom += value
        ax.text(i - width / 2, bottom + 0.3, f"{bottom:.1f}", ha="center", fontsize=7)
        tallest = max(tallest, bottom)
        bottom = 0.0
        for key, color in ORDINARY:
            value = split.get(key, 0.0)
            ax.bar(i + width / 2, value, width, bottom=bottom, color=color, alpha=0.45,
                   hatch="//", label=("no commit: a step, then the gap to the next"
                                      if i == 0 and key.endswith("next step") else None))
            bottom += value
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("ms (medians over the updates)")
    ax.set_title("The gap an inflight commit runs in, split by the steps' starts and ends")
    ax.set_ylim(0, tallest * 1.45)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=120)
    print(f"wrote {sys.argv[1]} ({len(bars)} bars)")


if __name__ == "__main__":
    main()
