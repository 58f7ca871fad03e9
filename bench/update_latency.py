"""Weight-update latency into a real vLLM CPU engine, pause to resume, split by stage.

One run measures, for each model size: asyncroll's update (pause, push, finish: the commit,
which includes the new prefix-cache epoch, resume; one ``WeightPusher`` for the engine's life)
vs a baseline that sends the weights as one safetensors blob through vLLM's own
``collective_rpc`` (what many RL stacks do) vs the physical limit of a staged push (two memcpys
of the payload at this machine's measured copy rate).

    .venv/bin/python bench/update_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import uvloop
from safetensors.torch import load_file, save

from asyncroll import VLLMEngine, WeightPusher
from asyncroll.testing import make_tiny_model, vllm_client
from asyncroll.testing.probes import PROBES_EXTENSION

MODELS = {
    "tiny (0.4M)": {},
    "~110M": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 10,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
}


def memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


async def measure(path: Path, repeats: int) -> dict[str, float]:
    weights = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    # the probes extension: the baseline's ``asyncroll_load_serialized``
    async with VLLMEngine.launch(path, max_model_len=512, skip_tokenizer_init=True,
                                 worker_extension_cls=PROBES_EXTENSION) as engine:
        pusher = WeightPusher([engine])  # attached once, kept for the engine's life
        try:
            await pusher.update(weights, global_steps=1)  # connect, warm up
            reports = []
            for i in range(repeats):
                reports.append(await pusher.update(weights, global_steps=2 + i))
                print(f"  push {i + 1}/{repeats}: {reports[-1].seconds * 1e3:.1f} ms", flush=True)
            blob = save(weights)
            baseline = []
            for _ in range(repeats):
                start = time.perf_counter()
                await engine.pause("abort")
                await engine.collective_rpc("asyncroll_load_serialized", args=(blob,))
                await vllm_client(engine).reset_prefix_cache()
                await engine.resume()
                baseline.append(time.perf_counter() - start)
        finally:
            await pusher.aclose()
    med = statistics.median
    return {
        "bytes": nbytes,
        "total": med(r.seconds for r in reports),
        "pause": med(r.pause_seconds for r in reports),
        "push": med(r.push_seconds for r in reports),
        "finish": med(r.finish_seconds for r in reports),
        "resume": med(r.resume_seconds for r in reports),
        "pack": med(r.push.pack_seconds for r in reports if r.push),
        "baseline": med(baseline),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    copy_rate = memcpy_gbps(256 << 20)  # before any engine runs: the machine's copy rate
    print(f"memcpy: {copy_rate:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for label, shape in MODELS.items():
            print(f"{label}: building and starting an engine...", flush=True)
            path = make_tiny_model(Path(folder) / label.replace(" ", "_"), seed=0, **shape)
            result = await measure(path, args.repeats)
            result["limit"] = 2 * result["bytes"] / (copy_rate * 1e9)
            rows.append((label, result))
    ms = 1e3
    print("\n| model | MiB | total ms | pause | push (pack) | finish (commit) | resume "
          "| baseline rpc ms | baseline / ours | 2-copy limit ms | ours / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(
            f"| {label} | {r['bytes'] / 2**20:.1f} | {r['total'] * ms:.1f} | {r['pause'] * ms:.1f}"
            f" | {r['push'] * ms:.1f} ({r['pack'] * ms:.1f}) | {r['finish'] * ms:.1f}"
            f" | {r['resume'] * ms:.1f} | {r['baseline'] * ms:.1f}"
            f" | {r['baseline'] / r['total']:.2f}x | {r['limit'] * ms:.2f}"
            f" | {r['total'] / r['limit']:.0f}x |"
        )


if __name__ == "__main__":
    uvloop.run(main())
