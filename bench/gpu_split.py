"""The split layout on GPUs: a sharded trainer's ranks feeding engines on other GPUs, each rank
through a push group of its own (``DistributedWeightPusher(backend="broadcast")``).

    torchrun --nproc-per-node 2 bench/gpu_split.py --out $OUT/split [--sizes 1.5b,7b]

Rank r holds half of every tensor (``DTensor``, ``Shard(0)``, as FSDP2 keeps parameters) on
GPU r. NCCL takes one rank a GPU in a group, so an engine's worker must sit on another GPU than
the rank that serves it (worker ``i`` is served by rank ``i % world``). With as many GPUs as
trainer ranks (two), the layouts are:

- one engine (TP=1) on GPU 1, its worker served by rank 0 (GPU 0): every byte crosses NVLink
  from GPU 0 to GPU 1; rank 1 serves nobody and only joins the gathers;
- two engines (TP=1): engine 0 on GPU 1 served by rank 0, engine 1 on GPU 0 served by rank 1:
  each rank feeds its own engine, the two pushes cross NVLink in opposite directions at once.

On four GPUs (``--engine-gpus 2,3``) the trainer's ranks sit on GPUs 0-1 and the engines on
2-3, apart: ``--layouts tp1`` runs one TP=1 engine on GPU 2, then two (GPUs 2 and 3), and
``tp2`` one TP=2 engine across GPUs 2-3 (worker r served by rank r). In each layout, each of
``--fan-in`` in turn: ``no``, each rank pushes to the workers it serves (gathering what they
read whole), and ``yes`` (``fan_in=True``), every worker joins every rank's push group and each
rank sends only its own rows, with no gather. ``fan_in`` needs every worker on a GPU of no
trainer rank: it does not run on two GPUs.

Per size and pusher: correctness (1.5B: the engines start on weights A from disk; after a push
of B their greedy outputs differ, after a push of A they equal each engine's fresh outputs), the
update time (median of ``--repeats``, after a warm-up), then a push of A that every engine must
serve (per-worker parameter sums: a norm whole on every worker, o_proj summed over an engine's
workers); and in the same run the limits: NCCL's broadcast of the model's bytes from GPU 0 to
GPU 1 (the link), and the gathers alone (every tensor all-gathered over the two ranks, which a
TP=1 engine needs: it reads every row). Ratios: each update over link + gathers (without
fan_in); the rate each receiving GPU reached (the bytes it received over the update time)
over the link's (the issue's target: 0.85); two engines over one (flat is 1.0: the engines
are fed in parallel).

Prints a table and writes OUT/gpu_split.json (rank 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_e2e import GiB, engine_args, greedy
from gpu_multi import (
    gather_ms,
    served,
    served_expected,
    serves_all,
    sharded_pair,
    timed_pushes,
)

from asyncroll import DistributedWeightPusher, VLLMEngine
from asyncroll.distributed import torchrun_hidden


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


@contextlib.asynccontextmanager
async def engine_on(gpu_list: list[int], folder: Path, **options: Any) -> Any:
    """An engine on physical GPUs ``gpu_list`` (rank 0 holds every engine)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    with torchrun_hidden():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_list))
        try:
            launching = VLLMEngine.launch(folder, **options)
            engine = await launching.__aenter__()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        yield engine
    finally:
        await launching.__aexit__(None, None, None)


