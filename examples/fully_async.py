"""Fully-async training on CPU: rollouts stream through the manager while the trainer learns.

    .venv/bin/python examples/fully_async.py [--steps 30] [--plot demo.png]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import uvloop
from tqdm import tqdm

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.recipes import BandTask, StepRecord, format_table, plot, run_fully_async
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer


async def main(steps: int, max_staleness: int, plot_path: str | None) -> list[StepRecord]:
    task = BandTask()
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "policy", seed=0)
        trainer = ReferenceTrainer(model)
        print("starting a vLLM CPU engine on a tiny random Qwen2 (20-40 s)...", flush=True)
        async with (
            VLLMEngine.launch(model, max_model_len=128) as engine,
            AsyncServerManager([engine], resume_mode="abort") as manager,
        ):
            started = time.perf_counter()
            with tqdm(total=steps, desc="fully-async", unit="step") as bar:

                def on_step(record: StepRecord) -> None:
                    bar.set_postfix(reward=f"{record.reward:.3f}", stale=record.staleness_max)
                    bar.update()

                records = await run_fully_async(
                    manager, trainer, task, steps=steps, max_staleness=max_staleness,
                    on_step=on_step,
                )
            elapsed = time.perf_counter() - started
    print(format_table(records))
    first, last = records[0].reward, sum(r.reward for r in records[-5:]) / min(5, len(records))
    print(f"reward: random policy {task.random_policy_reward:.3f}, first step {first:.3f}, "
          f"last 5 steps {last:.3f}; {steps} steps in {elapsed:.0f} s")
    if plot_path:
        title = "asyncroll fully-async on a tiny Qwen2 (CPU)"
        print("wrote", plot(records, plot_path, title=title))
    return records


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    uvloop.run(main(args.steps, args.max_staleness, args.plot))
