"""Where one adapter push's time goes, as a timeline: one row per tree, from
``bench/gpu_lora.py --sections push`` JSON files (its ``at ... ms`` stamps: the manager's,
the sender's and the first worker's, on one host clock).

    python bench/plot_lora_timeline.py OUT.png LABEL=FILE.json[#SECTION][@WHICH] [...]

(``#push 7b rank 64 one-copy``: that section of the file; the first push section without.
``@WHICH``: ``asyncroll idle`` (the default), ``asyncroll idle (step loop)``, or ``load`` /
``load (step loop)``: the median timeline of the pushes while calls ran, from the file's
rollout section, its first round.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (name, from stamp, to stamp): each a bar on its row; "call" is 0.
# Trees before 2026-11-30 stamp "manager packed" only; later ones each step of the manager.
SPANS = [
    ("check + pack", "call", "manager packed"),
    ("to the sender", "manager packed", "sender began"),
    ("RPC to the worker", "manager packed", "worker called"),
    ("checks", "call", "manager checked"),
    ("to the take leaving", "manager checked", "manager take left"),
    ("pack + finite check (the take travelling)", "manager filling", "manager filled"),
    ("fingerprints", "manager filled", "manager printed"),
    ("RPC to the worker", "manager take left", "worker called"),
    ("to the sender", "manager printed", "sender began"),
    ("worker: drop, prepare", "worker called", "worker receive began"),
    ("sender: copy, signal", "sender began", "sender signalled"),
    ("worker: copy out, ack", "worker first arrived", "worker first acked"),
    ("until the end message", "worker first acked", "sender ended"),
    ("worker: check", "sender ended", "worker checked"),
    ("worker: register", "worker checked", "worker registered"),
    ("RPC back", "worker registered", "returned"),
    # A landed push (2026-11-30 on): no take; the workers' verdicts, then the registration
    # sent and not waited for.
    ("sender: acks, end message", "sender signalled", "sender ended"),
    ("to the workers' verdicts", "sender ended", "manager verdicts"),
    ("registration sent (queued)", "manager verdicts", "manager registration queued"),
]


def stamps(path: Path, section: str, which: str = "") -> dict[str, float]:
    """The stamps of ``section`` (the first push section where empty), ``which`` timeline."""
    data = json.loads(path.read_text())
    if which.startswith("load"):
        runs = next(v["rounds"][0] for k, v in data.items() if k.startswith("rollout "))
        run = runs["push (step loop)" if "step loop" in which else "push"]
        found = run["timeline under load (median ms from the call)"]
    else:
        found = next(v[which or "asyncroll idle"] for k, v in data.items()
                     if k == section or (not section and k.startswith("push ")))
    return {"call": 0.0, **{k[3:-3]: float(v) for k, v in found.items() if k.startswith("at ")}}


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, rows = Path(argv[0]), [arg.split("=", 1) for arg in argv[1:]]
    colours = plt.get_cmap("tab20")
    shown: set[str] = set()
    names = list(dict.fromkeys(name for name, _, _ in SPANS))
    fig, ax = plt.subplots(figsize=(10, 1.0 + 1.6 * len(rows)))
    last = 0.0
    for row, (_, file) in enumerate(rows):
        file, _, which = file.partition("@")
        file, _, section = file.partition("#")
        at = stamps(Path(file), section, which)
        height = 0.8 / len(SPANS)
        for i, (name, start, end) in enumerate(SPANS):
            if start in at and end in at and at[end] >= at[start]:  # (a landed push's
                # registration runs after it returned: not part of its time)
                y = row + 0.4 - (i + 0.5) * height
                ax.barh(y, at[end] - at[start], left=at[start], height=height * 0.9,
                        color=colours(names.index(name) % 20),
                        label=name if name not in shown else None)
                shown.add(name)
        ax.text(at["returned"] + 0.1, row, f"{at['returned']:.2f} ms", va="center")
        last = max(last, at["returned"])
    ax.set_xlim(0, last * 1.15)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the call (one host clock: manager, sender, first worker)")
    ax.set_title("One adapter push (7B shape, rank 64, 392 tensors, 308 MiB), medians")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
