"""Two GPUs, one node: a 2-rank sharded trainer pushing into a TP=2 vLLM engine on the same GPUs
(``asyncroll.DistributedWeightPusher``), against the same shape's one-GPU update in the same run.

    torchrun --nproc-per-node 2 bench/gpu_multi.py --out $OUT/multi [--sizes 1.5b,7b]

Rank r holds half of every tensor (a ``DTensor``, ``Shard(0)``, as FSDP2 keeps parameters) on
GPU r; rank 0 holds the engine (TP=2: its workers on GPUs 0 and 1, each fed by the trainer rank
on its GPU). Per shape:

- correctness (1.5B): the engine starts on weights A from disk; after pushing B its greedy
  outputs differ, after pushing A back they equal the fresh engine's; hybrid: the engine sleeps,
  the trainer allocates and computes, the engine wakes, takes B, and serves B's outputs;
- timing: the update (push plus label, ``UpdateReport``) over 5 pushes, median; the extra GPU
  memory of each rank during a push (``max_memory_allocated`` above what it held before);
- the one-GPU update of the same shape (TP=1 engine on GPU 0, ``WeightPusher`` from full
  tensors on GPU 0), and the one-GPU two-copy limit, measured in the same run.

Prints a table and writes OUT/gpu_multi.json (rank 0).
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

from gpu_e2e import (
    SHAPES,
    GiB,
    copy_rate_gbs,
    engine_args,
    greedy,
    random_weights,
    write_config,
)

from asyncroll import DistributedWeightPusher, VLLMEngine, WeightPusher

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE")


@contextlib.contextmanager
def without_torchrun_env() -> Iterator[None]:
    """vLLM's workers must not see torchrun's rank variables (they would join our group)."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def sharded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    out = {}
    for name in list(tensors):
        full = tensors.pop(name)
        out[name] = distribute_tensor(full, mesh, [Shard(0)])
        del full
    torch.cuda.empty_cache()
    return out


@contextlib.asynccontextmanager
async def maybe_engine(folder: Path, **options: Any) -> Any:
    if dist.get_rank() != 0:
        yield None
        return
    with without_torchrun_env():
        launching = VLLMEngine.launch(folder, **options)
        engine = await launching.__aenter__()
    try:
        yield engine
    finally:
        await launching.__aexit__(None, None, None)


