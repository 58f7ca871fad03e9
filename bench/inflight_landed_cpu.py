"""Inflight updates on the CPU build, received in the commit against landed first
(``WeightPusher(land=True)``), beside no updates: ``bench/rollout_throughput.py``'s workload
on one CPU engine (a tiny Qwen2), the policies in turn each round, their order reversed every
other round (the machine drifts). Prints a line per policy and round (tokens/s, the commit's
RPC in the worker, the engine's gap around it beyond a length-biased step) and writes the
whole results as JSON.

``--idle-landing``: no updates at all; ``none`` run three times a round: before a landing
pusher attaches (and pushes once), while its landing thread stays open, and after it closed.

    .venv/bin/python bench/inflight_landed_cpu.py --requests 384 --rounds 3 --json OUT.json
    .venv/bin/python bench/inflight_landed_cpu.py --requests 192 --rounds 2 --idle-landing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import rollout_throughput as rt

from asyncroll.weights import WeightPusher

POLICIES = ("none", "inflight", "inflight-land")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--idle-landing", action="store_true")
    args = parser.parse_args()
    jobs = rt.workload(args.requests)
    out: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "workload": {"requests": len(jobs), "tokens": sum(n for _, n in jobs),
                     "concurrency": args.concurrency, "update every s": args.interval},
        "rounds": [],
    }
    async with rt.warm_engine(jobs, args.interval) as (engine, weights):
        for number in range(args.rounds if args.idle_landing else 0):
            speeds = []
            for stage in ("before", "open", "after"):
                if stage == "open":
                    pusher = WeightPusher([engine], land=True, backup=True)
                    await pusher.update(weights, global_steps=(engine.global_steps or 0) + 1)
                result = await rt.run_policy(engine, weights, "none", jobs, args.interval,
                                             concurrency=args.concurrency)
                if stage == "open":
                    await pusher.aclose()
                speeds.append(round(result["tokens_per_s"]))
            stages = ("before", "landing open", "after")
            out["rounds"].append(dict(zip(stages, speeds, strict=True)))
            print(f"round {number + 1}: none {speeds[0]} tokens/s, with a landing thread open"
                  f" {speeds[1]}, closed again {speeds[2]}", flush=True)
        for number in range(0 if args.idle_landing else args.rounds):
            run: dict[str, Any] = {}
            for policy in POLICIES if number % 2 == 0 else POLICIES[::-1]:
                result = await rt.run_policy(engine, weights, policy, jobs, args.interval,
                                             concurrency=args.concurrency)
                result.pop("slow_turns", None)
                run[policy] = result
                print(f"round {number + 1} {policy}: {result['tokens_per_s']:.0f} tokens/s,"
                      f" commit RPC {result['receive_ms'].get('rpc')} ms, gap beyond a step"
                      f" {result.get('commit_stall_beyond_biased_step_ms')} ms", flush=True)
            out["rounds"].append(run)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    asyncio.run(main())
