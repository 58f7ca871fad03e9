"""N GPUs, one node: an N-rank sharded trainer pushing into a TP=N vLLM engine on the same GPUs
(``asyncroll.DistributedWeightPusher``), against the per-GPU limit measured in the same run (and,
on two GPUs, the same shape's one-GPU update).

    torchrun --nproc-per-node 2 bench/gpu_multi.py --out $OUT/multi [--sizes 1.5b,7b]
    torchrun --nproc-per-node 4 bench/gpu_multi.py --out $OUT/multi --sizes 32b --skip-single
    torchrun --nproc-per-node 4 bench/gpu_multi.py --out $OUT/multi --sizes qwen3-30b-a3b ...

Rank r holds 1/N of every tensor (a ``DTensor``, ``Shard(0)``, as FSDP2 keeps parameters) on
GPU r, made one tensor at a time (never the whole model on a GPU); rank 0 holds the engine
(TP=N: its worker r on GPU r, fed by the trainer rank on its GPU). Sizes: the Qwen2.5 shapes of
``gpu_e2e.SHAPES`` (0.5b, 1.5b, 7b, 32b) or a shape of ``asyncroll.testing.tiny_model.SHAPES``
(``qwen3-30b-a3b``: per-expert checkpoint names, pushed into vLLM's fused experts). Per shape:

- correctness (1.5B): the engine starts on weights A from disk; after pushing B its greedy
  outputs differ, after pushing A back they equal the fresh engine's; hybrid: the engine sleeps,
  the trainer allocates and computes, the engine wakes, takes B, and serves B's outputs;
- timing: the update (push plus label, ``UpdateReport``), median of ``--repeats`` pushes, for
  each of ``--variants`` in turn, ``--rounds`` times (each round's median kept: the same run's
  A/B); the extra GPU memory of each rank during a push (``max_memory_allocated`` above what it
  held before);
- the per-GPU limit (``per_gpu_limit``): what GPU r's worker loads at the measured one-copy
  rate, plus what it must receive from the other ranks (o and down column blocks, replicated
  norms and routers) at the measured exchange rate (an NCCL all-to-all, every rank at once);
  each variant's update over it (the issue's target: at most 1.5x);
- the one-GPU update of the same shape (TP=1 engine on GPU 0, ``WeightPusher`` from full
  tensors on GPU 0), and the one-GPU two-copy limit, measured in the same run
  (``--skip-single`` leaves it out: a 32B trainer copy and engine do not fit one GPU);
- the baseline (``--skip-ipc`` leaves it out): vLLM's own ``ipc`` weight-transfer backend into a
  TP=2 engine (dummy weights) from the same sharded trainer, as vLLM 0.24 documents it for
  several trainer ranks: every rank gathers each tensor (``full_tensor()``, lazily, in one order)
  and calls ``IPCWeightTransferEngine.trainer_send_weights``, which all-gathers the ranks' CUDA
  IPC handles (keyed by GPU UUID) so that each worker opens the copy on its own GPU; rank 0
  sends. Packed (1 GiB buffer, its default; 2 GiB: 7B's embedding exceeds 1 GiB) and unpacked;
  the update from ``start_weight_update`` to ``finish_weight_update`` on rank 0, median of 5
  after a warm-up; ``ours vs vLLM ipc``: our ``ours`` update (the defaults) over vLLM's best.
  Checks: the engine serves the pushed tensors (a replicated norm on every worker, the shards of a
  row-parallel weight summed over the workers; for a mixture, its fused experts summed).

Prints a table and writes OUT/gpu_multi.json (rank 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_e2e import (
    MODEL_SHAPES,
    SHAPES,
    GiB,
    copy_rate_gbs,
    engine_args,
    greedy,
    iter_random_weights,
    random_weights,
    weight_shapes,
    write_config,
)

from asyncroll import DistributedWeightPusher, VLLMEngine, WeightPusher
from asyncroll.distributed import torchrun_hidden
from asyncroll.testing import vllm_client


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def shape_of(size: str) -> dict[str, Any]:
    return SHAPES.get(size) or MODEL_SHAPES[size]


def gpus(world: int) -> str:
    """A section's name: "two GPUs" as the earlier runs wrote it, else the count."""
    return "two GPUs" if world == 2 else f"{world} GPUs"


