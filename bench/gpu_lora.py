"""LoRA adapters pushed through asyncroll into vLLM's LoRA: correctness, push time, rollout.

Sections (``--sections``; default all), results appended to ``OUT/gpu_lora.json``:

- ``correctness``: an engine on a small random Qwen2 (a real checkpoint) takes a pushed
  adapter; its greedy outputs must equal vLLM's own with the same adapter loaded from a PEFT
  folder, token for token, and differ from the base model's.
- ``push``: the ``--size`` shape (7b: Qwen2.5-7B, ``load_format="dummy"``), a rank-``--rank``
  adapter on every linear layer, bf16. ``update_adapter`` on an idle engine, median of
  ``--repeats``, against the one-copy limit (the adapter's bytes at the device's measured copy
  rate) and vLLM's own path (``add_lora`` from a PEFT folder in /dev/shm, what peers do).
- ``push-one-copy`` (CUDA): the same, the workers reading the trainer's pack in place
  (``WeightPusher(one_copy=True)``: no staging copy, no bucket pipeline).
- ``rollout`` (on the push section's engine): ``--callers`` concurrent calls under the adapter
  over a fixed job list, with no pushes and with a push every ``--interval`` s, ``--rounds``
  times in turn: tokens/s and its ratio, and each push's time under load. A later revision
  lands on the workers' own threads and its registration is queued
  (``AsyncServerManager.land_adapters``); each round also runs the pushes the step loop's way
  (one RPC that waits for the step in progress), the baseline, in the same round.
  ``--window S [--warm W]``: runs of a fixed time, the tokens made
  inside the window counted (no tail of a few long calls ending a run).

On a machine without CUDA it runs on the CPU build with the tiny model (``--size tiny``), a dry
run of the same code.

    python bench/gpu_lora.py --out /tmp/out --size 7b --rank 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch
from gpu_e2e import PROBES, SHAPES, Results, log, write_config

from asyncroll import AsyncServerManager, VLLMEngine, WeightPusher
from asyncroll.adapters import AdapterConfig
from asyncroll.testing import make_tiny_model, vllm_client
from asyncroll.testing.lora import random_adapter, write_peft_adapter

CUDA = torch.cuda.is_available()
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
MiB = 1 << 20
SHM = Path("/dev/shm")


REVISIONS = 4
"""Revisions an engine holds (``--revisions``)."""


def engine_args(rank: int, **extra: Any) -> dict[str, Any]:
    # As many revisions a step as held: calls pinned to older revisions are never held back
    # by the scheduler's limit of distinct LoRAs a step.
    args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": rank, "max_loras": REVISIONS,
                            "max_cpu_loras": REVISIONS, "max_model_len": 4096}
    if CUDA:
        args |= {"enforce_eager": True, "async_scheduling": False,
                 "gpu_memory_utilization": 0.5, "dtype": "bfloat16"}
    else:
        args |= {"max_model_len": 1024, "skip_tokenizer_init": True}
    return args | extra


def copy_rate_gbs() -> float:
    """Best rate of one 1 GiB copy on the device (the host's memcpy on CPU)."""
    device = "cuda" if CUDA else "cpu"
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if CUDA:
            torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        if CUDA:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return (1 << 30) / best / 1e9


def probes(vocab_size: int) -> list[list[int]]:
    return [[t % vocab_size for t in prompt] for prompt in PROBES]


async def greedy(manager: AsyncServerManager, adapter: str | None, tag: str) -> list[tuple]:
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    vocab = manager.engines[0].vocab_size
    results = await asyncio.gather(*(
        manager.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=params, adapter=adapter)
        for i, p in enumerate(probes(vocab))))
    return [r.token_ids for r in results]


async def vllms_own(engine: VLLMEngine, folder: Path, lora_id: int) -> list[tuple]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    request = LoRARequest(f"peft-{lora_id}", lora_id, str(folder))
    found = []
    for i, prompt in enumerate(probes(engine.vocab_size)):
        last = None
        async for out in vllm_client(engine).generate(
            TokensPrompt(prompt_token_ids=prompt),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            f"peft-{lora_id}-{i}", lora_request=request,
        ):
            last = out
        assert last is not None
        found.append(tuple(last.outputs[0].token_ids))
    return found


