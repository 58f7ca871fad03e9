"""Soak: the server manager across many weight updates under full load, then a leak check.

Per resume mode (``abort``, ``keep``): an ``AsyncServerManager`` over the engines keeps
``concurrency`` callers in flight (a new one starts whenever one ends; mixed prompt lengths,
``max_tokens`` drawn from 8..300, ``ignore_eos``; all seeded) while weights are pushed
``updates`` times, alternating two models' weights, one push ``interval`` seconds after the
previous one returned. A seeded ``cancel_fraction`` of the callers is cancelled: half after a
random delay, half while the next update runs (paused engines, closed gate). Then no new
callers start and the rest finish.

Checks (none depends on timing: the interval and the cancel moments only shape the load):
- every caller that was not cancelled got exactly ``max_tokens`` tokens, log probs and
  ``global_steps`` (finish reason ``length``, finite log probs <= 0, ids in the vocabulary);
- per-token ``global_steps`` never decrease, and each lies between the lowest version the
  engines served when the call started and the highest version pushed when it returned;
- nothing is left in flight: the manager, each engine's adapter, vLLM's own front end;
  engines neither paused nor holding, all at the last version, the manager too;
- after the manager closes: the transport's shared memory (found by its nonce in this
  process's memory maps) and private directory are gone and mapped by no process of ours,
  no socket file is left in a transport directory, no new /dev/shm entry of ours is left
  (beyond ``shm_slack``; the total is only reported: other jobs' come and go), our RSS is
  back within ``rss_slack_mib`` of the start, the engines' processes within
  ``engine_rss_slack_mib`` per engine.

Engine RSS: a vLLM CPU worker grows by a few hundred MiB the first times it decodes large
batches, and then with new prefill shapes: oneDNN's primitive cache (1024 entries by default;
with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` the growth is gone). Python objects and tensors in
the worker stay constant, and 100 updates without load grow it by 1 MiB: not a leak, not
asyncroll's. So the script runs a short warm-up soak before its baselines, and bounds the
engines per engine and this process (asyncroll's side) tighter: after the warm-up, three
60-update ``abort`` soaks in a row (~15k resubmitted segments each) still grew the two
workers by 250, 128 and 116 MiB.

    .venv/bin/python bench/soak.py [--updates 60] [--interval 0.3] [--concurrency 256]
        [--modes abort,keep] [--seed 0] [--json PATH]

Exits 1 if any check failed. ``soak()`` is importable (tests/test_soak.py runs it on the
suite's shared engines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import random
import re
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from asyncroll import AsyncServerManager, ResumeMode, TokenOutput, VLLMEngine
from asyncroll.transport.security import runtime_base
from asyncroll.weights import UpdateReport

ENGINE_ARGS: dict[str, Any] = {"max_model_len": 512, "dtype": "float32"}
"""As in tests/engine_helpers.py: float32 keeps a tiny random model's near-ties stable."""

MAX_TOKENS = (8, 300)
"""Inclusive range of a caller's ``max_tokens``."""

PROMPT_LEN = (1, 64)
"""Inclusive range of a caller's prompt length."""

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"/dev/shm/asyncroll-([0-9a-f]+)-\d+")

CancelKind = Literal["none", "delay", "update"]


# -- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One caller: its prompt, budget, and whether (and how) it will be cancelled."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    cancel: CancelKind
    cancel_after: float


def make_job(
    rng: random.Random, request_id: str, *, vocab_size: int, cancel_fraction: float,
    cancel_within: float, max_tokens_range: tuple[int, int] = MAX_TOKENS,
) -> Job:
    """Draw one caller; the same seed gives the same sequence of jobs."""
    prompt = tuple(rng.randrange(2, vocab_size) for _ in range(rng.randint(*PROMPT_LEN)))
    max_tokens = rng.randint(*max_tokens_range)
    cancel: CancelKind = "none"
    if rng.random() < cancel_fraction:
        cancel = "delay" if rng.random() < 0.5 else "update"
    return Job(request_id, prompt, max_tokens, cancel, rng.uniform(0.0, cancel_within))


