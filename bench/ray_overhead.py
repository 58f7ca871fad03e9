"""What a Ray engine adds to a manager call, against a local engine (CPU, one machine).

Two real vLLM CPU engines on one tiny model: a local ``VLLMEngine`` and a ``RayEngine`` (the same
engine in a Ray actor). Each path sends ``--calls`` sequential ``manager.generate`` calls of one
token (the engine's work is a tiny prefill and one sample); the paths run alternately
``--repeats`` times and the median per call is reported. The floor is a bare Ray actor round
trip (an async method that returns at once), what any Ray-hosted engine pays per call.

    .venv/bin/python bench/ray_overhead.py [--calls 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.ray import RayEngine
from asyncroll.testing import make_tiny_model

PARAMS: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
ARGS: dict[str, Any] = {"max_model_len": 256, "skip_tokenizer_init": True}


class Echo:
    async def ping(self) -> None:
        return None


async def _per_call_ms(manager: AsyncServerManager, calls: int, tag: str) -> float:
    started = time.perf_counter()
    for i in range(calls):
        await manager.generate(f"{tag}-{i}", prompt_ids=[5, 6, 7, i % 400 + 10],
                               sampling_params=PARAMS)
    return (time.perf_counter() - started) / calls * 1e3


async def _floor_ms(actor: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await actor.ping.remote()
    return (time.perf_counter() - started) / calls * 1e3


async def main(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    echo: Any = ray.remote(Echo)
    actor = echo.options(num_cpus=0).remote()
    await actor.ping.remote()
    samples: dict[str, list[float]] = {"local": [], "ray": [], "ray floor": []}
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "m", seed=0)
        async with (VLLMEngine.launch(model, name="local", **ARGS) as local,
                    RayEngine.launch(model, name="ray", **ARGS) as remote,
                    AsyncServerManager([local]) as on_local,
                    AsyncServerManager([remote]) as on_ray):  # type: ignore[list-item]
            for manager, tag in ((on_local, "w-l"), (on_ray, "w-r")):
                await _per_call_ms(manager, 20, tag)  # warm-up
            for repeat in range(args.repeats):
                samples["local"].append(await _per_call_ms(on_local, args.calls, f"l{repeat}"))
                samples["ray"].append(await _per_call_ms(on_ray, args.calls, f"r{repeat}"))
                samples["ray floor"].append(await _floor_ms(actor, args.calls))
    ray.shutdown()
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {"calls": args.calls, "repeats": args.repeats, "ms_per_call": median,
            "ray_added_ms": median["ray"] - median["local"],
            "ray_over_local": median["ray"] / median["local"], "raw": samples}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    result = asyncio.run(main(parser.parse_args()))
    for name, ms in result["ms_per_call"].items():
        print(f"{name:>10}: {ms:7.3f} ms per call")
    print(f"a Ray engine adds {result['ray_added_ms']:.3f} ms per call "
          f"({result['ray_over_local']:.2f}x the local engine's call; the bare actor round trip "
          f"is {result['ms_per_call']['ray floor']:.3f} ms)")
    if parser.parse_args().json:
        Path(parser.parse_args().json).write_text(json.dumps(result, indent=2) + "\n")