def section_name(size: str, world: int, expert_parallel: bool = False) -> str:
    return f"{size} {gpus(world)}{' expert-parallel' if expert_parallel else ''}"


def sharded(tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each full tensor as it comes, kept as this rank's ``Shard(0)`` rows: every rank makes
    the same full tensor (the same seed) and keeps its own rows, with no communication."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    out = {}
    for name, full in tensors:
        out[name] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        del full
    torch.cuda.empty_cache()
    return out


def sharded_pair(
    size: str, work: Path, correctness: bool
) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The shape's folder (rank 0 writes its config, and weights A where ``correctness``: the
    engine starts on them), weights A and B sharded over the ranks, and their bytes."""
    shape = shape_of(size)
    folder = work / f"{size}-a"
    if dist.get_rank() == 0:
        write_config(folder, shape)
        if correctness:
            from safetensors.torch import save_file

            save_file({k: v.cpu() for k, v in random_weights(shape, seed=0).items()},
                      str(folder / "model.safetensors"))
    dist.barrier()
    weights_a = sharded(iter_random_weights(shape, seed=0))
    weights_b = sharded(iter_random_weights(shape, seed=1))
    nbytes = sum(t.numel() * t.element_size() for t in weights_a.values())
    return folder, weights_a, weights_b, nbytes


@contextlib.asynccontextmanager
async def maybe_engine(folder: Path, **options: Any) -> Any:
    if dist.get_rank() != 0:
        yield None
        return
    with torchrun_hidden():
        launching = VLLMEngine.launch(folder, **options)
        engine = await launching.__aenter__()
    try:
        yield engine
    finally:
        await launching.__aexit__(None, None, None)


async def timed_pushes(pusher: Any, tensors: dict[str, torch.Tensor], steps: Iterator[int],
                       repeats: int = 5) -> dict[str, Any]:
    await pusher.update(tensors, global_steps=next(steps))  # warm-up: attach, buffers, plan
    updates, calls, extras, packs, waits, pieces, moved = [], [], [], [], [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        called = time.perf_counter()
        report = await pusher.update(tensors, global_steps=next(steps))
        calls.append((time.perf_counter() - called) * 1e3)
        extras.append(torch.cuda.max_memory_allocated() - before)
        updates.append((report.push_seconds + report.finish_seconds) * 1e3)
        pieces.append(len(getattr(pusher, "pieces", ())))
        moved.append(report.push.bytes if report.push is not None else 0)
        if report.push is not None:
            packs.append(report.push.pack_seconds * 1e3)
            waits.append(report.push.wait_seconds * 1e3)
    # update_ms: the engines' stall (push and finish, the report's); call_ms: what the caller
    # waits for (``await update()``: the checks, fingerprints and agreement before the pause too)
    return {"update_ms": statistics.median(updates), "updates_ms": [round(u, 2) for u in updates],
            "call_ms": round(statistics.median(calls), 2),
            "extra_GiB": round(max(extras) / GiB, 3),
            "pack_ms (this rank)": round(statistics.median(packs), 2) if packs else None,
            "wait_ms (this rank)": round(statistics.median(waits), 2) if waits else None,
            "pieces": max(pieces), "GiB moved (this rank)": round(max(moved) / GiB, 3)}


VARIANTS: dict[str, dict[str, Any]] = {
    # "ours": the defaults (rows as pieces; row-parallel tensors of at least 32 MiB exchanged
    # as column blocks, smaller ones gathered; 1 GiB buckets x2 on GPUs); the others change one
    # thing. Until session 43 the default gathered every row-parallel tensor (now "ours rows
    # only"); session 34 (2026-11-29) ran the column blocks as "ours" and the default as "ours
    # rows only", both at 512 MiB ("ours 1 GiB x2": columns).
    "ours": {},
    "ours rows only": {"column_blocks": False},
    "ours column blocks": {"column_blocks": True},
    "ours 512 MiB x2": {"bucket_bytes": 512 << 20},
    "ours column blocks 512 MiB x2": {"column_blocks": True, "bucket_bytes": 512 << 20},
    "ours unverified": {"verify": False},
    "ours whole tensors (no pieces)": {"pieces": False},
    "ours whole tensors 512 MiB x2": {"pieces": False, "bucket_bytes": 512 << 20},
}
DEFAULT_VARIANTS = ("ours", "ours rows only", "ours column blocks", "ours 512 MiB x2",
                    "ours column blocks 512 MiB x2", "ours unverified",
                    "ours whole tensors (no pieces)")


MEMORY = {"7b": 0.35}  # the engine's share of each GPU (0.3 otherwise): beside the trainer's
# shards of A and B, its staging buffers and buckets (32B on 4 GPUs: 2 x 16 GB of shards)

REPLICATED = ("norm.weight", "mlp.gate.weight")  # whole on every worker: norms, a MoE's router
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # a column block on each worker (experts too)


def per_gpu_bytes(shapes: dict[str, tuple[int, ...]], world: int,
                  itemsize: int = 2, expert_parallel: bool = False) -> tuple[int, int]:
    """What the worker on GPU r of a TP=``world`` engine loads, and how much of that its trainer
    rank (``Shard(0)`` rows) does not hold: column-parallel tensors (q, k, v, gate, up, the
    embeddings and head) are rows the rank holds; row-parallel ones (o, down) a column block of
    all rows, 1/world of it held; replicated ones (norms, a router) whole, 1/world held. Assumes
    the key-value heads divide over the workers (true of the 7B, 32B and 30B-A3B at TP=4).
    ``expert_parallel``: each worker loads 1/world of the experts whole, 1/world of their rows
    held by its rank."""
    loads = received = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if expert_parallel and ".mlp.experts." in name:
            loads += nbytes // world
            received += nbytes * (world - 1) // world**2
        elif name.endswith(REPLICATED):
            loads += nbytes
            received += nbytes * (world - 1) // world
        elif name.endswith(ROW_PARALLEL):
            loads += nbytes // world
            received += nbytes * (world - 1) // world**2
        else:
            loads += nbytes // world
    return loads, received


def exchange_rate(nbytes: int = GiB, repeats: int = 3) -> dict[str, float]:
    """What each GPU receives a second while every rank exchanges with every other at once (an
    NCCL all-to-all of ``nbytes`` a rank, the column blocks' pattern), median of ``repeats``."""
    world = dist.get_world_size()
    send = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    recv = torch.empty_like(send)
    times = []
    for _ in range(repeats + 1):  # a warm-up first
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    del send, recv
    torch.cuda.empty_cache()
    seconds = statistics.median(times[1:])
    received = nbytes * (world - 1) // world
    return {"ms": round(seconds * 1e3, 2),
            "GB/s received a GPU": round(received / seconds / 1e9, 1)}


def per_gpu_limit(size: str, expert_parallel: bool = False) -> dict[str, Any]:
    """The issue's per-GPU limit, measured in this run: the worker's bytes at the one-copy rate
    of its GPU, plus the bytes it must receive from the other ranks at the exchange rate."""
    world = dist.get_world_size()
    loads, received = per_gpu_bytes(weight_shapes(shape_of(size)), world,
                                    expert_parallel=expert_parallel)
    rate = copy_rate_gbs()
    exchange = exchange_rate()
    copy_ms = loads / rate / 1e6
    receive_ms = received / exchange["GB/s received a GPU"] / 1e6
    return {"GiB loaded a GPU": round(loads / GiB, 3),
            "GiB received a GPU": round(received / GiB, 3), "copy GB/s": round(rate, 1),
            "exchange": exchange,
            "one-copy ms": round(copy_ms, 2), "receive ms": round(receive_ms, 2),
            "limit ms": round(copy_ms + receive_ms, 2)}


async def multi(size: str, work: Path, out: dict[str, Any], steps: Iterator[int],
                correctness: bool, chosen: tuple[str, ...] = DEFAULT_VARIANTS,
                repeats: int = 5, rounds: int = 1, save: Any = lambda: None,
                expert_parallel: bool = False) -> None:
    world = dist.get_world_size()
    began = time.perf_counter()
    folder, weights_a, weights_b, nbytes = sharded_pair(size, work, correctness)
    log(f"{size}: {nbytes / GiB:.1f} GiB, {len(weights_a)} tensors sharded over {world} ranks "
        f"in {time.perf_counter() - began:.0f} s")
    section: dict[str, Any] = out.setdefault(section_name(size, world, expert_parallel),
                                             {"GiB": round(nbytes / GiB, 3),
                                              "tensors": len(weights_a)})
    section["headline variant"] = chosen[0]
    section["per-GPU limit"] = limit = per_gpu_limit(size, expert_parallel)
    log(f"{size}: per-GPU limit {limit}")
    save()
    options = engine_args(gpu_memory_utilization=MEMORY.get(size, 0.3),
                          tensor_parallel_size=world, enable_sleep_mode=True)
    if expert_parallel:
        options["enable_expert_parallel"] = True
    if not correctness:
        options["load_format"] = "dummy"
    began = time.perf_counter()
    async with maybe_engine(folder, name=f"tp{world}-{size}", **options) as engine:
        log(f"{size}: TP={world} engine up in {time.perf_counter() - began:.0f} s")
        pusher = DistributedWeightPusher([engine] if engine is not None else [], timeout=300,
                                         column_blocks=True)
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
            hybrid = await pusher.update(weights_b, global_steps=next(steps))
            section["pieces"] = {how: sum(1 for h in hybrid.pieces.values() if h == how)
                                 for how in ("rows", "columns")}  # of the update's tensors
            if engine is not None:
                checks["hybrid: after sleep, wake and a push of B, it serves B"] = (
                    await greedy(engine, "hybrid-b") == on_b)
            checks["pieces pushed (after the first push)"] = len(pusher.pieces) > 0
            checks["row-parallel o_proj and down_proj as exchanged column blocks"] = all(
                any(n.endswith(kind) for n in pusher.pieces)
                for kind in ("o_proj.weight", "down_proj.weight"))
            # The workers forget their load plans: the next push's pieces fail there, and
            # every rank pushes whole tensors again, at once; the push after uses pieces.
            if engine is not None:
                await engine.collective_rpc("asyncroll_drop_load_plan")
            await pusher.update(weights_a, global_steps=next(steps))
            checks["plan dropped: the update retried whole"] = not pusher.pieces
            if engine is not None:
                checks["plan dropped: serves A"] = await greedy(engine, "dropped-a") == fresh_a
            await pusher.update(weights_b, global_steps=next(steps))
            await pusher.update(weights_b, global_steps=next(steps))
            checks["plan learned again: pieces"] = len(pusher.pieces) > 0
            if engine is not None:
                checks["plan learned again: serves B"] = await greedy(engine, "again-b") == on_b
            section["checks"] = checks
            log(f"{size} checks: {checks}")
        section["gather only ms"] = gather_ms(weights_b)
        log(f"{size}: gathers alone {section['gather only ms']}")
        # What the engine must serve after a push of A (a collective: every rank, same order).
        expected_a = served_expected(weights_a)
        for turn in range(rounds):  # the variants in turn, ``rounds`` times: the same run's A/B
            for label in chosen:
                await pusher.aclose()
                pusher = DistributedWeightPusher(
                    [engine] if engine is not None else [], timeout=300, **VARIANTS[label])
                found = await timed_pushes(pusher, weights_b, steps, repeats)
                found["vs per-GPU limit"] = round(found["update_ms"] / limit["limit ms"], 3)
                if turn == 0:  # then A, by the same pusher: the engine serves what it pushed
                    await pusher.update(weights_a, global_steps=next(steps))
                    if engine is not None:
                        seen = await served(engine, expected_a)
                        found["serves A after its push"] = seen
                        section.setdefault("checks", {})[f"{label}: serves A after its push"] = (
                            serves_all(seen))
                ranks: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, found)
                found["per rank"] = ranks
                found["extra_GiB max over ranks"] = max(r["extra_GiB"] for r in ranks)
                if turn == 0:
                    section[label] = found | {"rounds update_ms": []}
                section[label]["rounds update_ms"].append(round(found["update_ms"], 2))
                log(f"{size} {gpus(world)}, {label} (round {turn + 1}): "
                    f"{ {k: v for k, v in found.items() if k != 'per rank'} }")
                save()
        section["bucket MiB x buffers"] = "1024 x2 unless named"
        section["extra memory target GiB (buffers + one bucket)"] = (
            "3 at 1 GiB x2, 1.5 at 512 MiB x2")
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