async def correctness(res: Results, work: Path) -> None:
    s = "correctness"
    model = make_tiny_model(work / "small", **(SMALL if CUDA else {}), init_std=0.05)
    config = AdapterConfig(rank=16, alpha=32)
    tensors = random_adapter(model, config, seed=1, scale=0.3,
                             device="cuda" if CUDA else "cpu")
    async with VLLMEngine.launch(model, name="lora-small", **engine_args(16)) as engine:
        async with AsyncServerManager([engine]) as manager:
            base = await greedy(manager, None, "base")
            report = await manager.update_adapter("a", tensors, config=config, global_steps=1)
            pushed = await greedy(manager, "a", "pushed")
            reference = await vllms_own(engine, write_peft_adapter(work / "peft", tensors,
                                                                   config), 900)
            res.check(s, "pushed adapter == vLLM's own from a PEFT folder", pushed == reference,
                      {"pushed": pushed[:2], "vllm": reference[:2]})
            res.check(s, "the adapter changes the outputs", pushed != base)
            res.check(s, "every tensor verified",
                      report.deliveries[engine.name].verified == len(tensors))
            # The same tensors again until a revision is replayed into a slot vLLM's own
            # activation wrote (and recorded) before: the same outputs.
            ways = [engine.adapters.last_registration]
            for step in range(2, REVISIONS + 3):
                await manager.update_adapter("a", tensors, config=config, global_steps=step)
                ways.append(engine.adapters.last_registration)
            replayed = await greedy(manager, "a", "replayed")
            res.check(s, "a replayed revision == vLLM's own from a PEFT folder",
                      ways[-1] == "replayed" and replayed == reference, {"ways": ways})
            res.check(s, "base outputs unchanged", await greedy(manager, None, "again") == base)


def timeline(called: float, returned: float, report: Any,
             worker: dict[str, float]) -> dict[str, float]:
    """Where one push's time went, as milliseconds from the call: the manager's steps, the
    sender's (``PushReport``) and the first worker's stamps (one clock for the host)."""
    stamps = getattr(report, "stamps", None) or {}
    at: dict[str, float] = (
        {f"manager {name}": stamp - called for name, stamp in stamps.items()} if stamps
        else {"manager packed": report.check_seconds + report.pack_seconds}  # (trees before)
    )
    push = report.push
    if push is not None and push.began:
        at["sender began"] = push.began - called
        if push.timeline:
            first = push.timeline[0]
            at["sender copied"] = first.copied - called
            at["sender signalled"] = first.signalled - called
        if push.ended:
            at["sender ended"] = push.ended - called
    for name, stamp in worker.items():
        if stamp:
            at[f"worker {name}"] = stamp - called
    at["returned"] = returned - called
    return {f"at {k} ms": v * 1e3 for k, v in at.items()}


async def idle_pushes(res: Results, s: str, manager: AsyncServerManager, e: VLLMEngine,
                      adapters: list[dict[str, torch.Tensor]], config: AdapterConfig,
                      repeats: int) -> dict[str, Any]:
    """Pushes into the idle engine, the manager's way (``land_adapters``): the median of the
    replayed ones, with their timeline."""
    label = "asyncroll idle" if manager.land_adapters else "asyncroll idle (step loop)"
    runs: list[dict[str, float]] = []
    ways: list[str] = []
    last = manager.adapters.get("a")
    first = last.global_steps + 1 if last is not None and last.global_steps is not None else 0
    for i in range(repeats + REVISIONS + 1):  # the first attaches the transport
        called = time.perf_counter()
        report = await manager.update_adapter("a", adapters[i % 2], config=config,
                                              global_steps=first + i)
        returned = time.perf_counter()
        if "verdicts" in report.stamps:  # landed: its registration answers later
            await e.adapters.registered_last()
        runs.append({"ms": report.seconds * 1e3, "call ms": (returned - called) * 1e3,
                     "check ms": report.check_seconds * 1e3,
                     "pack ms": report.pack_seconds * 1e3,
                     "push ms": report.push_seconds * 1e3}
                    | {f"worker {k} ms": v * 1e3 for k, v in e.adapters.last_seconds.items()}
                    | timeline(called, returned, report, e.adapters.last_stamps))
        ways.append(e.adapters.last_registration)
    # The first pushes to each slot go through vLLM's activation (recorded); the median of
    # the later ones, replayed, is the push's steady figure.
    steady = [r for r, way in zip(runs[1:], ways[1:], strict=True) if way == "replayed"]
    vllms = [r for r, way in zip(runs[1:], ways[1:], strict=True) if way == "vllm"]
    chosen = steady or runs[1:]
    idle: dict[str, Any] = {k: round(statistics.median(r[k] for r in chosen if k in r), 3)
                            for k in dict.fromkeys(k for r in chosen for k in r)}
    idle["first (attach) ms"] = round(runs[0]["ms"], 1)
    idle["registered"] = ways
    if vllms:
        idle["through vLLM's activation ms (median)"] = round(
            statistics.median(r["call ms"] for r in vllms), 3)
    res.record(s, label, idle)
    log(f"{s} {label}: {idle['call ms']:.2f} ms; timeline (ms from the call): " + ", ".join(
        f"{k[3:-3]} {v:.2f}" for k, v in idle.items() if k.startswith("at ")))
    return idle


