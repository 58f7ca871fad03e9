"""Hybrid training on N ranks: an FSDP2-sharded trainer and a tensor-parallel vLLM engine on the
same devices. Rank 0 holds the engine (TP = N) and the manager; every rank trains on its share of
each batch while the engine sleeps, then every rank pushes: each gathers the full tensors bucket
by bucket and hands them to the engine worker of its own rank (``DistributedWeightPusher``).

    torchrun --nproc-per-node N examples/fsdp_hybrid.py [--steps 10] [--plot fsdp.png]
        [--model PATH] [--response-len 8] [--lr LR]

On CPU (gloo, shared memory; the tiny random Qwen2 of the demo) as on N GPUs (NCCL, CUDA IPC: one
rank per GPU, the engine's worker r on GPU r; the trainer in bf16 mixed precision: FSDP2 gathers
bf16 parameters, reduces fp32 gradients, and keeps fp32 shards and optimiser state).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's INFO pages bury the run's

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncroll import (
    AsyncServerManager,
    DistributedWeightPusher,
    InvalidRequestError,
    VLLMEngine,
    frozen_heap,
)
from asyncroll.distributed import torchrun_hidden
from asyncroll.recipes import BandTask, BandTaskSource
from asyncroll.recipes.rollout import generate_batch
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer, check_checkpoint


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


async def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    async with contextlib.AsyncExitStack() as stack:
        model = args.model if args.model is not None else make_model(rank, stack)
        config = json.loads((model / "config.json").read_text())
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        lr = args.lr if args.lr is not None else 3e-3 * 128 / config["hidden_size"]
        trainer = ReferenceTrainer(model, device=device, wrap=shard, lr=lr)
        task = BandTask.for_vocabulary(config["vocab_size"], response_len=args.response_len)
        engines: list[VLLMEngine] = []
        if rank == 0:
            where = f"{world} GPUs" if cuda else "the CPU"
            print(f"{config['architectures'][0]} on {where}: trainer {trainer!r}; starting a vLLM "
                  f"engine with tensor_parallel_size={world}...", flush=True)
            with torchrun_hidden():
                engine = await stack.enter_async_context(VLLMEngine.launch(
                    model, tensor_parallel_size=world, skip_tokenizer_init=True,
                    max_model_len=max(128, args.response_len + 64), **gpu_arguments(args, cuda)))
            engines = [engine]
        dist.barrier()  # the others wait here (not in the pusher's group set-up) for the engine
        pusher = DistributedWeightPusher(engines, dtype=torch.bfloat16)
        stack.push_async_callback(pusher.aclose)
        manager = None
        if rank == 0:
            manager = await stack.enter_async_context(
                AsyncServerManager(engines, weights=pusher))
        stack.enter_context(frozen_heap())  # start-up's heap out of the collector's walks
        await train(args, trainer, task, pusher, manager, engines)


def make_model(rank: int, stack: contextlib.AsyncExitStack) -> Path:
    """A tiny model, written by rank 0 into a folder the ranks share and removed at the end."""
    folder = Path(broadcast(tempfile.mkdtemp(prefix="asyncroll-fsdp-") if rank == 0 else None))
    if rank == 0:
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        # TP=N splits the attention heads: N of them at least (64 each, as the CPU wants).
        heads = max(2, dist.get_world_size())
        make_tiny_model(folder / "policy", seed=0, num_attention_heads=heads,
                        num_key_value_heads=heads, hidden_size=64 * heads)
    dist.barrier()
    return folder / "policy"


def gpu_arguments(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """On GPUs: sleep mode (the engine sleeps while the ranks train), room for the trainer."""
    if not cuda:
        return {}
    extra: dict[str, Any] = {"enable_sleep_mode": True, "gpu_memory_utilization": 0.3,
                             "enforce_eager": True, "async_scheduling": False,
                             "dtype": "bfloat16"}
    if args.model is None:
        extra["kv_cache_memory_bytes"] = 2 << 30
    return extra


async def train(args: argparse.Namespace, trainer: ReferenceTrainer, task: BandTask,
                pusher: DistributedWeightPusher, manager: AsyncServerManager | None,
                engines: list[VLLMEngine]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = random.Random(0)
    rewards, pushes = [], []
    for step in range(1, args.steps + 1):
        samples = None
        began = time.perf_counter()
        if manager is not None:
            batch = await generate_batch(manager, BandTaskSource(task), rng,
                                         first_group=step * 4, groups=4, group_size=8)
            samples = batch.samples
            await asyncio.gather(*(e.sleep(1) for e in engines))  # frees the GPU to train
        samples = broadcast(samples)
        mine = [s for s in samples if s.group % world == rank]  # whole groups: GRPO's baseline
        trained = time.perf_counter()
        metrics = await asyncio.to_thread(trainer.step, mine)
        train_seconds = time.perf_counter() - trained
        if manager is not None:
            await asyncio.gather(*(e.wake_up(["weights"]) for e in engines))
            report = await manager.update_weights(trainer.model.named_parameters(),
                                                  global_steps=step)
            await asyncio.gather(*(e.wake_up(["kv_cache", "scheduling"]) for e in engines))
        else:
            report = await pusher.update(trainer.model.named_parameters(), global_steps=step)
        rewards.append(sum(s.reward for s in samples) / len(samples))
        pushes.append(report.push_seconds * 1e3)
        if rank == 0:
            print(f"step {step}: reward {rewards[-1]:.3f} loss {metrics.loss:+.4f} train "
                  f"{train_seconds:.2f} s, step {time.perf_counter() - began:.2f} s; update "
                  f"{report.seconds * 1e3:.1f} ms, push {pushes[-1]:.1f} ms "
                  f"({report.bytes / 2**20:.1f} MiB from {world} ranks, {report.verified} "
                  "tensors verified)", flush=True)
    if rank == 0:
        print(f"reward: first step {rewards[0]:.3f}, last {rewards[-1]:.3f}; random policy "
              f"{task.random_policy_reward:.3f}", flush=True)
        if args.plot:
            plot(rewards, pushes, args.plot)


def plot(rewards: list[float], pushes: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(range(1, len(rewards) + 1), rewards)
    left.set(xlabel="step", ylabel="mean reward", title="reward")
    right.plot(range(1, len(pushes) + 1), pushes)
    right.set(xlabel="step", ylabel="ms", title="push (every rank at once)")
    figure.tight_layout()
    figure.savefig(path)
    print("wrote", path, flush=True)


def check(args: argparse.Namespace) -> None:
    """Bad arguments stop every rank before any engine or process group starts."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1 or "LOCAL_RANK" not in os.environ:
        sys.exit("error: run under torchrun: torchrun --nproc-per-node N examples/fsdp_hybrid.py")
    try:
        if args.model is not None:
            check_checkpoint(args.model)
    except InvalidRequestError as exc:
        sys.exit(f"error: {exc}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and int(os.environ.get("LOCAL_WORLD_SIZE", world)) > gpus:
        sys.exit(f"error: {os.environ.get('LOCAL_WORLD_SIZE', world)} ranks on this machine but "
                 f"{gpus} GPU(s): one rank a GPU (--nproc-per-node {gpus} at most)")
    if args.steps < 1 or args.response_len < 1:
        sys.exit("error: --steps and --response-len must be at least 1")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--model", type=Path, default=None,
                        help="a local Hugging Face checkpoint (default: a tiny random Qwen2)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--response-len", type=int, default=8)
    arguments = parser.parse_args()
    check(arguments)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    started = time.perf_counter()
    asyncio.run(main(arguments))
    if dist.get_rank() == 0:
        print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
