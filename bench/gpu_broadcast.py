"""Standalone mode across devices: the trainer on GPU 0 pushes into an engine on GPU 1 through
asyncroll's broadcast transport (NCCL through vLLM's communicator), against vLLM's own NCCL
weight-transfer path used as its docs show, and against the link limit measured in this run.

Needs two GPUs and CUDA vLLM (0.24 on the lent machines; docs/gpu.md). The engine on GPU 1 is a
``RayEngine`` (``--engine ray``, the default, on a local Ray cluster that owns only GPU 1) or a
``VLLMEngine`` whose engine process sees only GPU 1 (``--engine local``). vLLM's own path always
runs on a local engine on GPU 1 (its calls need the ``AsyncLLM``); both cross the same link.

- ``correctness``: an engine on GPU 1 started on tiny model A takes model B from GPU 0; greedy
  outputs equal a fresh engine on B (also on GPU 1), then A's after pushing A back; a push a
  worker fails (fault injected) raises ``WeightSyncError`` and the engine still serves A.
- ``link``: a 1 GiB NCCL broadcast GPU 0 -> GPU 1 (a second process), best of 10: the link
  limit for a payload is its size over that rate.
- ``push``: random-weight Qwen2.5 shapes (``--sizes``): update ms (push plus finish) of
  asyncroll (512 MiB x2 and x3, load plan) and of vLLM's ``nccl`` backend (packed, its default
  1 GiB x2 buffers; unpacked), each against the link limit.

    python bench/gpu_broadcast.py --out /tmp/out --sizes 1.5b,7b
    python bench/gpu_broadcast.py --device cpu --sizes tiny     # a smoke run of our path (gloo)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch
from gpu_e2e import (
    SHAPES,
    SMALL,
    GiB,
    Results,
    engine_args,
    finish,
    greedy,
    log,
    random_weights,
    run_steps,
    timed,
    write_config,
)
from safetensors.torch import load_file

from asyncroll import VLLMEngine, WeightPusher, WeightSyncError
from asyncroll.testing import make_tiny_model, vllm_client
from asyncroll.testing.faults import inject_fault

ENGINE_GPU = "1"


@contextlib.contextmanager
def visible(devices: str | None) -> Iterator[None]:
    """Processes started inside see only ``devices`` (this one keeps what it has)."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


class Engines:
    """Starts engines on the engine device: in Ray actors or local processes."""

    def __init__(self, kind: str, device: str) -> None:
        self.kind = kind
        self.gpu = ENGINE_GPU if device == "cuda" else None
        self.cuda = device == "cuda"
        if kind == "ray":
            import ray

            with visible(self.gpu):  # the cluster owns the engine GPU only
                ray.init(num_cpus=4, num_gpus=1 if self.cuda else 0, include_dashboard=False,
                         log_to_driver=True)

    def args(self, **extra: Any) -> dict[str, Any]:
        if self.cuda:
            return engine_args(**extra)
        return {"max_model_len": 512, "dtype": "float32", "skip_tokenizer_init": True,
                "worker_extension_cls": "asyncroll.testing.faults.FaultInjectingExtension",
                **{k: v for k, v in extra.items() if k != "gpu_memory_utilization"}}

    @contextlib.asynccontextmanager
    async def start(self, folder: Path, name: str, *, local: bool = False,
                    **extra: Any) -> AsyncIterator[Any]:
        if self.kind == "ray" and not local:
            from asyncroll.ray import RayEngine

            options = {"num_gpus": 1} if self.cuda else {}
            engine: Any = await RayEngine.start(folder, name=name, actor_options=options,
                                                **self.args(**extra))
        else:
            with visible(self.gpu):
                engine = await VLLMEngine.start(folder, name=name, **self.args(**extra))
        try:
            yield engine
        finally:
            await engine.aclose()


def weights_of(folder: Path, device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in load_file(str(folder / "model.safetensors")).items()}


async def correctness(res: Results, engines: Engines, work: Path, device: str) -> None:
    s = "correctness"
    a = make_tiny_model(work / "a", seed=0, **SMALL)
    b = make_tiny_model(work / "b", seed=1, **SMALL)
    async with engines.start(b, "fresh-b", local=True) as fresh:
        fresh_b = await greedy(fresh, "fresh-b")
    async with engines.start(a, "engine-a") as engine:
        fresh_a = await greedy(engine, "fresh-a")
        res.check(s, "the two models differ", fresh_a != fresh_b)
        pusher = WeightPusher([engine], backend="broadcast", bucket_bytes=1 << 20)
        try:
            report = await pusher.update(weights_of(b, device), global_steps=1)
            res.record(s, "delivery", {k: asdict(v) for k, v in report.deliveries.items()})
            res.check(s, "greedy after pushing B equals a fresh engine on B",
                      await greedy(engine, "pushed-b") == fresh_b)
            await pusher.update(weights_of(a, device), global_steps=2)
            res.check(s, "greedy after pushing A back equals A",
                      await greedy(engine, "pushed-a") == fresh_a)
            if engines.kind == "local":
                try:
                    async with inject_fault(engine, "load", tensor="model.norm.weight"):
                        await pusher.update(weights_of(b, device), global_steps=3)
                    res.check(s, "a failing worker fails the push", False, "no error")
                except WeightSyncError as exc:
                    res.check(s, "a failing worker fails the push (WeightSyncError)", True)
                    res.record(s, "failure", str(exc)[:300])
                # No backup: the engine holds (admits nothing) until a push succeeds. A
                # request now would wait for that push, so the check reads the state, then
                # pushes A and requires A served.
                res.check(s, "after the failed push the engine holds or is dead",
                          engine.is_dead or engine.statistics().holding, repr(engine))
                if not engine.is_dead:
                    await pusher.update(weights_of(a, device), global_steps=4)
                    res.check(s, "a push after the failure ends the hold, serving A",
                              await greedy(engine, "after-failure") == fresh_a, repr(engine))
        finally:
            await pusher.aclose()