def check_output(
    job: Job, output: TokenOutput, *, low: int | None, high: int | None, vocab_size: int
) -> list[str]:
    """What is wrong with one completed output (empty: nothing)."""
    n = job.max_tokens
    problems = []
    lengths = (len(output.token_ids), len(output.log_probs), len(output.global_steps))
    if lengths != (n, n, n):
        problems.append(f"lengths tokens/logprobs/steps {lengths}, max_tokens {n}")
    if output.finish_reason != "length":
        problems.append(f"finish_reason {output.finish_reason!r}")
    if output.request_id != job.request_id:
        problems.append(f"request_id {output.request_id!r}")
    if any(not 0 <= t < vocab_size for t in output.token_ids):
        problems.append("a token id outside the vocabulary")
    if any(not (math.isfinite(lp) and lp <= 1e-4) for lp in output.log_probs):
        problems.append("a log prob that is not finite and <= 0")
    problems += _check_versions(output.global_steps, low=low, high=high)
    return [f"{job.request_id}: {p}" for p in problems]


def _check_versions(
    steps: Sequence[int | None], *, low: int | None, high: int | None
) -> list[str]:
    if any(s is None for s in steps):
        return [f"unlabelled tokens (global_steps {sorted(set(map(str, steps)))})"]
    known = [s for s in steps if s is not None]
    problems = []
    if any(b < a for a, b in itertools.pairwise(known)):
        problems.append(f"global_steps decrease: {_runs(known)}")
    if known and low is not None and known[0] < low:
        problems.append(f"a token from version {known[0]}, older than {low} in force at start")
    if known and high is not None and known[-1] > high:
        problems.append(f"a token from version {known[-1]}, newer than {high} pushed at return")
    return problems