async def push(res: Results, work: Path, size: str, rank: int, repeats: int,
               then: Any = None, one_copy: bool = False) -> None:
    """The idle push, then (``then(manager, folder)``) the rollout on the same engine.
    ``one_copy``: the workers read the trainer's pack in place (CUDA IPC, no staging)."""
    s = f"push {size} rank {rank}" + (" one-copy" if one_copy else "")
    if size == "tiny":
        folder = make_tiny_model(work / "tiny")
        extra: dict[str, Any] = {}
    else:
        folder = write_config(work / size, SHAPES[size])
        extra = {"load_format": "dummy"}
    config = AdapterConfig(rank=rank, alpha=2 * rank)
    device = "cuda" if CUDA else "cpu"
    adapters = [random_adapter(folder, config, seed=i, device=device) for i in range(2)]
    nbytes = sum(t.numel() * t.element_size() for t in adapters[0].values())
    rate = copy_rate_gbs()
    limit_ms = nbytes / rate / 1e6
    res.record(s, "payload", {"MiB": round(nbytes / MiB, 1), "tensors": len(adapters[0]),
                              "copy GB/s": round(rate, 1), "one-copy limit ms": round(limit_ms, 3)})
    log(f"{s}: {nbytes / MiB:.0f} MiB in {len(adapters[0])} tensors; limit {limit_ms:.3f} ms")
    async with VLLMEngine.launch(folder, name=f"lora-{size}", **engine_args(rank, **extra)) as e:
        pusher = WeightPusher([e], one_copy=True) if one_copy else None
        async with AsyncServerManager([e], weights=pusher) as manager:
            manager.land_adapters = False  # the baseline first: the landing's first attaches
            await idle_pushes(res, s, manager, e, adapters, config, repeats)
            manager.land_adapters = True
            idle = await idle_pushes(res, s, manager, e, adapters, config, repeats)
            ms = idle["call ms"]  # the whole await, as a trainer sees it
            # vLLM's own path: the adapter written once as a PEFT folder on tmpfs, then add_lora.
            shm = SHM if SHM.is_dir() else work  # noqa: ASYNC240 (a stat, once)
            peft = write_peft_adapter(Path(tempfile.mkdtemp(dir=shm)), adapters[0], config)
            from vllm.lora.request import LoRARequest

            own = []
            try:
                for i in range(3):
                    started = time.perf_counter()
                    await vllm_client(e).add_lora(LoRARequest(f"own-{i}", 5000 + i, str(peft)))
                    own.append((time.perf_counter() - started) * 1e3)
                    await vllm_client(e).remove_lora(5000 + i)
            finally:
                for file in peft.iterdir():
                    file.unlink()
                peft.rmdir()
            res.record(s, "vllm add_lora from /dev/shm ms", round(statistics.median(own), 2))
            res.record(s, "ratios", {"asyncroll / limit": round(ms / limit_ms, 1),
                                     "vllm add_lora / asyncroll": round(statistics.median(own)
                                                                        / ms, 1)})
            log(f"{s}: asyncroll {ms:.2f} ms (check {idle['check ms']:.2f}, pack"
                f" {idle['pack ms']:.2f}, push {idle['push ms']:.2f}), vLLM add_lora"
                f" {statistics.median(own):.1f} ms, limit {limit_ms:.3f} ms")
            if then is not None:
                await then(manager, folder)
        if pusher is not None:
            await pusher.aclose()