IPC_VARIANTS = (("vLLM ipc packed 1 GiB", True, GiB), ("vLLM ipc packed 2 GiB", True, 2 * GiB),
                ("vLLM ipc unpacked", False, GiB))


async def vllm_ipc_multi(size: str, work: Path, out: dict[str, Any], repeats: int = 5,
                         chosen: tuple[str, ...] = tuple(v[0] for v in IPC_VARIANTS)) -> None:
    """vLLM's own ``ipc`` backend into a TP=2 engine from the sharded trainer (module doc).

    Both ranks run every update, whatever fails: before each one they agree (``agree``, gloo)
    on whether to run it; inside it rank 0's failures only stop its sends to the engine, so
    the collectives of ``trainer_send_weights`` stay matched on both ranks."""
    from _baseline_ext import install_ray_stub

    install_ray_stub()  # vLLM 0.24's ipc module imports ray
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # its handles travel as pickles
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    rank, world = dist.get_rank(), dist.get_world_size()
    shape = shape_of(size)
    folder = work / f"{size}-ipc"
    if rank == 0:
        write_config(folder, shape)
    weights = sharded(iter_random_weights(shape, seed=1))  # multi()'s weights B
    expected = served_expected(weights)  # a collective: every rank, same order
    section: dict[str, Any] = out.setdefault(f"{size} {gpus(world)}", {})
    options = engine_args(gpu_memory_utilization=MEMORY.get(size, 0.3),
                          tensor_parallel_size=world,
                          worker_extension_cls="_baseline_ext.BaselineWorkerExtension")
    failed: str | None = None  # this rank's first error; agree() makes it every rank's
    async with contextlib.AsyncExitStack() as stack:
        engine: Any = None
        try:
            engine = await stack.enter_async_context(maybe_engine(
                folder, name=f"vllm-ipc-tp{world}-{size}", load_format="dummy",
                weight_transfer_config=WeightTransferConfig(backend="ipc"), **options))
            if engine is not None:
                await vllm_client(engine).init_weight_transfer_engine(
                    WeightTransferInitRequest(init_info={}))
        except Exception as exc:  # rank 0 only; the other rank learns it in agree()
            failed = f"engine: {exc!r}"
        for label, packed, buffer in IPC_VARIANTS:
            if label not in chosen:
                continue
            updates, extras = [], []
            error = failed
            for i in range(1 + repeats):  # a warm-up, then the timed updates
                torch.cuda.synchronize()
                error = agree(error)
                if error is not None:
                    break
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                started = time.perf_counter()
                error = await ipc_update(engine, weights, packed, buffer)
                if i:
                    updates.append((time.perf_counter() - started) * 1e3)
                    extras.append(torch.cuda.max_memory_allocated() - before)
            if error is not None:
                section[label] = {"error": error[:500]}
            else:
                section[label] = {"update_ms": statistics.median(updates),
                                  "updates_ms": [round(u, 2) for u in updates],
                                  "extra_GiB (rank 0)": round(max(extras) / GiB, 3)}
            log(f"{size} {gpus(world)}, {label}: {section[label]}")
        if engine is not None and failed is None:
            section["vLLM ipc checks"] = await served(engine, expected)
            log(f"{size} vLLM ipc checks: {section['vLLM ipc checks']}")
    timed = {label: section[label]["update_ms"] for label, _, _ in IPC_VARIANTS
             if "update_ms" in section.get(label, {})}
    ours = section.get("headline variant", "ours")
    if timed and "update_ms" in section.get(ours, {}):
        best = min(timed, key=timed.__getitem__)
        section["ours vs vLLM ipc"] = round(section[ours]["update_ms"] / timed[best], 3)
        section["best vLLM ipc"] = best
        log(f"{size} {gpus(world)}: {ours} {section[ours]['update_ms']:.1f} ms, "
            f"{best} {timed[best]:.1f} ms, ratio {section['ours vs vLLM ipc']}")
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier(group=GLOO)


