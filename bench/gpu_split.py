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

Per size: correctness (1.5B: the engine starts on weights A from disk; after a push of B its
greedy outputs differ, after a push of A they equal the fresh engine's, on every engine), the
update time (median of ``--repeats``, after a warm-up) of each layout, and in the same run the
limits: NCCL's broadcast of the model's bytes from GPU 0 to GPU 1 (the link), and the gathers
alone (every tensor all-gathered over the two ranks, which a TP=1 engine needs: it reads
every row). Ratios: each layout's update over link + gathers; two engines over one (flat is
1.0: the engines are fed in parallel).

On four GPUs (trainer on 0-1, engines on 2-3) the same code runs with ``--engine-gpus 2,3``.
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
from gpu_multi import gather_ms, sharded_pair, timed_pushes, without_torchrun_env

from asyncroll import DistributedWeightPusher, VLLMEngine


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


@contextlib.asynccontextmanager
async def engine_on(gpu: int, folder: Path, **options: Any) -> Any:
    """A TP=1 engine on physical GPU ``gpu`` (rank 0 holds every engine)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    with without_torchrun_env():
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
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


async def split(size: str, work: Path, out: dict[str, Any], steps: Iterator[int],
                engine_gpus: list[int], repeats: int) -> None:
    rank = dist.get_rank()
    correctness = size == "1.5b"
    folder, weights_a, weights_b, nbytes = sharded_pair(size, work, correctness)
    section: dict[str, Any] = out.setdefault(f"{size} split", {"GiB": round(nbytes / GiB, 3)})
    section["link (GPU 0 -> GPU 1, NCCL broadcast) "] = link = link_ms(nbytes)
    section["gathers only ms"] = gathers = gather_ms(weights_b)
    limit = link["ms"] + gathers["ours"]
    section["limit ms (link + gathers)"] = round(limit, 2)
    log(f"{size}: {nbytes / GiB:.2f} GiB; link {link}; gathers {gathers}")
    options = engine_args(gpu_memory_utilization=0.3 if size != "7b" else 0.35)
    if not correctness:
        options["load_format"] = "dummy"
    checks: dict[str, bool] = {}
    fresh_a: Any = None
    async with contextlib.AsyncExitStack() as stack:
        engines: list[Any] = []
        for count in (1, 2):
            if rank == 0:
                gpu = engine_gpus[count - 1]
                engines.append(await stack.enter_async_context(
                    engine_on(gpu, folder, name=f"split-{size}-{count}", **options)))
            dist.barrier()
            label = f"{count} engine{'s' if count > 1 else ''}"
            pusher = DistributedWeightPusher(engines, backend="broadcast", timeout=120)
            if correctness:
                if rank == 0 and count == 1:  # every engine starts on A from disk
                    fresh_a = await greedy(engines[0], "fresh-a")
                await pusher.update(weights_b, global_steps=next(steps))
                on_b = [await greedy(e, f"on-b-{count}") for e in engines]
                await pusher.update(weights_a, global_steps=next(steps))
                on_a = [await greedy(e, f"on-a-{count}") for e in engines]
                if rank == 0:
                    checks[f"{label}: B differs from the fresh A"] = all(
                        b != fresh_a for b in on_b)
                    checks[f"{label}: A pushed back equals the fresh engine on A"] = all(
                        a == fresh_a for a in on_a)
            found = await timed_pushes(pusher, weights_b, steps, repeats)
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, found)
            found["per rank"] = ranks
            found["vs limit"] = round(found["update_ms"] / limit, 3)
            section[label] = found
            log(f"{size} {label}: {found}")
            await pusher.aclose()
        if rank == 0:
            one, two = section["1 engine"]["update_ms"], section["2 engines"]["update_ms"]
            section["2 engines vs 1"] = round(two / one, 3)
            section["link rate reached, 1 engine"] = round(link["ms"] / one, 3)
    if checks:
        section["checks"] = checks
        log(f"{size} checks: {checks}")
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
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    engine_gpus = [int(g) for g in args.engine_gpus.split(",")]
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "engine GPUs": engine_gpus, "ranks": dist.get_world_size()}
    steps = iter(range(1, 10**6))
    started = time.perf_counter()
    for size in args.sizes.split(","):
        await split(size, work, out, steps, engine_gpus, args.repeats)
        if rank == 0:
            (args.out / "gpu_split.json").write_text(json.dumps(out, indent=1))
    log(f"done in {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
