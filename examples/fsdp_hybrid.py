"""Hybrid training on N ranks: an FSDP2-sharded trainer and a tensor-parallel vLLM engine on the
same devices. Rank 0 holds the engine (TP = N) and the manager; every rank trains on its share of
each batch while the engine sleeps, then every rank pushes: each gathers the full tensors bucket
by bucket and hands them to the engine worker of its own rank (``DistributedWeightPusher``).

    torchrun --nproc-per-node 2 examples/fsdp_hybrid.py [--steps 10] [--plot fsdp.png]

On CPU (gloo, shared memory; the tiny random Qwen2 of the demo) as on GPUs (NCCL, CUDA IPC: one
rank per GPU, the engine's worker r on GPU r).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncroll import AsyncServerManager, DistributedWeightPusher, VLLMEngine
from asyncroll.recipes import BandTask, BandTaskSource
from asyncroll.recipes.rollout import generate_batch
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""torchrun's variables, hidden from vLLM while it launches (``bench/gpu_multi.py`` hides the
same ones, and its TP=2 engines start on GPUs under torchrun)."""


@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    """vLLM's worker processes inherit our environment: torchrun's rank variables would make
    them join the trainer's process group instead of their own."""
    saved = {name: os.environ.pop(name) for name in TORCHRUN_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


async def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(broadcast(tempfile.mkdtemp(prefix="asyncroll-fsdp-") if rank == 0 else None))
    if rank == 0:
        make_tiny_model(folder / "policy", seed=0)
    dist.barrier()
    trainer = ReferenceTrainer(folder / "policy", wrap=shard)
    dtype = torch.bfloat16
    async with contextlib.AsyncExitStack() as stack:
        engines: list[VLLMEngine] = []
        if rank == 0:
            print(f"starting a vLLM engine with tensor_parallel_size={world}...", flush=True)
            with engine_environment():
                engine = await stack.enter_async_context(VLLMEngine.launch(
                    folder / "policy", tensor_parallel_size=world, max_model_len=128,
                    skip_tokenizer_init=True, enable_sleep_mode=torch.cuda.is_available()))
            engines = [engine]
        dist.barrier()  # the others wait here (not in the pusher's group set-up) for the engine
        pusher = DistributedWeightPusher(engines, dtype=dtype)
        stack.push_async_callback(pusher.aclose)
        manager = None
        if rank == 0:
            manager = await stack.enter_async_context(
                AsyncServerManager(engines, weights=pusher))
        await train(args, trainer, pusher, manager, engines)


async def train(args: argparse.Namespace, trainer: ReferenceTrainer,
                pusher: DistributedWeightPusher, manager: AsyncServerManager | None,
                engines: list[VLLMEngine]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    task, rng = BandTask(), random.Random(0)
    rewards, pushes = [], []
    for step in range(1, args.steps + 1):
        samples = None
        if manager is not None:
            batch = await generate_batch(manager, BandTaskSource(task), rng,
                                         first_group=step * 4, groups=4, group_size=8)
            samples = batch.samples
            await asyncio.gather(*(e.sleep(1) for e in engines))  # frees the GPU to train
        samples = broadcast(samples)
        mine = [s for s in samples if s.group % world == rank]  # whole groups: GRPO's baseline
        metrics = await asyncio.to_thread(trainer.step, mine)
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
            print(f"step {step}: reward {rewards[-1]:.3f} loss {metrics.loss:+.4f} push "
                  f"{pushes[-1]:.1f} ms ({report.bytes / 2**20:.1f} MiB from {world} ranks, "
                  f"{report.verified} tensors verified)", flush=True)
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--plot", default=None)
    arguments = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    started = time.perf_counter()
    asyncio.run(main(arguments))
    if dist.get_rank() == 0:
        print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