def agree(error: str | None) -> str | None:
    """The first rank's error, on every rank (gloo): the ranks run the next update together or
    neither does. Every rank reaches it between updates only, so it is also the barrier there."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, error, group=GLOO)
    return next((e for e in found if e is not None), None)


async def ipc_update(engine: Any, weights: dict[str, torch.Tensor], packed: bool,
                     buffer: int) -> str | None:
    """One update through vLLM's ``ipc`` backend, run by every rank; the first error.

    Every rank feeds ``trainer_send_weights`` the full tensors on its own GPU, gathered lazily
    (``full_tensor()``, a collective); vLLM all-gathers the ranks' IPC handles per chunk (the
    default group) and rank 0 sends them. Rank 0 (which holds ``engine``) also starts and
    finishes the update; a failure there only stops its sends, never a collective."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerSendWeightsArgs,
        IPCWeightTransferEngine,
    )

    errors: list[str] = []
    loop = asyncio.get_running_loop()
    device = torch.cuda.current_device()
    llm = vllm_client(engine) if engine is not None else None  # vLLM's client, rank 0 only

    def send(info: Any) -> None:  # vLLM calls it on rank 0 only
        if errors or llm is None:
            return  # the update failed: the other rank's collectives still need ours
        request = WeightTransferUpdateRequest(update_info=asdict(info))
        try:
            asyncio.run_coroutine_threadsafe(llm.update_weights(request), loop).result()
        except Exception as exc:
            errors.append(f"update_weights: {exc!r}")

    def trainer_send() -> None:
        torch.cuda.set_device(device)  # per thread: vLLM takes this GPU's UUID, NCCL its device
        gathered = ((name, tensor.full_tensor()) for name, tensor in weights.items())
        args = IPCTrainerSendWeightsArgs(send_mode=send, packed=packed,
                                         packed_buffer_size_bytes=buffer)
        try:
            IPCWeightTransferEngine.trainer_send_weights(gathered, args)
        except Exception as exc:  # e.g. a tensor over the packed buffer: on every rank alike
            errors.append(f"trainer_send_weights (rank {dist.get_rank()}): {exc!r}")

    if llm is not None:
        try:
            await llm.start_weight_update()
        except Exception as exc:
            errors.append(f"start_weight_update: {exc!r}")
    await asyncio.to_thread(trainer_send)
    if llm is not None:
        try:
            await llm.finish_weight_update()  # after a failure too: closes the update
        except Exception as exc:
            errors.append(f"finish_weight_update: {exc!r}")
    return errors[0] if errors else None


