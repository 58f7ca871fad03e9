"""What AsyncServerManager adds to a generate call: manager -> instant FakeEngine vs the engine.

The engine is ``FakeEngine(token_delay=0)``: it validates, yields to the loop once and returns 4
tokens, so the time a call takes is all Python and event loop. Both paths run the same calls
(8-token prompts, ``max_tokens=4``), sequentially and from ``--concurrency`` callers at once, on
uvloop. Each configuration runs both paths alternately ``--repeats`` times after a warm-up; the
overhead is the median of the paired differences per call, in microseconds of the loop thread's
CPU time (target: < 50 us) and, for information, of wall time (which on a shared machine also
holds the time other processes ran instead of this one).

    .venv/bin/python bench/manager_overhead.py [--calls 20000] [--repeats 7] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from importlib.metadata import version
from itertools import count
from typing import Any, NamedTuple

import uvloop

from asyncroll import AsyncServerManager
from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater

PROMPT = list(range(10, 18))
PARAMS: dict[str, Any] = {"max_tokens": 4, "ignore_eos": True, "temperature": 1.0}
TARGET_US = 50.0

Call = Callable[[str], Awaitable[object]]
_ids = count()


class Timing(NamedTuple):
    """Seconds of one run: wall clock, and CPU of the loop's thread (what other processes on a
    shared machine do not inflate; the loop never waits idle here, the engine is instant)."""

    wall: float
    cpu: float


def _now() -> Timing:
    return Timing(time.perf_counter(), time.thread_time())


def _since(start: Timing) -> Timing:
    now = _now()
    return Timing(now.wall - start.wall, now.cpu - start.cpu)


async def sequential(call: Call, calls: int) -> Timing:
    """Time ``calls`` calls, one after the other."""
    started = _now()
    for _ in range(calls):
        await call(f"s{next(_ids)}")
    return _since(started)


async def concurrent(call: Call, calls: int, callers: int) -> Timing:
    """Time ``calls`` calls made by ``callers`` tasks at once."""

    async def caller(share: int) -> None:
        for _ in range(share):
            await call(f"c{next(_ids)}")

    started = _now()
    await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))
    return _since(started)


class Row(NamedTuple):
    """Microseconds a call (medians over the paired runs)."""

    direct_cpu: float
    managed_cpu: float
    overhead_cpu: float
    overhead_wall: float
    managed_wall: float


async def paired(
    measure: Callable[[Call], Awaitable[Timing]],
    direct: Call,
    managed: Call,
    calls: int,
    repeats: int,
) -> Row:
    """Run both paths alternately (after a warm-up of each), so that load from other processes
    falls on both alike; each overhead is the median of the differences within pairs."""
    await measure(direct)
    await measure(managed)
    pairs = []
    for repeat in range(repeats):
        pairs.append((await measure(direct), await measure(managed)))
        print(f"    run {repeat + 1}/{repeats}", flush=True)

    def median_us(values: Iterable[float]) -> float:
        return statistics.median(values) * 1e6 / calls

    return Row(
        direct_cpu=median_us(d.cpu for d, _ in pairs),
        managed_cpu=median_us(m.cpu for _, m in pairs),
        overhead_cpu=median_us(m.cpu - d.cpu for d, m in pairs),
        overhead_wall=median_us(m.wall - d.wall for d, m in pairs),
        managed_wall=median_us(m.wall for _, m in pairs),
    )


async def main(args: argparse.Namespace) -> None:
    engine = FakeEngine(name="instant")
    manager = AsyncServerManager([engine], weights=FakeWeightUpdater([engine]))

    async def direct(request_id: str) -> object:
        return await engine.generate(request_id, prompt_ids=PROMPT, sampling_params=PARAMS)

    async def managed(request_id: str) -> object:
        return await manager.generate(request_id, prompt_ids=PROMPT, sampling_params=PARAMS)

    calls = args.calls - args.calls % args.concurrency
    print(
        f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"uvloop {version('uvloop')}; {calls} calls a run, {args.repeats} paired runs",
        flush=True,
    )
    measures: list[tuple[str, Callable[[Call], Awaitable[Timing]]]] = [
        ("sequential", lambda call: sequential(call, calls)),
        (f"{args.concurrency} concurrent", lambda call: concurrent(call, calls, args.concurrency)),
    ]
    rows = []
    for label, measure in measures:
        print(f"  {label}: engine direct and through the manager, alternately", flush=True)
        rows.append((label, await paired(measure, direct, managed, calls, args.repeats)))
    assert engine.statistics().in_flight == 0 and manager.statistics().in_flight == 0
    print("\nus a call; CPU: the loop thread's CPU time, wall: elapsed (medians)\n")
    print(
        "| callers | direct CPU | manager CPU | overhead CPU | ratio CPU | overhead wall "
        "| manager calls/s wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, row in rows:
        print(
            f"| {label} | {row.direct_cpu:.1f} | {row.managed_cpu:.1f} | {row.overhead_cpu:.1f} "
            f"| {row.managed_cpu / row.direct_cpu:.2f}x | {row.overhead_wall:.1f} "
            f"| {1e6 / row.managed_wall:,.0f} |"
        )
    worst = max(row.overhead_cpu for _, row in rows)
    verdict = "met" if worst < TARGET_US else "MISSED"
    print(
        f"\ntarget: manager adds < {TARGET_US:.0f} us of CPU a call: {verdict} "
        f"(worst {worst:.1f} us; wall overheads also count others' load on this machine)"
    )
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        await sequential(managed, calls)
        profile.disable()
        print(f"cProfile of {calls} sequential calls through the manager (manager's own code):")
        stats = pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime")
        stats.print_stats(r"asyncroll/(manager|routing|validation)")
    await manager.aclose()
    await engine.aclose()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="cProfile the managed calls")
    return parser.parse_args()


if __name__ == "__main__":
    uvloop.run(main(parse_args()))
