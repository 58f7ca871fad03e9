"""Synchronous vs one-step-off vs fully-async: same task, model and samples, one run.

The trainer gets one core (torch threads = 1) and the engine the other, so overlap can show.
Prints wall time, samples/s and final reward per recipe, and the speed-up ratios.

    .venv/bin/python bench/recipes.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from asyncroll import AsyncServerManager, ResumeMode, VLLMEngine
from asyncroll.recipes import BandTask, run_fully_async, run_one_step_off, run_synchronous
from asyncroll.testing import make_tiny_model
from asyncroll.trainer import ReferenceTrainer

RECIPES: dict[str, tuple[Any, dict[str, Any], ResumeMode]] = {
    "synchronous": (run_synchronous, {}, "abort"),
    "one-step-off": (run_one_step_off, {}, "abort"),
    "fully-async (abort resume)": (run_fully_async, {"max_staleness": 2}, "abort"),
    "fully-async (keep resume)": (run_fully_async, {"max_staleness": 2}, "keep"),
}


async def main(steps: int) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "policy", seed=0)
        async with VLLMEngine.launch(model, max_model_len=128, skip_tokenizer_init=True) as engine:
            for name, (recipe, options, mode) in RECIPES.items():
                trainer = ReferenceTrainer(model, threads=1)
                async with AsyncServerManager([engine], resume_mode=mode) as manager:
                    # every recipe starts from the same initial weights
                    await manager.update_weights(
                        trainer.named_parameters(), global_steps=(manager.global_steps or 0) + 1
                    )
                    print(f"{name}: {steps} steps...", flush=True)
                    started = time.perf_counter()
                    records = await recipe(manager, trainer, BandTask(), steps=steps, **options)
                    elapsed = time.perf_counter() - started
                samples = sum(r.samples for r in records)
                final = sum(r.reward for r in records[-5:]) / 5
                results[name] = (elapsed, samples / elapsed, final)
                print(f"  {elapsed:.1f} s, final reward {final:.3f}", flush=True)
    base = results["synchronous"][0]
    print("\n| recipe | wall s | samples/s | final reward (last 5) | speed-up vs synchronous |")
    print("|---|---|---|---|---|")
    for name, (elapsed, rate, final) in results.items():
        print(f"| {name} | {elapsed:.1f} | {rate:.1f} | {final:.3f} | {base / elapsed:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    uvloop.run(main(parser.parse_args().steps))
