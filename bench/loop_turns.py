"""What holds the rollout's event loop, and what ``asyncroll.frozen_heap`` gives back.

One CPU engine (a tiny Qwen2), 512 long-tailed requests from 256 concurrent callers through
``AsyncServerManager``, each policy (no updates, ``inflight`` updates every 2 s) run under three
heaps, in turn, ``--rounds`` times:

- ``untouched``: the collector as a process has it (the baseline: what a user's process does);
- ``frozen``: inside ``asyncroll.frozen_heap()`` (ours);
- ``no-gc``: the collector off (the limit: no collection at all, which no long run can afford).

Prints, for each: tokens a second, the loop's worst turn and 99th percentile (the CPU time
the loop's thread spent between two beats of a 1 ms heartbeat), and the collections' count and
worst pause by generation; then the ratios against the baseline and the limit.

    .venv/bin/python bench/loop_turns.py [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table, not the engine's log
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import collections
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvloop
from rollout_throughput import run_policy, warm_engine, workload

from asyncroll import frozen_heap

HEAPS = ("untouched", "frozen", "no-gc")


class Collections:
    """Every collection's generation and pause (ms), from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._started) * 1e3))

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict[str, list[float]]:
        """By generation: [count, worst ms, total ms]."""
        by: dict[int, list[float]] = collections.defaultdict(list)
        for generation, ms in self.pauses:
            by[generation].append(ms)
        return {f"gen{g}": [len(v), round(max(v), 2), round(sum(v), 1)]
                for g, v in sorted(by.items())}


@contextlib.contextmanager
def heap(kind: str) -> Iterator[None]:
    if kind == "frozen":
        with frozen_heap():
            yield
    elif kind == "no-gc":
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
    else:
        yield


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--policies", default="none,inflight")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    jobs = workload(args.requests)
    print(f"{len(jobs)} requests ({sum(n for _, n in jobs)} tokens), {args.concurrency} callers, "
          f"policies {args.policies}, {args.rounds} rounds of {', '.join(HEAPS)}", flush=True)
    runs: list[dict[str, Any]] = []
    async with warm_engine(jobs, args.interval) as (engine, weights):
        for number in range(args.rounds):
            for policy in args.policies.split(","):
                for kind in HEAPS:
                    gc.collect()  # each run starts from the same heap
                    with heap(kind), Collections() as seen:
                        result = await run_policy(engine, weights, policy, jobs,
                                                  args.interval,
                                                  concurrency=args.concurrency)
                    run = {"round": number + 1, "policy": policy, "heap": kind,
                           "tokens_per_s": round(result["tokens_per_s"]),
                           "loop_worst_ms": round(result["loop_worst_ms"], 1),
                           "loop_p99_ms": round(result["loop_p99_ms"], 2),
                           "collections": seen.summary(),
                           "tracked_objects": len(gc.get_objects())}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    report(runs)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs}, indent=1))


def report(runs: list[dict[str, Any]]) -> None:
    print("\n| policy | heap | tokens/s (median) | vs untouched | vs no-gc | loop worst turn ms "
          "(each round) | worst collection ms |")
    print("|---|---|---|---|---|---|---|")
    for policy in dict.fromkeys(r["policy"] for r in runs):
        median = {kind: statistics.median(r["tokens_per_s"] for r in runs
                                          if r["policy"] == policy and r["heap"] == kind)
                  for kind in HEAPS}
        for kind in HEAPS:
            mine = [r for r in runs if r["policy"] == policy and r["heap"] == kind]
            worst_gc = max((c[1] for r in mine for c in r["collections"].values()), default=0)
            print(f"| {policy} | {kind} | {median[kind]:.0f} "
                  f"| {median[kind] / median['untouched']:.2f}x "
                  f"| {median[kind] / median['no-gc']:.2f}x "
                  f"| {', '.join(str(r['loop_worst_ms']) for r in mine)} | {worst_gc} |")


if __name__ == "__main__":
    uvloop.run(main())