def served_expected(weights: dict[str, torch.Tensor]) -> dict[str, tuple[float, str]]:
    """What the engine must serve after a push of ``weights``, by served name: the sum of a
    replicated tensor (the final norm) on every worker, and sums over the workers of sharded
    ones (row-parallel o and down of layer 0; for a mixture, layer 0's fused experts: w13 holds
    every expert's gate and up, w2 its down). A collective: every rank, in the same order."""

    def total(names: list[str]) -> float:
        return sum(float(weights[n].full_tensor().sum(dtype=torch.float64)) for n in names)

    layer = "model.layers.0"
    expected = {"model.norm.weight": (total(["model.norm.weight"]), "on every worker"),
                f"{layer}.self_attn.o_proj.weight": (total([f"{layer}.self_attn.o_proj.weight"]),
                                                     "summed over the workers")}
    if f"{layer}.mlp.down_proj.weight" in weights:
        expected[f"{layer}.mlp.down_proj.weight"] = (
            total([f"{layer}.mlp.down_proj.weight"]), "summed over the workers")
    experts = [n for n in weights if n.startswith(f"{layer}.mlp.experts.")]
    if experts:
        expected[f"{layer}.mlp.experts.w13_weight"] = (
            total([n for n in experts if n.endswith(("gate_proj.weight", "up_proj.weight"))]),
            "summed over the workers")
        expected[f"{layer}.mlp.experts.w2_weight"] = (
            total([n for n in experts if n.endswith("down_proj.weight")]),
            "summed over the workers")
    return expected


