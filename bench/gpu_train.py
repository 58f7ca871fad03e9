"""The recipes measured end to end: synchronous, one-step-off and fully-async training of a real
model shape (random weights, made here) on a generation-heavy task, in one layout per run.

    python bench/gpu_train.py --layout hybrid1 --out OUT          # one GPU, trainer and engine
    python bench/gpu_train.py --layout split2 --out OUT           # trainer GPU 0, engine GPU 1
    torchrun --nproc-per-node 2 bench/gpu_train.py --layout fsdp2 --out OUT   # FSDP2 + TP=2

Layouts:
- ``hybrid1``: one GPU. Synchronous is hybrid (the engine sleeps while the trainer trains, its
  memory freed); one-step-off and fully-async share the GPU, both awake (they overlap).
- ``split2``: the trainer on GPU 0, the engine on GPU 1; weights by NCCL broadcast.
- ``fsdp2``: an FSDP2 trainer of N ranks and a TP=N engine on the same N GPUs (rank 0 holds
  the engine and runs the recipe; the other ranks follow its commands). Synchronous is hybrid
  as in ``hybrid1``.

Each run first measures G (one batch's rollout, the trainer idle) and T (one trainer step on
that batch, the engine idle), twice each after a warm-up, so the ideal speed-up of overlapping
them, (G + T) / max(G, T), is known from the same run. Then each recipe trains from the same
initial weights for ``--steps`` steps (its first step, which fills the pipeline and warms up
kernels, is not timed): steps per hour, rollout tokens/s, the trainer's and the engine's busy
shares, the update's stall and its stages, staleness and the reward curve. JSON and a plot go to
``--out``. ``--shape tiny --layout hybrid1`` runs the same code on the CPU (a smoke test).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from asyncroll import AsyncServerManager, DistributedWeightPusher, VLLMEngine, WeightPusher
from asyncroll.distributed import torchrun_hidden
from asyncroll.recipes import (
    BandTask,
    BandTaskSource,
    StepRecord,
    format_table,
    run_fully_async,
    run_one_step_off,
    run_synchronous,
)
from asyncroll.recipes.rollout import generate_batch
from asyncroll.testing import make_tiny_model
from asyncroll.testing.tiny_model import SHAPES, make_model
from asyncroll.trainer import ReferenceTrainer, TrainMetrics, TrainSample

transformers.utils.logging.disable_progress_bar()

RECIPES = {"sync": run_synchronous, "one_step_off": run_one_step_off,
           "fully_async": run_fully_async}
def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- where things run --------------------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def engine_environment(gpu: int | None) -> Iterator[None]:
    """While vLLM starts its processes: only GPU ``gpu`` visible (None: all), and torchrun's
    variables hidden (vLLM's workers would join the trainer's process group)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is not None:  # our GPU ``gpu`` is the gpu-th of those we see
        ours = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = ours[gpu]
    try:
        with torchrun_hidden():
            yield
    finally:
        if gpu is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible


def engine_arguments(args: argparse.Namespace, *, cuda: bool, shared: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "max_model_len": args.prompt_len + args.response_len + 64,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": world() if args.layout == "fsdp2" else 1,
    }
    if cuda:
        extra |= {"async_scheduling": False, "enforce_eager": args.eager,
                  "gpu_memory_utilization": args.engine_memory if shared else 0.85,
                  "enable_sleep_mode": shared, "dtype": "bfloat16"}
    return extra


# -- the distributed trainer: rank 0 leads, the others follow ------------------------------------


class LeaderTrainer:
    """Rank 0's face of an FSDP2 trainer of N ranks, as a recipe sees a ``Trainer``: each step
    sends the batch to every rank (each trains on its share of the groups); each push is made
    by every rank at once (``FollowingManager`` tells the others)."""

    def __init__(self, trainer: ReferenceTrainer) -> None:
        self.trainer = trainer
        self.model = trainer.model

    def step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        command(("step", list(samples)))
        return self.trainer.step(own_share(samples))

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.trainer.model.named_parameters()


class FollowingManager(AsyncServerManager):
    """Rank 0's manager: every update is also made by the other ranks (their shards)."""

    async def update_weights(self, named_tensors: Any, *, global_steps: int | None,
                             changed: bool = False) -> Any:
        command(("push", global_steps))
        return await super().update_weights(named_tensors, global_steps=global_steps,
                                            changed=changed)