async def timed_pushes(pusher: Any, tensors: dict[str, torch.Tensor], steps: Iterator[int],
                       repeats: int = 5) -> dict[str, Any]:
    await pusher.update(tensors, global_steps=next(steps))  # warm-up: attach, buffers, plan
    updates, extras, packs, waits = [], [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        report = await pusher.update(tensors, global_steps=next(steps))
        extras.append(torch.cuda.max_memory_allocated() - before)
        updates.append((report.push_seconds + report.finish_seconds) * 1e3)
        if report.push is not None:
            packs.append(report.push.pack_seconds * 1e3)
            waits.append(report.push.wait_seconds * 1e3)
    return {"update_ms": statistics.median(updates), "updates_ms": [round(u, 2) for u in updates],
            "extra_GiB": round(max(extras) / GiB, 3),
            "pack_ms (this rank)": round(statistics.median(packs), 2) if packs else None,
            "wait_ms (this rank)": round(statistics.median(waits), 2) if waits else None}


async def multi(size: str, work: Path, out: dict[str, Any], steps: Iterator[int],
                correctness: bool) -> None:
    rank = dist.get_rank()
    shape = SHAPES[size]
    folder = work / f"{size}-a"
    if rank == 0:
        write_config(folder, shape)
        if correctness:
            from safetensors.torch import save_file

            save_file({k: v.cpu() for k, v in random_weights(shape, seed=0).items()},
                      str(folder / "model.safetensors"))
    dist.barrier()
    weights_a = sharded(random_weights(shape, seed=0))
    weights_b = sharded(random_weights(shape, seed=1))
    nbytes = sum(t.numel() * t.element_size() for t in weights_a.values())
    section: dict[str, Any] = out.setdefault(f"{size} two GPUs", {"GiB": round(nbytes / GiB, 3)})
    options = engine_args(gpu_memory_utilization=0.3 if size != "7b" else 0.35,
                          tensor_parallel_size=2, enable_sleep_mode=True)
    if not correctness:
        options["load_format"] = "dummy"
    async with maybe_engine(folder, name=f"tp2-{size}", **options) as engine:
        pusher = DistributedWeightPusher([engine] if engine is not None else [], timeout=300)
        checks: dict[str, bool] = {}
        if correctness:
            fresh_a = await greedy(engine, "fresh-a") if engine is not None else None
            await pusher.update(weights_b, global_steps=next(steps))
            on_b = await greedy(engine, "on-b") if engine is not None else None
            await pusher.update(weights_a, global_steps=next(steps))
            on_a = await greedy(engine, "on-a") if engine is not None else None
            if engine is not None:
                checks["B differs from the fresh A"] = on_b != fresh_a
                checks["A pushed back equals the fresh engine on A"] = on_a == fresh_a
                await engine.sleep(level=1)
            dist.barrier()
            scratch = torch.randn(8192, 8192, device="cuda")  # the trainer's step, engine asleep
            (scratch @ scratch).sum().item()
            del scratch
            torch.cuda.empty_cache()
            dist.barrier()
            if engine is not None:
                await engine.wake_up()
            await pusher.update(weights_b, global_steps=next(steps))
            if engine is not None:
                checks["hybrid: after sleep, wake and a push of B, it serves B"] = (
                    await greedy(engine, "hybrid-b") == on_b)
            section["checks"] = checks
            log(f"{size} checks: {checks}")
        section["gather only ms"] = gather_ms(weights_b)
        variants = {"ours": {}, "ours unverified": {"verify": False},
                    "ours 1 GiB x2": {"bucket_bytes": 1 << 30}}
        for label, extra in variants.items():
            if label != "ours":
                await pusher.aclose()
                pusher = DistributedWeightPusher(
                    [engine] if engine is not None else [], timeout=300, **extra)
            section[label] = await timed_pushes(pusher, weights_b, steps)
            found: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(found, section[label])
            section[label]["per rank"] = found
            log(f"{size} two GPUs, {label}: {section[label]}")
        section["bucket MiB x buffers"] = "512 x2"
        await pusher.aclose()
    del weights_a, weights_b
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()


def gather_ms(weights: dict[str, torch.Tensor], repeats: int = 3) -> dict[str, float]:
    """Every tensor's all-gather alone, the best of ``repeats``: ``DTensor.full_tensor`` and
    ours (``asyncroll.distributed.gather``)."""
    from asyncroll.distributed import gather

    found = {}
    for label, function in (("full_tensor", lambda t: t.full_tensor()), ("ours", gather)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
            for tensor in weights.values():
                function(tensor)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        found[label] = round(best * 1e3, 2)
    return found


async def single(size: str, work: Path, out: dict[str, Any], steps: Iterator[int]) -> None:
    """The same shape into a TP=1 engine on GPU 0 from one process (rank 0; rank 1 waits)."""
    if dist.get_rank() == 0:
        shape = SHAPES[size]
        folder = write_config(work / f"{size}-one", shape)
        tensors = random_weights(shape, seed=2)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        rate = copy_rate_gbs()
        section = out.setdefault(f"{size} one GPU", {})
        section["two-copy limit ms"] = round(2 * nbytes / rate / 1e6, 2)
        section["copy GB/s"] = round(rate, 1)
        options = engine_args(gpu_memory_utilization=0.3 if size != "7b" else 0.35)
        with without_torchrun_env():
            async with VLLMEngine.launch(folder, name=f"one-{size}", load_format="dummy",
                                         **options) as engine:
                pusher = WeightPusher([engine], bucket_bytes=512 << 20)
                section["ours"] = await timed_pushes(pusher, tensors, steps)
                await pusher.aclose()
        log(f"{size} one GPU: {section}")
        del tensors
        gc.collect()
        torch.cuda.empty_cache()
    dist.barrier(group=GLOO)


GLOO: Any = None


async def main() -> None:
    global GLOO
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="1.5b,7b")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    GLOO = dist.new_group(backend="gloo")
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    steps = iter(range(1, 10**6))
    started = time.perf_counter()
    for size in args.sizes.split(","):
        await multi(size, work, out, steps, correctness=size == "1.5b")
        await single(size, work, out, steps)
        if rank == 0:
            two, one = out[f"{size} two GPUs"]["ours"], out[f"{size} one GPU"]["ours"]
            out[f"{size} two GPUs"]["vs one GPU"] = round(two["update_ms"] / one["update_ms"], 3)
            (args.out / "gpu_multi.json").write_text(json.dumps(out, indent=1))
            log(f"{size}: two GPUs {two['update_ms']:.1f} ms, one GPU {one['update_ms']:.1f} ms,"
                f" ratio {out[f'{size} two GPUs']['vs one GPU']}")
    log(f"done in {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