def served_name(name: str, digest: dict[str, float]) -> str:
    """``name`` as the engine serves it: itself, or (fused experts, whose prefix vLLM's
    versions name differently) the one served name of its layer with its last component."""
    if name in digest:
        return name
    layer = name.split(".")[2]
    hits = [n for n in digest if n.endswith(name.rsplit(".", 1)[1]) and f"layers.{layer}." in n]
    if len(hits) != 1:
        raise KeyError(f"{name!r}: served as {hits} (of {len(digest)} names)")
    return hits[0]


def serves_all(seen: dict[str, Any]) -> bool:
    """Whether ``served`` found every expected tensor served (a check that could not run fails)."""
    return "digest" not in seen and all(v for k, v in seen.items() if k != "workers")


async def served(engine: Any, expected: dict[str, tuple[float, str]]) -> dict[str, Any]:
    """Whether the engine serves the pushed tensors (``served_expected``): per-worker parameter
    sums (the worker extension's ``asyncroll_weight_digest``)."""
    try:
        digests = [dict(d) for d in await engine.collective_rpc("asyncroll_weight_digest")]
        found: dict[str, Any] = {"workers": len(digests)}
        for name, (value, how) in expected.items():
            got = served_name(name, digests[0])
            if how == "on every worker":
                found[f"{name} {how}"] = all(
                    math.isclose(d[got], value, rel_tol=1e-9) for d in digests)
            else:
                found[f"{name} {how}"] = math.isclose(
                    sum(d[got] for d in digests), value, rel_tol=1e-9, abs_tol=1e-6)
        return found
    except Exception as exc:  # a check that could not run is a failed one, not a hang
        return {"digest": f"failed: {exc!r}"[:500]}