def command(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def own_share(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """Whole groups (GRPO's baseline is per group), dealt round-robin over the ranks."""
    return [s for s in samples if s.group % world() == rank()]


async def follow(trainer: ReferenceTrainer, pusher: DistributedWeightPusher) -> None:
    """Ranks other than 0: train and push as rank 0 says, until it says stop."""
    while True:
        kind, value = command(None)
        if kind == "stop":
            return
        if kind == "step":
            await asyncio.to_thread(trainer.step, own_share(value))
        elif kind == "push":
            await pusher.update(trainer.model.named_parameters(), global_steps=value)
        elif kind == "fresh":
            del trainer
            empty_cache()
            trainer = make_trainer(value)


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cuda else MixedPrecisionPolicy()
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


TRAINER_OPTIONS: dict[str, Any] = {}


def make_trainer(model: Path) -> ReferenceTrainer:
    return ReferenceTrainer(model, **TRAINER_OPTIONS)


# -- one run -------------------------------------------------------------------------------------


def make_policy(args: argparse.Namespace, folder: Path) -> Path:
    if args.shape == "tiny":
        return make_tiny_model(folder / "policy", seed=0)
    return make_model(folder / "policy", args.shape, seed=0,
                      max_position_embeddings=args.prompt_len + args.response_len + 64)


@contextlib.asynccontextmanager
async def served(args: argparse.Namespace, model: Path) -> AsyncIterator[
        tuple[AsyncServerManager | None, VLLMEngine | None, DistributedWeightPusher | None]]:
    """The engine and the manager (rank 0), and for ``fsdp2`` the sharded pusher (every rank)."""
    cuda = torch.cuda.is_available()
    async with contextlib.AsyncExitStack() as stack:
        engine = None
        if rank() == 0:
            gpu = 1 if args.layout == "split2" else None
            shared = args.layout != "split2"
            with engine_environment(gpu if cuda else None):
                engine = await stack.enter_async_context(VLLMEngine.launch(
                    model, **engine_arguments(args, cuda=cuda, shared=shared)))
        if args.layout == "fsdp2":
            dist.barrier()
            pusher = DistributedWeightPusher([engine] if engine else [], dtype=torch.bfloat16)
            stack.push_async_callback(pusher.aclose)
            manager = None
            if rank() == 0:
                manager = await stack.enter_async_context(
                    FollowingManager([engine], weights=pusher, resume_mode=args.resume_mode))
            yield manager, engine, pusher
            return
        weights = WeightPusher([engine], backend="broadcast") if (
            args.layout == "split2" and cuda) else None
        manager = await stack.enter_async_context(
            AsyncServerManager([engine], weights=weights, resume_mode=args.resume_mode))
        yield manager, engine, None


async def lead(args: argparse.Namespace, model: Path, manager: AsyncServerManager,
               engine: VLLMEngine) -> dict[str, Any]:
    """Rank 0: G and T alone, then each recipe from the same initial weights."""
    task = BandTask.for_vocabulary(json.loads((model / "config.json").read_text())["vocab_size"],
                                   response_len=args.response_len, prompt_len=args.prompt_len)
    source = BandTaskSource(task)
    sharded = args.layout == "fsdp2"
    result: dict[str, Any] = {"random_policy_reward": task.random_policy_reward}

    def fresh_trainer() -> Any:
        if sharded:
            command(("fresh", model))
            return LeaderTrainer(make_trainer(model))
        return make_trainer(model)

    # G and T alone (each after a warm-up): the ideal overlap's inputs.
    trainer = fresh_trainer()
    await push(manager, trainer)
    rng = random.Random(12345)
    generation, training = [], []
    for i in range(3):
        began = time.perf_counter()
        batch = await generate_batch(manager, source, rng, first_group=10_000 + i * 100,
                                     groups=args.groups, group_size=args.group_size)
        generation.append(time.perf_counter() - began)
        began = time.perf_counter()
        await asyncio.to_thread(trainer.step, batch.samples)
        sync_device()
        training.append(time.perf_counter() - began)
        tokens = sum(len(s.response_ids) for s in batch.samples)
        log(f"alone {i}: rollout {generation[-1]:.2f} s ({tokens} tokens), "
            f"train {training[-1]:.2f} s")
    g, t = statistics.mean(generation[1:]), statistics.mean(training[1:])
    result["alone"] = {"rollout_seconds": generation, "train_seconds": training, "G": g, "T": t,
                       "ideal_speedup": (g + t) / max(g, t)}
    log(f"G {g:.2f} s, T {t:.2f} s: ideal overlap speed-up (G+T)/max(G,T) = "
        f"{(g + t) / max(g, t):.2f}")
    del trainer
    empty_cache()

    result["recipes"] = {}
    for name in args.recipes.split(","):
        trainer = fresh_trainer()
        await push(manager, trainer)
        options: dict[str, Any] = {"steps": args.steps, "batch_groups": args.groups,
                                   "group_size": args.group_size, "seed": 0}
        if name == "sync" and args.layout != "split2":
            options["hybrid"] = True
        if name == "fully_async":
            options["max_staleness"] = args.max_staleness
        busy: list[tuple[float, float]] = []
        """(when, the engine's busy seconds), read together at each step's end."""

        def sample() -> tuple[float, float]:
            return time.perf_counter(), sum(manager.statistics().busy_seconds.values())

        def on_step(record: StepRecord, busy: list[tuple[float, float]] = busy,
                    name: str = name) -> None:
            busy.append(sample())
            log(f"{name} step {record.step}: reward {record.reward:.3f}, "
                f"{record.wall_seconds:.2f} s, update {record.update_seconds * 1e3:.1f} ms")

        log(f"{name}: {args.steps} steps")
        busy.append(sample())
        records = await RECIPES[name](manager, trainer, source, on_step=on_step, **options)
        result["recipes"][name] = summarize(records, busy, args)
        print(format_table(records), flush=True)
        del trainer
        empty_cache()
    return result


async def push(manager: AsyncServerManager, trainer: Any) -> None:
    """The trainer's weights into the engine, as the next version (a fresh start per recipe)."""
    await manager.update_weights(trainer.named_parameters(),
                                 global_steps=(manager.global_steps or 0) + 1)


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summarize(records: list[StepRecord], busy: list[tuple[float, float]],
              args: argparse.Namespace) -> dict[str, Any]:
    timed = records[1:]  # the first step fills the pipeline and warms up
    wall = sum(r.wall_seconds for r in timed)
    tokens = sum(r.tokens for r in timed)
    # The busy share over the span its own readings bound (the steps' clock is read apart).
    (t0, b0), (t1, b1) = (busy[1], busy[-1]) if len(busy) > 2 else ((0.0, 0.0), (0.0, 0.0))
    engine_busy = (b1 - b0) / (t1 - t0) if t1 > t0 else float("nan")
    updates = [r.update_seconds for r in timed]
    return {
        "steps_per_hour": 3600 * len(timed) / wall,
        "seconds_per_step": wall / len(timed),
        "rollout_tokens_per_second": tokens / wall,
        "trainer_busy": sum(r.train_seconds for r in timed) / wall,
        "engine_busy": engine_busy,
        "update_ms_median": 1e3 * statistics.median(updates),
        "push_ms_median": 1e3 * statistics.median(r.push_seconds for r in timed),
        "pause_ms_median": 1e3 * statistics.median(r.pause_seconds for r in timed),
        "staleness_max": max(r.staleness_max for r in records),
        "steps": [
            {"step": r.step, "reward": r.reward, "wall_seconds": r.wall_seconds,
             "train_seconds": r.train_seconds, "tokens": r.tokens, "samples": r.samples,
             "update_ms": r.update_seconds * 1e3, "push_ms": r.push_seconds * 1e3,
             "pause_ms": r.pause_seconds * 1e3, "staleness_p50": r.staleness_p50,
             "staleness_max": r.staleness_max, "kl_k3": r.kl_k3, "kl_k3_fresh": r.kl_k3_fresh}
            for r in records
        ],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    alone = result["alone"]
    recipes = result["recipes"]
    sync = recipes.get("sync")
    lines = [
        f"layout {args.layout}, shape {args.shape}, {args.groups}x{args.group_size} samples of "
        f"{args.response_len} tokens a step; G {alone['G']:.2f} s, T {alone['T']:.2f} s, "
        f"ideal speed-up {alone['ideal_speedup']:.2f}",
        "recipe          steps/h   s/step  vs sync  of ideal  tok/s    trainer  engine  "
        "update ms  (push)  stale",
    ]
    for name, r in recipes.items():
        speedup = sync["seconds_per_step"] / r["seconds_per_step"] if sync else float("nan")
        lines.append(
            f"{name:<14} {r['steps_per_hour']:8.0f} {r['seconds_per_step']:8.2f} "
            f"{speedup:7.2f}x {speedup / alone['ideal_speedup']:8.0%} "
            f"{r['rollout_tokens_per_second']:7.0f} {r['trainer_busy']:8.0%} "
            f"{r['engine_busy']:7.0%} {r['update_ms_median']:9.1f} ({r['push_ms_median']:.1f})"
            f" {r['staleness_max']:5d}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, r in result["recipes"].items():
        samples, seconds, total, rewards = [], [], 0.0, []
        for i, step in enumerate(r["steps"]):
            total += step["wall_seconds"]
            samples.append((i + 1) * step["samples"])
            seconds.append(total)
            rewards.append(step["reward"])
        by_samples.plot(samples, rewards, marker="o", label=name)
        by_time.plot(seconds, rewards, marker="o", label=name)
    for axis, label in ((by_samples, "samples trained on"), (by_time, "wall seconds")):
        axis.axhline(result["random_policy_reward"], color="grey", lw=0.8, ls=":")
        axis.set(xlabel=label, ylabel="mean reward")
        axis.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


async def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    TRAINER_OPTIONS.update(
        device=device, lr=args.lr, micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing, max_grad_norm=1.0,
        wrap=shard if args.layout == "fsdp2" else None, threads=None,
    )
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if rank() == 0:
            model = make_policy(args, folder)
        if args.layout == "fsdp2":
            model = Path(command(str(model) if rank() == 0 else None))
        machine = (f"{world() if args.layout == 'fsdp2' else 1 + (args.layout == 'split2')}x "
                   f"{torch.cuda.get_device_name(0)}" if cuda else "CPU")
        if rank() == 0:
            log(f"{args.layout} on {machine}: shape {args.shape}, trainer on {device}")
        async with served(args, model) as (manager, engine, pusher):
            if rank() != 0:
                assert pusher is not None
                await follow(make_trainer(model), pusher)
                return
            assert manager is not None and engine is not None
            try:
                result = await lead(args, model, manager, engine)
            finally:
                if args.layout == "fsdp2":
                    command(("stop", None))
    result |= {"layout": args.layout, "shape": args.shape, "machine": machine,
               "arguments": vars(args), "torch": torch.__version__}
    name = f"gpu_train-{args.layout}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    text = report(result, args)
    (out / f"{name}.txt").write_text(text + "\n")
    print(text, flush=True)
    plot(result, out / f"{name}.png", f"asyncroll recipes, {args.layout} on {machine}, "
                                     f"{args.shape}: reward by samples and by time")
    log(f"wrote {out / name}.json, .txt, .png")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("hybrid1", "split2", "fsdp2"), required=True)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=("tiny", *SHAPES))
    parser.add_argument("--recipes", default="sync,one_step_off,fully_async")
    parser.add_argument("--steps", type=int, default=6, help="per recipe; the first is untimed")
    parser.add_argument("--groups", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=None,
                        help="default: 3e-3 x 128 / hidden size (the examples' rule)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--resume-mode", default="keep", choices=("abort", "keep", "recompute"))
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--engine-memory", type=float, default=0.35,
                        help="the engine's GPU share where it shares its GPU with the trainer")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs in the engine")
    args = parser.parse_args()
    if not set(args.recipes.split(",")) <= set(RECIPES):
        parser.error(f"--recipes: choose from {', '.join(RECIPES)}")
    if args.lr is None:
        hidden = 128 if args.shape == "tiny" else SHAPES[args.shape]["hidden_size"]
        args.lr = 3e-3 * 128 / hidden
    if args.layout == "fsdp2" and "LOCAL_RANK" not in os.environ:
        parser.error("--layout fsdp2 runs under torchrun --nproc-per-node N")
    if args.layout == "split2" and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        parser.error("--layout split2 needs two GPUs")
    return args


if __name__ == "__main__":
    options = arguments()
    Path(options.out).mkdir(parents=True, exist_ok=True)
    if options.layout == "fsdp2":
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        asyncio.run(main(options))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(0)