def _runs(steps: Sequence[int]) -> str:
    """``[(version, count), ...]`` of consecutive runs, for a readable failure."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return str([tuple(r) for r in runs])


# -- resources -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resources:
    """What the process tree holds that a leak would grow."""

    rss_own: int
    rss_children: int
    rss_by_process: dict[str, int]
    """``"pid name"`` -> RSS, for this process and each child (where a growth comes from)."""
    shm_entries: tuple[str, ...]
    transport_dirs: int
    transport_sockets: int


def take_rss() -> dict[str, int]:
    """RSS of this process and of each of its children, by ``"pid name"``."""
    rss = {}
    for proc in (psutil.Process(), *psutil.Process().children(recursive=True)):
        with contextlib.suppress(psutil.Error):  # exited while we looked
            rss[f"{proc.pid} {proc.name()}"] = proc.memory_info().rss
    return rss


def take_resources() -> Resources:
    gc.collect()
    me = psutil.Process()
    by_process = take_rss()
    own = by_process.get(f"{me.pid} {me.name()}", me.memory_info().rss)
    dirs = list(runtime_base().glob("asyncroll-*"))
    sockets = sum(
        1 for d in dirs for p in _walk(d) if stat.S_ISSOCK(p.lstat().st_mode)
    )
    return Resources(
        rss_own=own,
        rss_children=sum(by_process.values()) - own,
        rss_by_process=by_process,
        shm_entries=tuple(sorted(os.listdir(SHM_DIR))),
        transport_dirs=len(dirs),
        transport_sockets=sockets,
    )


def new_shm_entries(before: Resources, after: Resources) -> list[str]:
    """/dev/shm entries that appeared and are ours: named like the transport's, or mapped by a
    process of ours. On a shared machine other jobs' engines and multiprocessing semaphores
    come and go in /dev/shm; nothing of our tree but the transport creates entries after the
    engines started."""
    new = set(after.shm_entries) - set(before.shm_entries)
    mapped = ""
    for pid in _our_pids():
        with contextlib.suppress(OSError):
            mapped += Path(f"/proc/{pid}/maps").read_text()
    return sorted(n for n in new if n.startswith("asyncroll-") or f"/dev/shm/{n}" in mapped)


def _walk(folder: Path) -> list[Path]:
    with contextlib.suppress(OSError):  # removed while we looked
        return list(folder.rglob("*"))
    return []


def _our_pids() -> list[int]:
    me = psutil.Process()
    return [me.pid, *(c.pid for c in me.children(recursive=True))]


def transport_nonces() -> set[str]:
    """Nonces of the transport's shared-memory buffers mapped by this process or its children
    (the sender maps its staging buffers as long as it lives; names unlinked at seal time still
    show in the maps, marked deleted)."""
    nonces: set[str] = set()
    for pid in _our_pids():
        with contextlib.suppress(OSError):
            nonces |= set(_SHM_NAME.findall(Path(f"/proc/{pid}/maps").read_text()))
    return nonces


def leftovers(nonces: set[str]) -> list[str]:
    """Anything of these transports still on disk or mapped by a process of ours."""
    found = [str(p) for n in nonces for p in SHM_DIR.glob(f"asyncroll-{n}-*")]
    found += [str(p) for n in nonces if (p := runtime_base() / f"asyncroll-{n}").exists()]
    for pid in _our_pids():
        with contextlib.suppress(OSError):
            mapped = set(_SHM_NAME.findall(Path(f"/proc/{pid}/maps").read_text()))
            found += [f"pid {pid} still maps asyncroll-{n}" for n in mapped & nonces]
    return found


# -- one soak --------------------------------------------------------------------------------


@dataclass(slots=True)
class SoakResult:
    """Counts, timings and failures of one soak (one resume mode)."""

    mode: str
    concurrency: int
    interval: float
    updates: int = 0
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    cancel_missed: int = 0
    """Callers marked for cancellation that completed first (checked like any other)."""
    errors: int = 0
    tokens: int = 0
    spanning: int = 0
    """Completed outputs whose tokens come from more than one version."""
    num_preempted: int = 0
    num_reprefill_tokens: int = 0
    wall_seconds: float = 0.0
    update_seconds: list[float] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)
    """Per update: seconds of pause, push, finish (the commit), resume."""
    before: Resources | None = None
    after: Resources | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else 0.0

    def update_ms(self, q: float) -> float:
        return _quantile(self.update_seconds, q) * 1e3

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out |= {"ok": self.ok, "tokens_per_s": self.tokens_per_s}
        out |= {f"update_ms_{k}": self.update_ms(q) for k, q in (("p50", .5), ("p99", .99))}
        out["update_ms_max"] = max(self.update_seconds, default=0.0) * 1e3
        return out


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else 0.0


class _Soak:
    """The state one soak shares between its callers, its feeder and its updater."""

    def __init__(
        self, manager: AsyncServerManager, result: SoakResult, *, seed: int,
        cancel_fraction: float, cancel_within: float, max_tokens: tuple[int, int],
    ) -> None:
        self.manager = manager
        self.max_tokens = max_tokens
        self.result = result
        self.rng = random.Random(seed)
        self.cancel_fraction = cancel_fraction
        self.cancel_within = cancel_within
        self.vocab_size = min(e.vocab_size for e in manager.engines)
        self.pushed = manager.global_steps
        """The highest version handed to ``update_weights`` so far."""
        self.at_next_update: set[asyncio.Task[None]] = set()

    def lowest_served(self) -> int | None:
        versions = [e.global_steps for e in self.manager.engines]
        return None if None in versions else min(v for v in versions if v is not None)

    def start_caller(self) -> asyncio.Task[None]:
        job = make_job(
            self.rng, f"{self.result.mode}-{self.result.started}", vocab_size=self.vocab_size,
            cancel_fraction=self.cancel_fraction, cancel_within=self.cancel_within,
            max_tokens_range=self.max_tokens,
        )
        self.result.started += 1
        task = asyncio.create_task(self.call(job), name=job.request_id)
        if job.cancel == "delay":
            timer = asyncio.get_running_loop().call_later(job.cancel_after, task.cancel)
            task.add_done_callback(lambda _: timer.cancel())
        elif job.cancel == "update":
            self.at_next_update.add(task)
            task.add_done_callback(self.at_next_update.discard)
        return task

    def collect(self, done: set[asyncio.Task[None]]) -> None:
        """Count the callers that ended by cancellation (those that ran count themselves)."""
        self.result.cancelled += sum(task.cancelled() for task in done)

    async def call(self, job: Job) -> None:
        low = self.lowest_served()
        params = {"max_tokens": job.max_tokens, "ignore_eos": True, "temperature": 1.0}
        try:
            output = await self.manager.generate(
                job.request_id, prompt_ids=job.prompt, sampling_params=params
            )
        except Exception as exc:
            self.result.errors += 1
            self.result.failures.append(f"{job.request_id}: {type(exc).__name__}: {exc}")
            return
        self.result.failures += check_output(
            job, output, low=low, high=self.pushed, vocab_size=self.vocab_size
        )
        self.result.completed += 1
        self.result.cancel_missed += job.cancel != "none"
        self.result.tokens += len(output.token_ids)
        self.result.spanning += output.min_global_steps != output.max_global_steps

    async def update_loop(
        self, weights: Sequence[Mapping[str, torch.Tensor]], updates: int, interval: float,
        progress: Callable[[str], None] | None,
    ) -> None:
        base = self.manager.global_steps or 0
        for k in range(updates):
            await asyncio.sleep(interval)  # a load pattern only; no check depends on it
            self.pushed = base + k + 1
            update = asyncio.ensure_future(
                self.manager.update_weights(weights[k % len(weights)].items(),
                                            global_steps=self.pushed)
            )
            await asyncio.sleep(0)  # the update has begun: gate closed, engines pausing
            doomed, self.at_next_update = self.at_next_update, set()
            for task in doomed:
                task.cancel()
            report: UpdateReport = await update
            self.result.updates += 1
            self.result.update_seconds.append(report.seconds)
            self.result.stages.append(_stages(report))
            if progress is not None and ((k + 1) % 10 == 0 or k + 1 == updates):
                progress(self.progress_line(k + 1, updates))

    def progress_line(self, k: int, updates: int) -> str:
        rss = sum(take_rss().values()) - psutil.Process().memory_info().rss  # the children
        r = self.result
        return (
            f"[{r.mode}] update {k}/{updates} (global_steps {self.pushed}): "
            f"{r.completed} completed, {r.cancelled} cancelled, "
            f"{self.manager.statistics().in_flight} in flight, "
            f"last update {r.update_seconds[-1] * 1e3:.0f} ms, children RSS {rss / 2**20:.0f} MiB"
        )


def _stages(report: UpdateReport) -> dict[str, float]:
    return {
        "pause": report.pause_seconds,
        "push": report.push_seconds,
        "finish": report.finish_seconds,
        "resume": report.resume_seconds,
    }


async def soak(
    engines: Sequence[VLLMEngine],
    weights_list: Sequence[Mapping[str, torch.Tensor]],
    *,
    mode: ResumeMode,
    updates: int = 60,
    interval: float = 0.3,
    concurrency: int = 256,
    seed: int = 0,
    max_tokens: tuple[int, int] = MAX_TOKENS,
    cancel_fraction: float = 0.1,
    cancel_within: float = 10.0,
    rss_slack_mib: float = 64.0,
    engine_rss_slack_mib: float = 192.0,
    shm_slack: int = 0,
    progress: Callable[[str], None] | None = None,
) -> SoakResult:
    """Run one soak over ``engines`` in resume mode ``mode``; see the module docstring.

    Args:
        engines: Started engines; they are left serving the last pushed weights, not paused,
            with nothing in flight.
        weights_list: Named tensors pushed in turn (update k pushes ``weights_list[k % n]``).
        max_tokens: Inclusive range of the callers' ``max_tokens`` (uniform draw).
        cancel_within: A delay-cancelled caller is cancelled this many seconds after it starts,
            at most (uniform draw).
        rss_slack_mib: How far this process's RSS may end above the start.
        engine_rss_slack_mib: How far the children's RSS (the engines' processes) may end above
            the start, per engine; warm the engines up first (see the module docstring).
        shm_slack: How many more /dev/shm entries than at the start are tolerated.

    Returns:
        The result; ``result.failures`` lists every failed check (empty: all passed).
    """
    result = SoakResult(mode=mode, concurrency=concurrency, interval=interval)
    result.before = take_resources()
    nonces: set[str] = set()
    manager = AsyncServerManager(engines, resume_mode=mode)
    try:
        state = _Soak(manager, result, seed=seed, cancel_fraction=cancel_fraction,
                      cancel_within=cancel_within, max_tokens=max_tokens)
        stats_before = manager.statistics()
        started = time.perf_counter()
        try:
            await _drive(state, weights_list, updates, interval, concurrency, progress)
        except Exception as exc:  # an update failed: report it with everything else
            result.failures.append(f"the soak stopped: {type(exc).__name__}: {exc}")
        result.wall_seconds = time.perf_counter() - started
        stats = manager.statistics()
        result.num_preempted = stats.num_preempted - stats_before.num_preempted
        result.num_reprefill_tokens = stats.num_reprefill_tokens - stats_before.num_reprefill_tokens
        result.failures += _check_quiet(manager, engines, state.pushed, updates)
        nonces = transport_nonces()
        if updates and not nonces:
            result.failures.append("no transport shared memory found in any process of ours")
    finally:
        await manager.aclose()
    result.after = take_resources()
    result.failures += _check_resources(
        result.before, result.after, nonces, rss_slack_mib * 2**20,
        engine_rss_slack_mib * 2**20 * len(engines), shm_slack,
    )
    return result


async def _drive(
    state: _Soak, weights: Sequence[Mapping[str, torch.Tensor]], updates: int, interval: float,
    concurrency: int, progress: Callable[[str], None] | None,
) -> None:
    """Keep ``concurrency`` callers in flight until the updates are done; then let them end."""
    updater = asyncio.create_task(state.update_loop(weights, updates, interval, progress))
    callers = {state.start_caller() for _ in range(concurrency)}
    try:
        while not updater.done():
            done, callers = await asyncio.wait(
                callers | {updater}, return_when=asyncio.FIRST_COMPLETED
            )
            callers -= {updater}
            done -= {updater}
            state.collect(done)
            if not updater.done():
                callers |= {state.start_caller() for _ in done}
        await updater  # raises if an update failed
        if callers:
            done, callers = await asyncio.wait(callers)
            state.collect(done)
    finally:
        for task in (updater, *callers):
            task.cancel()
        await asyncio.gather(updater, *callers, return_exceptions=True)


def _check_quiet(
    manager: AsyncServerManager, engines: Sequence[VLLMEngine], pushed: int | None, updates: int
) -> list[str]:
    """Nothing in flight anywhere; every engine serving, at the last version."""
    problems = []
    stats = manager.statistics()
    if stats.in_flight or stats.updating:
        problems.append(f"manager not quiet: {stats}")
    if stats.num_updates != updates or manager.global_steps != pushed:
        problems.append(f"manager: {stats.num_updates} updates, global_steps {stats.global_steps}"
                        f" (expected {updates}, {pushed})")
    for engine in engines:
        s = engine.statistics()
        unfinished = engine.num_unfinished_in_vllm()
        if s.in_flight or unfinished or s.paused or s.holding or s.dead or s.asleep:
            problems.append(f"{engine.name} not quiet: {s}, {unfinished} unfinished in vLLM")
        if engine.global_steps != pushed:
            problems.append(f"{engine.name} at global_steps {engine.global_steps}, not {pushed}")
    return problems


def _check_resources(
    before: Resources, after: Resources, nonces: set[str], rss_slack: float,
    engines_rss_slack: float, shm_slack: int,
) -> list[str]:
    problems = [f"transport leftover: {item}" for item in leftovers(nonces)]
    if after.rss_own - before.rss_own > rss_slack:
        problems.append(f"RSS grew {_mib(after.rss_own - before.rss_own)} MiB")
    if after.rss_children - before.rss_children > engines_rss_slack:
        problems.append(f"children's RSS grew {_mib(after.rss_children - before.rss_children)} MiB"
                        f" ({_growth(before, after)})")
    new_shm = new_shm_entries(before, after)
    if len(new_shm) > shm_slack:
        problems.append(f"{len(new_shm)} new /dev/shm entries of ours: "
                        f"{new_shm[:20]}")
    if after.transport_sockets > before.transport_sockets:
        problems.append(f"transport socket files {before.transport_sockets} -> "
                        f"{after.transport_sockets}")
    return problems


def _growth(before: Resources, after: Resources) -> str:
    """Per process of ours, how far its RSS moved (MiB), largest first."""
    moved = {
        name: after.rss_by_process[name] - before.rss_by_process.get(name, 0)
        for name in after.rss_by_process
    }
    return ", ".join(f"{name} {_mib(delta)}" for name, delta in
                     sorted(moved.items(), key=lambda kv: -abs(kv[1]))[:4])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:+.1f}"


# -- the script ------------------------------------------------------------------------------


def summary(result: SoakResult, label: str = "") -> str:
    """A few lines a person reads: counts, rates, update times, resources, failures."""
    r, before, after = result, result.before, result.after
    assert before is not None and after is not None
    slowest = r.stages[r.update_seconds.index(max(r.update_seconds))] if r.stages else {}
    lines = [
        f"== {label or r.mode}: {'ok' if r.ok else f'FAILED ({len(r.failures)} checks)'}",
        f"updates {r.updates} (every {r.interval} s), callers {r.started} "
        f"({r.concurrency} in flight): {r.completed} completed, {r.cancelled} cancelled "
        f"({r.cancel_missed} marked but completed first), {r.errors} errors",
        f"resumed segments (num_preempted) {r.num_preempted}, re-prefilled tokens "
        f"{r.num_reprefill_tokens}, outputs spanning versions {r.spanning}",
        f"tokens {r.tokens} in {r.wall_seconds:.1f} s: {r.tokens_per_s:.0f} tokens/s",
        f"update ms p50 {r.update_ms(.5):.0f}, p99 {r.update_ms(.99):.0f}, "
        f"max {max(r.update_seconds, default=0) * 1e3:.0f}; stage p50 ms "
        + ", ".join(f"{k} {_quantile([s[k] for s in r.stages], .5) * 1e3:.0f}" for k in slowest)
        + "; slowest: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in slowest.items()),
        f"RSS own {before.rss_own / 2**20:.0f} -> {after.rss_own / 2**20:.0f} MiB, "
        f"children {before.rss_children / 2**20:.0f} -> {after.rss_children / 2**20:.0f} MiB "
        f"({_growth(before, after)})",
        f"/dev/shm entries {len(before.shm_entries)} -> {len(after.shm_entries)} "
        f"(new ones of ours: {len(new_shm_entries(before, after))}), transport dirs "
        f"{before.transport_dirs} -> {after.transport_dirs}, sockets "
        f"{before.transport_sockets} -> {after.transport_sockets}",
    ]
    lines += [f"  FAILED: {f}" for f in r.failures[:20]]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Start 2 engines on two tiny models and soak them in each mode; the raw results."""
    from safetensors.torch import load_file

    from asyncroll.testing import make_tiny_model

    modes: list[ResumeMode] = [m for m in args.modes.split(",") if m in ("abort", "keep")]
    with tempfile.TemporaryDirectory() as folder:
        models = [make_tiny_model(Path(folder) / f"m{s}", seed=s) for s in (0, 1)]
        weights = [load_file(str(m / "model.safetensors")) for m in models]
        print("starting 2 engines...", flush=True)
        async with (
            VLLMEngine.launch(models[0], name="soak-0", **ENGINE_ARGS) as e0,
            VLLMEngine.launch(models[1], name="soak-1", **ENGINE_ARGS) as e1,
        ):
            results = []
            if args.warmup_updates:
                # The engines' workers grow by a few hundred MiB the first times they decode a
                # large batch and with new prefill shapes (oneDNN's primitive cache; see the
                # module docstring), so the RSS baselines are taken after a short soak.
                warmup = await soak(
                    [e0, e1], weights, mode="abort", updates=args.warmup_updates,
                    interval=args.interval, concurrency=args.concurrency, seed=args.seed + 1,
                    max_tokens=(8, 64), rss_slack_mib=math.inf, engine_rss_slack_mib=math.inf,
                    progress=print_flush,
                )
                print(summary(warmup, "warm-up (abort, short outputs)"), flush=True)
                results.append(warmup)
            start = take_resources()
            for mode in modes:
                result = await soak(
                    [e0, e1], weights, mode=mode, updates=args.updates, interval=args.interval,
                    concurrency=args.concurrency, seed=args.seed,
                    rss_slack_mib=args.rss_slack_mib,
                    engine_rss_slack_mib=args.engine_rss_slack_mib, progress=print_flush,
                )
                print(summary(result), flush=True)
                results.append(result)
            end = take_resources()
    print(f"whole run: RSS own {start.rss_own / 2**20:.0f} -> {end.rss_own / 2**20:.0f} MiB, "
          f"children {start.rss_children / 2**20:.0f} -> {end.rss_children / 2**20:.0f} MiB")
    return {
        "ok": all(r.ok for r in results) and len(modes) > 0,
        "args": vars(args),
        "results": [r.as_json() for r in results],  # the warm-up first, if any
        "start": dataclasses.asdict(start),
        "end": dataclasses.asdict(end),
    }


def print_flush(line: str) -> None:
    print(line, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--interval", type=float, default=0.3,
                        help="seconds from one update's return to the next update's start")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--modes", default="abort,keep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-slack-mib", type=float, default=64.0,
                        help="how far this process's RSS may end above the start")
    parser.add_argument("--engine-rss-slack-mib", type=float, default=192.0,
                        help="how far the engine processes' RSS may end above it, per engine")
    parser.add_argument("--warmup-updates", type=int, default=5,
                        help="updates of the warm-up soak before the RSS baseline (0: none)")
    parser.add_argument("--json", metavar="PATH", help="write the raw results here")
    return parser.parse_args(argv)


if __name__ == "__main__":  # vLLM's CPU build spawns processes: the guard is required
    arguments = parse_args()
    raw = asyncio.run(main(arguments))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(raw, indent=1) + "\n")
    print("soak: all checks passed" if raw["ok"] else "soak: FAILED", flush=True)
    sys.exit(0 if raw["ok"] else 1)