def _link_peer(port: int, nbytes: int, repeats: int) -> None:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=1, world_size=2)
    comm = PyNcclCommunicator(group, device=torch.device("cuda:0"))
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    for _ in range(repeats + 1):
        comm.broadcast(buffer, 0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()


def link_rate_gbs(nbytes: int = GiB, repeats: int = 10) -> float:
    """Best rate of an NCCL broadcast GPU 0 -> GPU 1 (a second process on GPU 1)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with visible(ENGINE_GPU):
        peer = mp.get_context("spawn").Process(target=_link_peer, args=(port, nbytes, repeats))
        peer.start()
    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=2)
    comm = PyNcclCommunicator(group, device=torch.device("cuda:0"))
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.current_stream()
    comm.broadcast(buffer, 0, stream=stream)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        comm.broadcast(buffer, 0, stream=stream)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    peer.join(60)
    del buffer
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def ray_calls(engine: Any) -> dict[str, float]:
    """A Ray engine's last update calls: the round trip, and the part of it spent in the actor
    (the rest is Ray and the actor's event loop)."""
    found: dict[str, float] = {}
    for call, (round_trip, in_actor) in getattr(engine, "call_times", {}).items():
        if call in ("take_update", "weights.commit", "pause", "resume"):
            found[f"ray {call} ms"] = round_trip * 1e3
            found[f"ray {call} in actor ms"] = in_actor * 1e3
    return found


async def ours(res: Results, engines: Engines, s: str, folder: Path,
               tensors: dict[str, torch.Tensor], util: float, repeats: int,
               results: dict[str, Any]) -> None:
    steps = itertools.count(1)
    async with engines.start(folder, f"ours-{s}", load_format="dummy",
                             gpu_memory_utilization=util) as engine:
        for bucket_mib, buffers in ((512, 2), (512, 3), (1024, 2)):
            label = f"asyncroll broadcast plan {bucket_mib} MiB x{buffers}"
            pusher = WeightPusher([engine], backend="broadcast", bucket_bytes=bucket_mib << 20,
                                  buffers=buffers)

            async def push(i: int, pusher: WeightPusher = pusher) -> dict[str, float]:
                r = await pusher.update(tensors, global_steps=next(steps))
                assert r.push is not None
                return {"update_ms": (r.push_seconds + r.finish_seconds) * 1e3,
                        "push_ms": r.push_seconds * 1e3, "finish_ms": r.finish_seconds * 1e3,
                        "sender_ms": r.push.seconds * 1e3, "pack_ms": r.push.pack_seconds * 1e3,
                        "total_with_pause_resume_ms": r.seconds * 1e3, **ray_calls(engine)}

            try:
                results[label] = await timed(repeats, push)
                # what the engine's workers took in the last push (its take's answer)
                delivery = pusher.channel.deliveries().get(engine.name)
                res.check(s, f"{label}: every tensor delivered and verified where verifiable",
                          delivery is not None and delivery.tensors == len(tensors)
                          and delivery.verified > 0, delivery)
                log(f"  {label}: {results[label]['update_ms']:.1f} ms")
            except Exception as exc:
                res.check(s, f"{label} ran", False, traceback.format_exc()[-2000:])
                log(f"  {label} failed: {exc!r}"[:400])
            finally:
                await pusher.aclose()
            res.record(s, "results", results)
        if hasattr(engine, "actor"):  # what a bare round trip to this actor costs
            trips = []
            for _ in range(50):
                started = time.perf_counter()
                await engine.actor.state.remote()
                trips.append((time.perf_counter() - started) * 1e3)
            res.record(s, "ray actor round trip ms (median of 50)", statistics.median(trips))


async def vllm_nccl(res: Results, engines: Engines, s: str, folder: Path,
                    tensors: dict[str, torch.Tensor], util: float, repeats: int,
                    results: dict[str, Any]) -> None:
    """vLLM's ``nccl`` backend as its docs show: ``trainer_init`` beside the engine's
    ``init_weight_transfer_engine``; per update ``start_weight_update``, ``update_weights``
    beside ``trainer_send_weights``, ``finish_weight_update``."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerSendWeightsArgs,
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with engines.start(folder, "vllm-nccl", local=True, load_format="dummy",
                             gpu_memory_utilization=util,
                             weight_transfer_config=WeightTransferConfig(backend="nccl")
                             ) as engine:
        llm = vllm_client(engine)
        init = asyncio.ensure_future(llm.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                       "world_size": 2})))
        group = await asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {
            "master_address": "127.0.0.1", "master_port": port, "world_size": 2})
        await init
        names = list(tensors)
        for label, packed in (("vLLM nccl packed 1 GiB x2 (default)", True),
                              ("vLLM nccl unpacked", False)):
            info = NCCLWeightTransferUpdateInfo(
                names=names, dtype_names=[str(t.dtype).removeprefix("torch.")
                                          for t in tensors.values()],
                shapes=[list(t.shape) for t in tensors.values()], packed=packed)
            args = NCCLTrainerSendWeightsArgs(group=group, packed=packed)

            async def push(i: int, info: Any = info, args: Any = args) -> dict[str, float]:
                started = time.perf_counter()
                await llm.start_weight_update()
                try:
                    receiving = asyncio.ensure_future(llm.update_weights(
                        WeightTransferUpdateRequest(update_info=asdict(info))))
                    await asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights,
                                            iter(tensors.items()), args)
                    await receiving
                finally:
                    await llm.finish_weight_update()
                return {"update_ms": (time.perf_counter() - started) * 1e3}

            try:
                results[label] = await timed(repeats, push)
                log(f"  {label}: {results[label]['update_ms']:.1f} ms")
            except Exception as exc:
                res.check(s, f"{label} ran", False, traceback.format_exc()[-2000:])
                log(f"  {label} failed: {exc!r}"[:400])
                break  # the group is out of step after a failure
            res.record(s, "results", results)


async def push_section(res: Results, engines: Engines, work: Path, size: str, repeats: int,
                       device: str, baseline: bool = True) -> None:
    s = f"push {size}"
    if device == "cpu":
        folder = make_tiny_model(work / "cpu-tiny", seed=3)
        tensors = weights_of(folder, "cpu")
        rate = 0.0
    else:
        folder = write_config(work / size, SHAPES[size])
        tensors = random_weights(SHAPES[size])
        rate = link_rate_gbs()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    limit_ms = nbytes / rate / 1e6 if rate else 0.0
    res.record(s, "payload", {"GiB": round(nbytes / GiB, 3), "tensors": len(tensors),
                              "link GB/s (NCCL broadcast 1 GiB, GPU 0 -> 1)": round(rate, 1),
                              "link limit ms": round(limit_ms, 2)})
    log(f"{size}: {nbytes / GiB:.2f} GiB in {len(tensors)} tensors; link {rate:.0f} GB/s, "
        f"limit {limit_ms:.1f} ms")
    util = 0.4 if size == "7b" else 0.25
    results: dict[str, Any] = {}
    await ours(res, engines, s, folder, tensors, util, repeats, results)
    gc.collect()
    if device == "cuda" and baseline:
        torch.cuda.empty_cache()
        await vllm_nccl(res, engines, s, folder, tensors, util, repeats, results)
    for r in results.values():
        if limit_ms:
            r["limit / this"] = round(limit_ms / r["update_ms"], 3)
            r["x link limit"] = round(r["update_ms"] / limit_ms, 3)
    ours_best = min((r["update_ms"] for k, r in results.items() if k.startswith("asyncroll")),
                    default=None)
    vllm_best = min((r["update_ms"] for k, r in results.items() if k.startswith("vLLM")),
                    default=None)
    if ours_best and vllm_best:
        res.record(s, "vLLM best / asyncroll best", round(vllm_best / ours_best, 2))
    res.record(s, "results", results)
    for name, r in results.items():
        log(f"  {name}: {r['update_ms']:.1f} ms" + (
            f" ({r['x link limit']:.2f}x the link limit)" if limit_ms else ""))


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--sections", default="correctness,push")
    parser.add_argument("--sizes", default="1.5b,7b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", choices=["ray", "local"], default="ray")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--no-baseline", action="store_true", help="skip vLLM's nccl path")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        log("gpu_broadcast needs two GPUs; skipped")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    res = Results(args.out)
    res.path = args.out / "gpu_broadcast.json"
    res.data = {}
    if args.device == "cuda":
        res.record("env", "gpus", [torch.cuda.get_device_name(i) for i in range(2)])
    res.record("env", "torch", torch.__version__)
    res.record("env", "engine", args.engine)
    engines = Engines(args.engine, args.device)
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps: list[tuple[str, Any]] = []
        if "correctness" in sections:
            steps.append(("correctness", lambda: correctness(res, engines, work, args.device)))
        if "push" in sections:
            for size in args.sizes.split(","):
                steps.append((f"push {size}", lambda size=size: push_section(
                    res, engines, work, size, args.repeats, args.device, not args.no_baseline)))
        await run_steps(res, steps)
    return finish(res)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