async def single(size: str, work: Path, out: dict[str, Any], steps: Iterator[int]) -> None:
    """The same shape into a TP=1 engine on GPU 0 from one process (rank 0; rank 1 waits)."""
    if dist.get_rank() == 0:
        shape = shape_of(size)
        folder = write_config(work / f"{size}-one", shape)
        tensors = random_weights(shape, seed=2)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        rate = copy_rate_gbs()
        section = out.setdefault(f"{size} one GPU", {})
        section["two-copy limit ms"] = round(2 * nbytes / rate / 1e6, 2)
        section["copy GB/s"] = round(rate, 1)
        options = engine_args(gpu_memory_utilization=0.3 if size != "7b" else 0.35)
        with torchrun_hidden():
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
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"of {', '.join(VARIANTS)}; the first gives the one-GPU ratio")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes a variant")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the variants in turn, this many times (each round's median kept)")
    parser.add_argument("--skip-ipc", action="store_true",
                        help="leave out the vLLM ipc backend baseline (TP=N)")
    parser.add_argument("--ipc-variants", default=",".join(v[0] for v in IPC_VARIANTS),
                        help="of the vLLM ipc baseline's variants")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="the TP engine with enable_expert_parallel (each worker holds"
                        " 1/N of the experts, whole; with --skip-ipc)")
    parser.add_argument("--skip-single", action="store_true",
                        help="leave out the one-GPU update of the same shape")
    args = parser.parse_args()
    chosen = tuple(args.variants.split(","))
    unknown = [label for label in chosen if label not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose among {list(VARIANTS)}")
    if args.expert_parallel and not args.skip_ipc:
        parser.error("--expert-parallel runs with --skip-ipc (the vLLM ipc baseline is TP only)")
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    GLOO = dist.new_group(backend="gloo")
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    steps = iter(range(1, 10**6))
    started = time.perf_counter()
    def save() -> None:
        if rank == 0:
            (args.out / "gpu_multi.json").write_text(json.dumps(out, indent=1))

    out["command"] = " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv])
    label = gpus(dist.get_world_size())
    for size in args.sizes.split(","):
        await multi(size, work, out, steps, correctness=size == "1.5b", chosen=chosen,
                    repeats=args.repeats, rounds=args.rounds, save=save,
                    expert_parallel=args.expert_parallel)
        save()
        if not args.skip_single:
            await single(size, work, out, steps)
            if rank == 0:
                name = section_name(size, dist.get_world_size(), args.expert_parallel)
                many, one = out[name][chosen[0]], out[f"{size} one GPU"]["ours"]
                out[name]["vs one GPU"] = round(many["update_ms"] / one["update_ms"], 3)
                log(f"{size}: {label} {many['update_ms']:.1f} ms, one GPU "
                    f"{one['update_ms']:.1f} ms, ratio {out[name]['vs one GPU']}")
            save()
        if not args.skip_ipc:
            await vllm_ipc_multi(size, work, out,
                                 chosen=tuple(args.ipc_variants.split(",")))
            save()
    log(f"done in {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
