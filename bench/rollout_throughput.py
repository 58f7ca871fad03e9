"""Rollout throughput on a real vLLM CPU engine while weights update every few seconds.

One run, one engine, the same long-tailed workload (fixed seed) under five policies:
- ``none``: no weight updates (the ceiling),
- ``abort``: updates interrupt requests; asyncroll resubmits prompt + partial output,
- ``keep``: updates freeze requests in the engine; they go on from their KV after the push,
- ``recompute``: as ``keep``, but the new weights compute the requests' KV again,
- ``drain``: the synchronous baseline: stop admitting, wait for every in-flight request to
  finish, update, admit again (what trainers without partial rollout do).
Prints tokens/s, the ratio to ``none`` and to ``drain``, updates done, requests resumed,
re-prefilled tokens per update, and the longest event-loop turn (CPU time of the loop thread,
with the heap frozen after start-up as a trainer should: a full garbage collection of a process
that imported torch and vLLM takes ~0.3 s of CPU on its own).

    .venv/bin/python bench/rollout_throughput.py [--requests 96] [--interval 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import uvloop
from safetensors.torch import load_file

from asyncroll import AsyncServerManager, ResumeMode, VLLMEngine
from asyncroll.interfaces import INFLIGHT_MODES, RESUME_MODES
from asyncroll.testing import make_tiny_model
from asyncroll.testing.probes import PROBES_EXTENSION
from asyncroll.validation import check_resume_mode
from asyncroll.weights import WeightPusher

CONCURRENCY = 32


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts and long-tailed response lengths (most short, a few long), like RL rollouts."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(2, 500) for _ in range(rng.randrange(16, 64))],
         min(400, int(rng.paretovariate(1.2) * 60)))
        for _ in range(n)
    ]


class LoopLag:
    """The longest and 99th-percentile CPU time the loop's thread spends between two beats
    of a 1 ms heartbeat (one long turn shows up whole).

    Not a ``sleep(0)`` spin: a loop that never idles keeps its thread runnable, and every other
    thread of the process (the sender's packing thread) then waits out the GIL's switch
    interval at each release. A spinning heartbeat made the push 12x slower on the H100 (the
    stall sampler's, docs/benchmarks.md); this monitor spun the same way until 2026-11-23 and is
    the likely cause of the rollout runs' push stage being 7-12x slower than the push alone."""

    def __init__(self) -> None:
        self.turns: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            before = time.thread_time()
            await asyncio.sleep(0.001)
            self.turns.append(time.thread_time() - before)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def worst_ms(self) -> float:
        return max(self.turns, default=0.0) * 1e3

    def p99_ms(self) -> float:
        ordered = sorted(self.turns)
        return ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else 0.0


class SlowTurns:
    """Where the event loop's long turns go: a watchdog thread samples the loop thread's stack
    (and where the other threads are) whenever a turn has run past ``threshold`` seconds
    (wall), and gc callbacks time every collection. Sampling costs nothing on the loop; the
    loop only stamps a heartbeat a turn."""

    def __init__(
        self, threshold: float = 0.02, period: float = 0.005, *, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.threshold = threshold
        self.period = period
        self.stacks: collections.Counter[str] = collections.Counter()
        self.others: collections.Counter[str] = collections.Counter()
        """Where the process's other threads were at each stall."""
        self.stalls = 0
        self.sched: list[dict[str, float]] = []
        """Each stall's wall time from the loop thread's last healthy reading, and how much
        of it the thread ran on a CPU, waited in the run queue (ready, not scheduled: the OS
        ran something else), or neither (blocked: a syscall, a lock), from the kernel's
        ``/proc/.../schedstat`` (ns)."""
        self.native: list[str] = []
        """``py-spy dump --native`` of the process at stalls (``ASYNCROLL_NATIVE_DUMPS``: at
        most that many; py-spy at ``PY_SPY``, else on the PATH)."""
        self._dumps = int(os.environ.get("ASYNCROLL_NATIVE_DUMPS", "0"))
        self.gc_ms: list[tuple[int, float]] = []
        self._beat = time.perf_counter()
        self._stop = threading.Event()
        self._gc_started = 0.0
        self.census: dict[str, Any] = {}

    def _take_census(self) -> None:
        objects = gc.get_objects()  # every generation but the frozen one
        kinds = collections.Counter(type(o).__qualname__ for o in objects)
        self.census = {"tracked": len(objects), "top_types": kinds.most_common(12)}
        del objects

    async def _heartbeat(self) -> None:
        # Not sleep(0): a loop that never idles keeps its thread runnable, and every other
        # thread of the process (the sender's packing thread) then waits out the GIL's switch
        # interval at each release: on the H100 that made the push 12x slower (docs).
        while True:
            self._beat = time.perf_counter()
            await asyncio.sleep(0.002)

    def _sample(self, loop_thread: int, native_id: int) -> None:
        sampled_beat = None
        seen, healthy = self._beat, _schedstat(native_id)
        while not self._stop.wait(self.period):
            beat = self._beat
            if beat != seen:  # the loop turned: a reading at most a period into this turn
                seen, healthy = beat, _schedstat(native_id)
            if time.perf_counter() - beat < self.threshold or beat == sampled_beat:
                continue
            sampled_beat = beat  # one sample a stall, taken once it is already long
            now = _schedstat(native_id)
            if healthy is not None and now is not None:
                wall, ran, waited = (b - a for a, b in zip(healthy, now, strict=True))
                # How many callbacks the loop had queued (asyncio's; None under uvloop): a
                # turn running hundreds of small ones (callers woken by one step's outputs)
                # is long without any one of them being so.
                ready = getattr(self._loop, "_ready", None)
                self.sched.append({"wall ms": wall / 1e6, "on cpu ms": ran / 1e6,
                                   "run queue ms": waited / 1e6,
                                   "blocked ms": (wall - ran - waited) / 1e6,
                                   "ready callbacks": len(ready) if ready is not None else -1,
                                   "at s": time.perf_counter() - self._started})
            if len(self.native) < self._dumps:
                self.native.append(_native_dump())
            frames = sys._current_frames()
            frame = frames.get(loop_thread)
            if frame is not None:
                self.stalls += 1
                self.stacks[_summary(frame)] += 1
                # And where every other thread is (one of them may hold the GIL the loop
                # waits for): named, innermost frames only.
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, other in frames.items():
                    if ident not in (loop_thread, threading.get_ident()):
                        name = names.get(ident, f"thread {ident}")
                        self.others[f"{name}: {_summary(other, depth=4)}"] += 1

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2 and not self.census:
            self._take_census()  # what the first full pass of the run has to walk
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_ms.append((info["generation"], (time.perf_counter() - self._gc_started) * 1e3))

    def __enter__(self) -> SlowTurns:
        if not self.enabled:
            return self
        self._loop = asyncio.get_running_loop()
        self._started = time.perf_counter()
        self._task = self._loop.create_task(self._heartbeat())
        self._thread = threading.Thread(
            target=self._sample, args=(threading.get_ident(), threading.get_native_id()),
            daemon=True,
        )
        self._thread.start()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        gc.callbacks.remove(self._on_gc)
        self._stop.set()
        self._thread.join()
        self._task.cancel()

    def report(self, top: int = 5) -> dict[str, Any]:
        worst_gc = max((ms for _, ms in self.gc_ms), default=0.0)
        return {
            "stalls_over_ms": self.threshold * 1e3,
            "stalls": self.stalls,
            "gc_collections": len(self.gc_ms),
            "gc_worst_ms": round(worst_gc, 2),
            "gc_gen2": sum(1 for gen, _ in self.gc_ms if gen == 2),
            "top_stacks": self.stacks.most_common(top),
            "other_threads_at_stalls": self.others.most_common(2 * top),
            "scheduler_at_stalls": [{k: round(v, 2) for k, v in row.items()}
                                    for row in self.sched],
            "native_dumps": self.native,
            "gen2_census": self.census,
        }


def _schedstat(native_id: int) -> tuple[int, int, int] | None:
    """(now, ns the thread ran on a CPU, ns it waited runnable in the run queue), or None
    where the kernel does not say (no ``/proc``, no schedstats)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as file:
            ran, waited, _ = file.read().split()
    except (OSError, ValueError):
        return None
    return time.perf_counter_ns(), int(ran), int(waited)


def _native_dump() -> str:
    """Every thread's stack, Python and native, now (py-spy; the process is paused while it
    reads, about 10-50 ms)."""
    spy = os.environ.get("PY_SPY", "py-spy")
    try:
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(os.getpid())],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    return (done.stdout + done.stderr)[-6000:]


def _summary(frame: Any, depth: int = 8) -> str:
    """The innermost ``depth`` frames as ``file:function:line`` (paths shortened)."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        where = code.co_filename.rsplit("site-packages/", 1)[-1].rsplit("/work/", 1)[-1]
        parts.append(f"{where}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " <- ".join(parts)


class Admission:
    """The drain baseline's gate: closed while the trainer waits for in-flight requests."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()


async def run_policy(
    engine: VLLMEngine | list[VLLMEngine], weights: dict[str, Any], policy: str,
    jobs: list[tuple[list[int], int]], interval: float, *, concurrency: int = CONCURRENCY,
    slow_turns: bool = False,
    group_pushers: Callable[[VLLMEngine, set[str], bool], Any] | None = None,
) -> dict[str, Any]:
    # ``group_pushers``: with ``-roll``, the pusher of each engine's group, given the engine,
    # the policy's suffixes and whether the mode commits inflight (engines on several GPUs:
    # each reached its own way).
    # Suffixes, in any order: ``-1copy``: the same policy, pushed in one copy from the
    # trainer's own storages; ``-land``: each push lands in the workers first
    # (``WeightPusher(land=True)``); ``-roll``: over several engines, updated one at a time
    # (``rolling=1``)
    engines = engine if isinstance(engine, list) else [engine]
    engine = engines[0]
    base, suffixes = policy, set()
    while (suffix := next((x for x in ("-1copy", "-land", "-roll") if base.endswith(x)), None)):
        base, suffixes = base.removesuffix(suffix), suffixes | {suffix}
    rolling = 1 if "-roll" in suffixes else 0
    mode: ResumeMode = check_resume_mode(base) if base in RESUME_MODES else "abort"
    pusher: Any = None
    skews: list[int] = []  # a rolling update's: the engines' versions apart, at each group
    made: list[Any] = []
    if rolling and group_pushers is not None:
        def skew() -> int:
            versions = [e.global_steps or 0 for e in engines]
            return max(versions) - min(versions)

        def pusher(group: list[VLLMEngine]) -> Any:
            made.append(_Skewed(group_pushers(group[0], suffixes, mode in INFLIGHT_MODES),
                                skew, skews))
            return made[-1]
    elif suffixes & {"-1copy", "-land"}:
        inflight = mode in INFLIGHT_MODES
        pusher = WeightPusher(engines, one_copy="-1copy" in suffixes,
                              land="-land" in suffixes, backup=True if inflight else None)
    admission = Admission()
    queue: asyncio.Queue[tuple[int, list[int], int]] = asyncio.Queue()
    for i, (prompt, n) in enumerate(jobs):
        queue.put_nowait((i, prompt, n))
    tokens = 0
    resumed = 0
    receives: dict[str, list[float]] = collections.defaultdict(list)  # the workers' view
    groups: list[list[float]] = []  # a rolling update's, each group's seconds
    roll_ratios: list[float] = []
    commits: list[tuple[float, float]] = []  # an inflight update's RPC in the worker
    plan: dict[str, Any] = {}
    async with AsyncServerManager(engines, resume_mode=mode, weights=pusher,
                                  rolling=rolling) as manager:
        if policy != "none":  # the first update attaches the pusher and learns the load plan
            await manager.update_weights(weights, global_steps=(manager.global_steps or 0) + 1)
        stats_before = manager.statistics()

        async def worker() -> None:
            nonlocal tokens, resumed
            while not queue.empty():
                i, prompt, n = queue.get_nowait()
                await admission.open.wait()
                admission.in_flight += 1
                admission.idle.clear()
                try:
                    out = await manager.generate(
                        f"{policy}-{i}", prompt_ids=prompt,
                        sampling_params={"max_tokens": n, "ignore_eos": True},
                    )
                finally:
                    admission.in_flight -= 1
                    if admission.in_flight == 0:
                        admission.idle.set()
                assert len(out.token_ids) == n
                tokens += n
                resumed += out.num_preempted > 0

        started = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        updates = 0
        update_seconds = 0.0
        pending = set(workers)
        stages: dict[str, list[float]] = {
            k: [] for k in ("pause", "push", "finish", "resume", "")
        }
        inside: dict[str, list[float]] = collections.defaultdict(list)  # the push, split
        windows: list[float] = []  # each update's start and end
        with LoopLag() as lag, SlowTurns(enabled=slow_turns) as slow:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=interval)
                if pending and policy != "none":
                    if policy == "drain":
                        admission.open.clear()
                        await admission.idle.wait()
                    step = (manager.global_steps or 0) + 1
                    windows.append(time.perf_counter())
                    report = await manager.update_weights(weights, global_steps=step)
                    windows.append(time.perf_counter())
                    update_seconds += report.seconds
                    if report.group_seconds:
                        groups.append(list(report.group_seconds))
                        roll_ratios.append(  # the whole roll against one group's update
                            report.seconds / statistics.median(report.group_seconds))
                    for stage in stages:
                        stages[stage].append(getattr(report, f"{stage}_seconds" if stage
                                                     else "seconds"))
                    if report.push is not None:
                        for key, value in vars_of(report.push).items():
                            if isinstance(value, float):
                                inside[key].append(value)
                    if mode in INFLIGHT_MODES:  # what the receive RPC did between two steps
                        worker = (await engine.collective_rpc(
                            "asyncroll_last_receive_report"))[0] or {}
                        for key in ("seconds", "load_seconds", "wait_seconds", "sync_seconds",
                                    "verify_seconds"):
                            receives[key].append(float(worker.get(key, 0.0)))
                        receives["rpc"].append(worker.get("returned", 0.0)
                                               - worker.get("called", 0.0))
                        if worker.get("called"):
                            commits.append((worker["called"], worker["returned"]))
                        plan = {k: worker[k] for k in ("planned", "learned", "fallback", "calls",
                                                       "remembered", "plan_check_seconds")
                                if k in worker}  # the last update's load plan
                        marks = worker.get("stamps") or {}
                        before = worker.get("called", 0.0)
                        for key in ("entered", "began", "loading", "queued", "loaded", "checked",
                                    "updated", "finished"):
                            if key in marks and before:  # the commit RPC, phase by phase
                                receives[f"rpc: to {key}"].append(marks[key] - before)
                                before = marks[key]
                        if before and worker.get("returned"):
                            receives["rpc: to return"].append(worker["returned"] - before)
                    admission.open.set()
                    updates += 1
        elapsed = time.perf_counter() - started
        stats = manager.statistics()
        stalls = await engine_stalls(engine, started, windows, commits)
        if len(engines) > 1:
            stalls["stalls_by_engine"] = {
                e.name: await engine_stalls(e, started, windows) for e in engines
            }
            try:
                stalls.update(merged_stall(
                    [(await e.collective_rpc("asyncroll_step_times",
                                             kwargs={"since": started}))[0] for e in engines],
                    windows))
            except Exception as exc:  # an older worker: no stamps
                stalls["rollout_stall"] = f"unavailable: {exc}"
    for made_pusher in made:
        await made_pusher.pusher.aclose()
    if pusher is not None and not made and hasattr(pusher, "aclose"):
        await pusher.aclose()
    reprefill = stats.num_reprefill_tokens - stats_before.num_reprefill_tokens
    return {
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "updates": updates,
        "update_seconds": update_seconds,
        "resumed": resumed,
        "reprefill_per_update": reprefill / updates if updates else 0.0,
        "loop_worst_ms": lag.worst_ms(),
        "loop_p99_ms": lag.p99_ms(),
        "slow_turns": slow.report(),
        # medians over the updates of the run ("" is the whole update), and the worst
        "update_stage_ms": {k or "total": round(statistics.median(v) * 1e3, 1)
                            for k, v in stages.items()} if updates else {},
        "update_stage_worst_ms": {k or "total": round(max(v) * 1e3, 1)
                                  for k, v in stages.items()} if updates else {},
        "push_report_ms": {k: round(statistics.median(v) * 1e3, 1) for k, v in inside.items()}
        if updates else {},
        **stalls,
        "receive_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in receives.items()},
        "engines": len(engines),
        "plan": plan,
        # a rolling update: each group's update (median over the updates), and the whole roll
        "group_ms": [round(statistics.median(g) * 1e3, 1) for g in zip(*groups, strict=True)]
        if groups else [],
        # the roll's whole update against its median group's report (median over the updates)
        "roll_vs_one_group": round(statistics.median(roll_ratios), 2) if roll_ratios else None,
        "skew_worst": max(skews) if skews else None,
        "group_call_ms": [round(statistics.median(m.walls) * 1e3, 1) for m in made if m.walls],
    }


class _Skewed:
    """A group's pusher, the engines' versions apart read as each group begins and ends, and
    the group's whole call timed (its report's time starts after its checks)."""

    def __init__(self, pusher: Any, skew: Callable[[], int], skews: list[int]) -> None:
        self.pusher, self._skew, self._skews = pusher, skew, skews
        self.walls: list[float] = []

    async def update(self, *args: Any, prechecked: bool = False, **kwargs: Any) -> Any:
        self._skews.append(self._skew())
        began = time.perf_counter()
        try:
            return await self.pusher.update(*args, prechecked=prechecked, **kwargs)
        finally:
            self.walls.append(time.perf_counter() - began)
            self._skews.append(self._skew())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pusher, name)


async def engine_stalls(
    engine: VLLMEngine, since: float, windows: list[float],
    commits: Sequence[tuple[float, float]] = (),
) -> dict[str, Any]:
    """The engine's own view: the gaps between its steps (the workers stamp each step's start,
    ``asyncroll_step_times``). Per update, the longest gap between two steps that overlaps the
    update; beside it the median gap of the whole run (a step's own time). ``commits``: an
    inflight update's RPC in the worker (its start and end on the same clock): the gap that
    holds it, and that gap beyond the median step (what the commit cost the engine)."""
    try:
        times = (await engine.collective_rpc("asyncroll_step_times", kwargs={"since": since}))[0]
    except Exception as exc:  # an older worker: no stamps
        return {"step_gaps": f"unavailable: {exc}"}
    gaps = [(a, b) for a, b in itertools.pairwise(times)]
    if not gaps:
        return {}
    per_update = []
    for start, end in zip(windows[::2], windows[1::2], strict=True):
        inside = [b - a for a, b in gaps if b > start and a < end]
        if inside:
            per_update.append(max(inside))
    median_gap = statistics.median(b - a for a, b in gaps)
    # A commit arrives at a random time: the step it waits behind is drawn by its length
    # (the inspection paradox), so its expected gap without any commit is sum(g^2) / sum(g).
    biased_gap = sum((b - a) ** 2 for a, b in gaps) / sum(b - a for a, b in gaps)
    holding = [next((b - a for a, b in gaps if a <= called and b >= returned), None)
               for called, returned in commits]
    held = [gap for gap in holding if gap is not None]
    commit_stalls = {
        "commit_gap_ms": round(statistics.median(held) * 1e3, 2),
        "commit_gap_worst_ms": round(max(held) * 1e3, 2),
        "commit_stall_beyond_step_ms": round((statistics.median(held) - median_gap) * 1e3, 2),
        "commit_stall_beyond_biased_step_ms": round(
            (statistics.mean(held) - biased_gap) * 1e3, 2),
    } if held else {}
    if commits:
        commit_stalls["commit_gap_split_ms"] = await _split_commit_gaps(engine, since, commits)
    return {
        **commit_stalls,
        "step_gap_median_ms": round(median_gap * 1e3, 2),
        "step_gap_length_biased_ms": round(biased_gap * 1e3, 2),
        "update_stall_ms": round(statistics.median(per_update) * 1e3, 2) if per_update else None,
        "update_stall_worst_ms": round(max(per_update) * 1e3, 2) if per_update else None,
    }


async def _split_commit_gaps(
    engine: VLLMEngine, since: float, commits: Sequence[tuple[float, float]]
) -> dict[str, Any]:
    """The gap that holds each commit's RPC, by the steps' ends as well as their starts
    (``asyncroll_step_spans``; medians over the commits, in ms): the step before it (its
    forward pass and sampling), the engine's own work between that step's end and the RPC
    (its outputs, the requests it admits), the RPC, and from the RPC's return to the next
    step's start (admissions, the scheduler). Beside them, the same between two steps with
    no commit: what an ordinary gap holds besides its step."""
    try:
        spans = (await engine.collective_rpc("asyncroll_step_spans",
                                             kwargs={"since": since}))[0]
    except Exception as exc:  # an older worker: no ends stamped
        return {"unavailable": str(exc)}
    parts: dict[str, list[float]] = collections.defaultdict(list)
    holding = set()
    for called, returned in commits:
        for k, ((a, e), (b, _)) in enumerate(itertools.pairwise(spans)):
            if e <= called and returned <= b and a <= called:
                holding.add(k)
                parts["step before"].append(e - a)
                parts["step end -> RPC called"].append(called - e)
                parts["RPC"].append(returned - called)
                parts["RPC returned -> next step"].append(b - returned)
                break
        else:
            parts["not bracketed"].append(1.0)  # the RPC overlapped a step's stamps
    between = [b - e for k, ((_, e), (b, _)) in enumerate(itertools.pairwise(spans))
               if k not in holding]
    steps = [e - a for a, e in spans]
    split = {key: round(statistics.median(v) * 1e3, 2) if key != "not bracketed" else len(v)
             for key, v in parts.items()}
    if between:
        split["no commit: step"] = round(statistics.median(steps) * 1e3, 2)
        split["no commit: step end -> next step"] = round(statistics.median(between) * 1e3, 2)
        split["no commit: step end -> next step, length-biased"] = round(
            sum(g * g for g in between) / sum(between) * 1e3, 2) if sum(between) else 0.0
    return split


def merged_stall(step_times: Sequence[Sequence[float]], windows: list[float]) -> dict[str, Any]:
    """The whole rollout's view of several engines: per update (``windows``: its start and
    end), the longest time in which no engine began a step. A rollout that never stops as a
    whole shows about one step here; engines paused together show the pause."""
    merged = sorted(t for times in step_times for t in times)
    per_update = []
    for start, end in zip(windows[::2], windows[1::2], strict=True):
        inside = [b - a for a, b in itertools.pairwise(merged) if b > start and a < end]
        if inside:
            per_update.append(max(inside))
    gaps = [b - a for a, b in itertools.pairwise(merged)]
    if not per_update or not gaps:
        return {}
    return {"rollout_stall_ms": round(statistics.median(per_update) * 1e3, 2),
            "rollout_stall_worst_ms": round(max(per_update) * 1e3, 2),
            "rollout_gap_median_ms": round(statistics.median(gaps) * 1e3, 2)}


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def vars_of(report: Any) -> dict[str, Any]:
    fields = getattr(report, "__dataclass_fields__", None) or {}
    return {name: getattr(report, name) for name in fields}


@contextlib.asynccontextmanager
async def warm_engine(
    jobs: list[tuple[list[int], int]], interval: float
) -> AsyncIterator[tuple[VLLMEngine, dict[str, Any]]]:
    """A CPU engine on a tiny Qwen2 (the probes extension: the workers' step times and receive
    reports) that has run a few of ``jobs``, and the weights it started on."""
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "m", seed=0)
        weights = load_file(str(model / "model.safetensors"))
        async with VLLMEngine.launch(model, max_model_len=512, skip_tokenizer_init=True,
                                     worker_extension_cls=PROBES_EXTENSION) as engine:
            await run_policy(engine, weights, "none", jobs[:8], interval)
            yield engine, weights


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--policies", default="none,abort,keep,recompute,inflight,drain")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--slow-turns", action="store_true",
                        help="sample the loop thread's stack on long turns, time collections")
    args = parser.parse_args()
    jobs = workload(args.requests)
    total = sum(n for _, n in jobs)
    print(f"workload: {len(jobs)} requests, {total} tokens, concurrency {args.concurrency}, "
          f"updates every {args.interval:g} s", flush=True)
    results: dict[str, dict[str, float]] = {}
    async with warm_engine(jobs, args.interval) as (engine, weights):
        gc.collect()
        gc.freeze()  # start-up's objects live forever: keep full collections off the loop
        for policy in args.policies.split(","):
            print(f"running {policy}...", flush=True)
            results[policy] = await run_policy(engine, weights, policy, jobs, args.interval,
                                               concurrency=args.concurrency,
                                               slow_turns=args.slow_turns)
            print(f"  {results[policy]['tokens_per_s']:.0f} tokens/s", flush=True)
    print("\n| policy | wall s | tokens/s | vs none | vs drain | updates | update s total "
          "| engine stall ms (median / worst; a step: median gap) "
          "| requests resumed | re-prefill tokens / update | loop turn p99 / worst ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    none = results.get("none", {}).get("tokens_per_s")
    drain = results.get("drain", {}).get("tokens_per_s")
    for policy, r in results.items():
        print(
            f"| {policy} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f}"
            f" | {_ratio(r['tokens_per_s'], none)} | {_ratio(r['tokens_per_s'], drain)}"
            f" | {r['updates']:.0f} | {r['update_seconds']:.2f}"
            f" | {r.get('update_stall_ms')} / {r.get('update_stall_worst_ms')}"
            f" ({r.get('step_gap_median_ms')})"
            f" | {r['resumed']:.0f} | {r['reprefill_per_update']:.0f}"
            f" | {r['loop_p99_ms']:.2f} / {r['loop_worst_ms']:.1f} |"
        )
    for policy, r in results.items():
        print(f"{policy}: slow turns {r['slow_turns']}")


if __name__ == "__main__":
    uvloop.run(main())
