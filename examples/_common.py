"""Set-up shared by the recipe scripts: a tiny policy, one engine, a manager, a trainer."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncroll import AsyncServerManager, VLLMEngine, serve_metrics
from asyncroll.recipes import (
    BandTask,
    BandTaskSource,
    RolloutSource,
    StepRecord,
    format_table,
    plot,
)
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer

Recipe = Callable[..., Awaitable[list[StepRecord]]]
SourceFactory = Callable[
    [AsyncServerManager, Path, contextlib.AsyncExitStack], Awaitable[RolloutSource]
]
"""Makes the rollout source once the manager serves: (manager, model folder, exit stack)."""


async def run_recipe(
    recipe: Recipe,
    name: str,
    *,
    steps: int,
    source: RolloutSource | SourceFactory | None = None,
    plot_path: str | None = None,
    metrics_port: int | None = None,
    use_ray: bool = False,
    **options: object,
) -> tuple[list[StepRecord], float]:
    """Run ``recipe`` on CPU with a progress bar; print the per-step table; plot if asked.

    ``source`` makes the rollouts; by default the toy ``BandTask``, one sampled turn each. A
    ``SourceFactory`` makes it once the engine is up (e.g. to open a gateway in front of it).
    ``metrics_port``: serve the manager's Prometheus metrics there (0: any free port).
    ``use_ray``: start a local Ray cluster and put the engine in a Ray actor (``RayEngine``)."""
    task = BandTask()
    baseline = f"random policy {task.random_policy_reward:.3f}, " if source is None else ""
    source = source or BandTaskSource(task)
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "policy", seed=0)
        trainer = ReferenceTrainer(model)
        print("starting a vLLM CPU engine on a tiny random Qwen2 (20-40 s)...", flush=True)
        launch = _ray_launch() if use_ray else VLLMEngine.launch
        async with (
            launch(model, max_model_len=128, skip_tokenizer_init=True) as engine,
            AsyncServerManager([engine], resume_mode="abort") as manager,
            contextlib.AsyncExitStack() as stack,
        ):
            if metrics_port is not None:
                server = await stack.enter_async_context(serve_metrics(manager, port=metrics_port))
                print(f"Prometheus metrics at {server.url}", flush=True)
            if callable(source):
                source = await source(manager, model, stack)
            started = time.perf_counter()
            with tqdm(total=steps, desc=name, unit="step") as bar:

                def on_step(record: StepRecord) -> None:
                    bar.set_postfix(reward=f"{record.reward:.3f}", stale=record.staleness_max)
                    bar.update()

                records = await recipe(
                    manager, trainer, source, steps=steps, on_step=on_step, **options
                )
            elapsed = time.perf_counter() - started
    print(format_table(records))
    last = records[-5:]
    final = sum(r.reward for r in last) / len(last)
    print(
        f"reward: {baseline}first step {records[0].reward:.3f}, last {len(last)} steps "
        f"{final:.3f}; {steps} steps in {elapsed:.0f} s"
    )
    if plot_path:
        print("wrote", plot(records, plot_path, title=f"asyncroll {name} on a tiny Qwen2 (CPU)"))
    return records, elapsed


def _ray_launch() -> Callable[..., Any]:
    import ray

    from asyncroll.ray import RayEngine

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        print("started a local Ray cluster: the engine runs in a Ray actor", flush=True)
    return RayEngine.launch


def arguments(default_steps: int = 30) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--plot", default=None, help="write the reward/staleness/push plot here")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this localhost port (0: any free one)")
    parser.add_argument("--ray", action="store_true",
                        help="run the engine in an actor of a local Ray cluster (the ray extra)")
    return parser.parse_args()