def link_ms(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """NCCL broadcast of ``nbytes`` from rank 0 (GPU 0) to rank 1 (GPU 1), in 1 GiB pieces
    (the push's bucket), median of ``repeats``."""
    piece = torch.empty(min(nbytes, GiB), dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        left = nbytes
        while left > 0:
            dist.broadcast(piece[: min(left, piece.numel())], src=0)
            left -= piece.numel()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    ms = statistics.median(times[1:])
    return {"ms": round(ms, 2), "GB/s": round(nbytes / ms / 1e6, 1)}


async def pushes(pusher: Any, engines: list[Any], weights_a: dict[str, torch.Tensor],
                 weights_b: dict[str, torch.Tensor], expected_a: dict[str, Any],
                 steps: Iterator[int], repeats: int, link: dict[str, float],
                 limit: float | None, fan_in: bool) -> dict[str, Any]:
    """One pusher's timed pushes of B, then a push of A that every engine must serve (the
    per-worker digests), and the rate each receiving GPU reached against the link's."""
    found = await timed_pushes(pusher, weights_b, steps, repeats)
    await pusher.update(weights_a, global_steps=next(steps))
    if dist.get_rank() == 0:
        found["serves A after its push"] = [await served(e, expected_a) for e in engines]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, found)
    found["per rank"] = ranks
    moved = [r["GiB moved (this rank)"] for r in ranks]
    # A receiving GPU gets every rank's bytes with fan_in (each rank sends its rows to every
    # worker), else its own rank's.
    received = sum(moved) if fan_in else max(moved)
    found["GiB received a GPU"] = round(received, 3)
    rate = received * GiB / (found["update_ms"] / 1e3) / 1e9
    found["GB/s received a GPU"] = round(rate, 1)
    found["link rate reached"] = round(rate / link["GB/s"], 3)
    if limit is not None:
        found["vs limit (link + gathers)"] = round(found["update_ms"] / limit, 3)
    return found


async def split(size: str, work: Path, out: dict[str, Any], steps: Iterator[int],
                engine_gpus: list[int], repeats: int, layouts: list[str],
                fan_ins: list[bool], save: Any) -> None:
    rank = dist.get_rank()
    correctness = size == "1.5b"
    folder, weights_a, weights_b, nbytes = sharded_pair(size, work, correctness)
    section: dict[str, Any] = out.setdefault(f"{size} split", {"GiB": round(nbytes / GiB, 3)})
    section["link (GPU 0 -> GPU 1, NCCL broadcast) "] = link = link_ms(nbytes)
    section["gathers only ms"] = gathers = gather_ms(weights_b)
    limit = link["ms"] + gathers["ours"]
    section["limit ms (link + gathers)"] = round(limit, 2)
    log(f"{size}: {nbytes / GiB:.2f} GiB; link {link}; gathers {gathers}")
    expected_a = served_expected(weights_a)  # a collective: every rank, same order
    options = engine_args(gpu_memory_utilization=0.3 if size != "7b" else 0.35)
    if not correctness:
        options["load_format"] = "dummy"
    checks: dict[str, bool] = {}
    # (layout, engines' GPU lists): TP=1 engines one then two; one TP=2 engine across two GPUs.
    plans: list[tuple[str, list[list[int]]]] = []
    if "tp1" in layouts:
        plans += [("1 engine", [engine_gpus[:1]]),
                  ("2 engines", [engine_gpus[:1], engine_gpus[1:2]])]
    if "tp2" in layouts:
        plans += [("1 engine TP=2", [engine_gpus[:2]])]
    async with contextlib.AsyncExitStack() as outer:
        engines: list[Any] = []
        for label, plan in plans:
            if len(plan) < len(engines) or (engines and len(plan[0]) != 1):
                await outer.aclose()  # a layout of other engines: close the ones running
                engines = []
            began = time.perf_counter()
            if rank == 0:
                for gpu_list in plan[len(engines):]:
                    name = f"split-{size}-{len(engines) + 1}-tp{len(gpu_list)}"
                    engines.append(await outer.enter_async_context(engine_on(
                        gpu_list, folder, name=name, tensor_parallel_size=len(gpu_list),
                        **options)))
            else:
                engines = [None] * len(plan)
            dist.barrier()
            log(f"{size} {label}: engines up in {time.perf_counter() - began:.0f} s")
            served_engines = [e for e in engines if e is not None]
            fresh = ([await greedy(e, f"fresh-{label}") for e in served_engines]
                     if correctness else None)
            for fan_in in fan_ins:
                variant = f"{label}{', fan_in' if fan_in else ''}"
                pusher = DistributedWeightPusher(served_engines, backend="broadcast",
                                                 timeout=120, fan_in=fan_in)
                try:
                    if fresh is not None:
                        await pusher.update(weights_b, global_steps=next(steps))
                        on_b = [await greedy(e, f"on-b-{variant}") for e in served_engines]
                        await pusher.update(weights_a, global_steps=next(steps))
                        on_a = [await greedy(e, f"on-a-{variant}") for e in served_engines]
                        if rank == 0:
                            checks[f"{variant}: B differs from the fresh A"] = all(
                                b != a for b, a in zip(on_b, fresh, strict=True))
                            checks[f"{variant}: A pushed back equals the fresh engine on A"] = (
                                on_a == fresh)
                    found = await pushes(pusher, served_engines, weights_a, weights_b,
                                         expected_a, steps, repeats, link,
                                         None if fan_in else limit, fan_in)
                finally:
                    await pusher.aclose()
                if rank == 0:
                    checks[f"{variant}: every engine serves A after its push"] = all(
                        serves_all(seen) for seen in found.get("serves A after its push", []))
                section[variant] = found
                log(f"{size} {variant}: "
                    f"{ {k: v for k, v in found.items() if k != 'per rank'} }")
                save()
        for suffix in ("", ", fan_in"):
            one, two = section.get(f"1 engine{suffix}"), section.get(f"2 engines{suffix}")
            if one and two:
                section[f"2 engines vs 1{suffix}"] = round(two["update_ms"] / one["update_ms"], 3)
    if checks:
        section["checks"] = checks
        log(f"{size} checks: {checks}")
    save()
    del weights_a, weights_b
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="1.5b,7b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-gpus", default="1,0",
                        help="the GPUs of engine 0 and engine 1 (engine i served by rank i)")
    parser.add_argument("--layouts", default="tp1",
                        help="tp1: TP=1 engines, one then two; tp2: one TP=2 engine on the "
                             "first two engine GPUs (only where no trainer rank is on them)")
    parser.add_argument("--fan-in", default="no,yes",
                        help="the pushers to run in each layout: without fan_in (no), with (yes)")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    fan_in_words = args.fan_in.split(",")
    if unknown := [w for w in layouts if w not in ("tp1", "tp2")]:
        parser.error(f"unknown layouts {unknown}: tp1, tp2")
    if unknown := [w for w in fan_in_words if w not in ("no", "yes")]:
        parser.error(f"unknown --fan-in values {unknown}: no, yes")
    engine_gpus = [int(g) for g in args.engine_gpus.split(",")]
    world = int(os.environ["WORLD_SIZE"])
    if "tp2" in layouts and set(engine_gpus[:2]) & set(range(world)):
        parser.error("tp2 needs engine GPUs apart from the trainer's (NCCL: one rank a GPU)")
    fan_ins = [word == "yes" for word in fan_in_words]
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "engine GPUs": engine_gpus, "ranks": dist.get_world_size()}
    out["command"] = " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv])
    steps = iter(range(1, 10**6))
    started = time.perf_counter()

    def save() -> None:
        if rank == 0:
            (args.out / "gpu_split.json").write_text(json.dumps(out, indent=1))

    for size in args.sizes.split(","):
        await split(size, work, out, steps, engine_gpus, args.repeats, layouts, fan_ins, save)
    log(f"done in {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