async def rollout(res: Results, manager: AsyncServerManager, folder: Path, label: str,
                  rank: int, callers: int, requests: int, interval: float,
                  rounds: int, window: float = 0.0, warm: float = 0.0,
                  spread: int = 0) -> None:
    """Calls under the adapter, with no pushes and with a push every ``interval`` s.

    ``window`` > 0: each run lasts a fixed time instead of a fixed job list: the callers go
    round the job list until ``warm + window`` seconds have passed, and the run's tokens are
    those produced inside the window ``[warm, warm + window)``, each call's tokens counted
    in proportion to the part of its span inside it (as if made at an even rate): no run
    ends on a tail of a few long calls, which made the job-list runs differ by 12% with no
    pushes at all (session 33)."""
    s = f"rollout {label} rank {rank}"
    config = AdapterConfig(rank=rank, alpha=2 * rank)
    device = "cuda" if CUDA else "cpu"
    adapters = [random_adapter(folder, config, seed=i, device=device) for i in range(2)]
    rng = random.Random(0)
    vocab = manager.engines[0].vocab_size
    jobs = [([rng.randrange(2, min(500, vocab)) for _ in range(rng.randrange(16, 64))],
             rng.randrange(64, 256)) for _ in range(requests)]
    res.record(s, "workload", {"requests": requests, "callers": callers,
                               "tokens": sum(n for _, n in jobs), "push every s": interval})
    for name in manager.adapters:  # the push section's: room for the spread's
        await manager.remove_adapter(name)
    await manager.update_adapter("r", adapters[0], config=config, global_steps=0)
    steps = iter(range(1, 1 << 30))

    async def run(pushing: bool, spread: int = 0, step_loop: bool = False) -> dict[str, Any]:
        """``spread``: no pushes, but each call under one of that many adapters pushed once
        before (the LoRA batch of a run with pushes, whose calls keep the revisions they
        started on, without the pushes). ``step_loop``: the pushes go the step loop's way
        (``land_adapters=False``)."""
        manager.land_adapters = not step_loop
        queue = list(jobs)
        engine = manager.engines[0]
        later: list[float] = []
        timelines: list[dict[str, float]] = []
        names = [f"s{i}" for i in range(spread)] or ["r"]
        for i, name in enumerate(names if spread else ()):
            await manager.update_adapter(name, adapters[i % 2], config=config, global_steps=0)
        pushes: list[float] = []
        waits: list[float] = []
        done = asyncio.Event()
        began = time.perf_counter()
        opens, closes = began + warm, began + warm + window
        spans: list[tuple[float, float, int]] = []

        async def caller(first: int = 0) -> int:
            tokens, turn = 0, first
            while (time.perf_counter() < closes) if window > 0 else queue:
                if window > 0:
                    prompt, n = jobs[turn % len(jobs)]
                    turn += callers
                else:
                    prompt, n = queue.pop()
                called = time.perf_counter()
                out = await manager.generate(
                    f"r{next(steps)}", prompt_ids=prompt, adapter=names[turn % len(names)],
                    sampling_params={"max_tokens": n, "ignore_eos": True, "temperature": 1.0})
                tokens += len(out.token_ids)
                spans.append((called, time.perf_counter(), len(out.token_ids)))
            return tokens

        async def pusher() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), interval)
                if done.is_set():
                    return
                step = next(steps)
                called = time.perf_counter()
                report = await manager.update_adapter(
                    "r", adapters[step % 2], config=config, global_steps=step)
                returned = time.perf_counter()
                if not report.waited_seconds:  # (one that waited for room says nothing here)
                    timelines.append(timeline(called, returned, report, {}))
                pushes.append(report.seconds * 1e3)
                waits.append(report.waited_seconds * 1e3)
                if "verdicts" in report.stamps:  # when its queued registration ran
                    answers = await engine.adapters.registered_last()
                    if answers and isinstance(answers[0], dict):
                        later.append((answers[0]["stamps"]["registered"] - returned) * 1e3)

        started = time.perf_counter()
        push_task = asyncio.ensure_future(pusher()) if pushing else None
        tokens = sum(await asyncio.gather(*(caller(i) for i in range(callers))))
        seconds = time.perf_counter() - started
        done.set()
        if push_task is not None:
            await push_task
        for name in names if spread else ():
            await manager.remove_adapter(name)
        found: dict[str, Any] = {"tokens/s": round(tokens / seconds, 1),
                                 "seconds": round(seconds, 2)}
        if window > 0:  # the window's share of each call's tokens
            inside = sum(n * max(0.0, min(end, closes) - max(call, opens)) / (end - call)
                         for call, end, n in spans if end > call)
            found = {"tokens/s": round(inside / window, 1), "window s": window,
                     "calls": len(spans), "seconds": round(seconds, 2)}
        if pushes:
            found |= {"pushes": len(pushes),
                      "push ms median": round(statistics.median(pushes), 2),
                      "push ms max": round(max(pushes), 2),
                      "waited for room ms max": round(max(waits), 2)}
        if timelines:
            found["timeline under load (median ms from the call)"] = {
                k: round(statistics.median(t[k] for t in timelines if k in t), 3)
                for k in dict.fromkeys(k for t in timelines for k in t)}
        if later:
            found |= {"registered after the return ms median":
                      round(statistics.median(later), 2),
                      "registered after the return ms max": round(max(later), 2)}
        manager.land_adapters = True
        return found

    await run(False)  # warm-up
    table = []
    for number in range(rounds):
        row: dict[str, Any] = {"none": await run(False), "push": await run(True),
                               "push (step loop)": await run(True, step_loop=True)}
        row["ratio"] = round(row["push"]["tokens/s"] / row["none"]["tokens/s"], 3)
        row["step loop ratio"] = round(
            row["push (step loop)"]["tokens/s"] / row["none"]["tokens/s"], 3)
        if spread:
            row[f"{spread} adapters, no push"] = await run(False, spread)
            row["spread ratio"] = round(
                row[f"{spread} adapters, no push"]["tokens/s"] / row["none"]["tokens/s"], 3)
        log(f"{s} round {number + 1}: {row}")
        table.append(row)
        res.record(s, "rounds", table)
    res.record(s, "ratio median", statistics.median(r["ratio"] for r in table))
    res.record(s, "step loop ratio median",
               statistics.median(r["step loop ratio"] for r in table))
    res.record(s, "push ms median of medians", {
        way: statistics.median(r[way]["push ms median"] for r in table
                               if "push ms median" in r[way])
        for way in ("push", "push (step loop)")})
    if spread:
        res.record(s, "spread ratio median",
                   statistics.median(r["spread ratio"] for r in table))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--sections", default="correctness,push,rollout")
    parser.add_argument("--size", default="7b" if CUDA else "tiny")
    parser.add_argument("--rank", type=int, default=64 if CUDA else 8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--callers", type=int, default=256 if CUDA else 16)
    parser.add_argument("--requests", type=int, default=1024 if CUDA else 64)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, default=0.0,
                        help="s: runs of a fixed time, tokens counted inside the window"
                             " (0: each run goes through the job list once)")
    parser.add_argument("--warm", type=float, default=0.0,
                        help="s before the window opens (with --window)")
    parser.add_argument("--spread", type=int, default=0,
                        help="each round also runs calls spread over this many adapters,"
                             " pushed once, with no pushes: the LoRA batch without them")
    parser.add_argument("--revisions", type=int, default=4,
                        help="revisions an engine holds (max_loras = max_cpu_loras): calls"
                             " outliving more pushes than this make a push wait")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> int:
    global REVISIONS
    REVISIONS = args.revisions
    args.out.mkdir(parents=True, exist_ok=True)
    res = Results(args.out, "gpu_lora.json")
    res.record("env", "revisions held", REVISIONS)
    res.record("env", "device", torch.cuda.get_device_name() if CUDA else "cpu")
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        def then(manager: AsyncServerManager, folder: Path) -> Any:
            return rollout(res, manager, folder, args.size, args.rank, args.callers,
                           args.requests, args.interval, args.rounds, args.window, args.warm,
                           args.spread)

        steps = {
            "correctness": lambda: correctness(res, work),
            "push": lambda: push(res, work, args.size, args.rank, args.repeats,
                                 then if "rollout" in sections else None),
            "push-one-copy": lambda: push(res, work, args.size, args.rank, args.repeats,
                                          one_copy=True),
        }
        for name in sections:
            if name == "rollout":
                continue  # on the push's engine
            started = time.perf_counter()
            log(f"== {name}")
            try:
                await steps[name]()
            except Exception:
                res.check(name, "ran to the end", False, traceback.format_exc()[-3000:])
            log(f"== {name}: {time.perf_counter() - started:.0f} s")
    log(json.dumps(res.data, indent=1, default=str)[-5000:])
    log(f"{res.failed} checks failed")
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
