"""Where one weight update's fixed costs go, phase by phase, in a real vLLM engine.

The sender, the worker and the pusher stamp ``time.perf_counter()`` (one clock for every
process of a Linux machine), so an update splits end to end: the receive RPC's way in, vLLM
starting the update in the worker, the receive, the worker's work after it, the RPC's way
back, the finish. Beside it, in the same run, the floor that vLLM's RPC sets: two no-op
``collective_rpc`` round trips (an update makes two RPCs: the receive and the finish).

A small model makes the fixed costs visible (on a CPU engine the copies of a 4-layer model
take microseconds; vLLM's layerwise reload, which the CPU build needs, does not). The same
split runs on the GPU in ``bench/gpu_e2e.py --sections push``.

Then the update on the idle engine in the transfer's two orders, alternating: the workers'
receive RPCs sent before the sender's first step (ours), or after it (baseline, before
2026-11-27).

Then the update as the trainer sees it while the engine generates (``--busy`` requests
decoding): ``update()`` returns once it has each engine's report of what its workers took,
which the take RPC brings back (``weights.take`` returns the ``Delivery``; the report's
``deliveries``). Until the weight port (``engine.weights``) this part was an A/B against
asking the workers once the engines resumed (the baseline before 2026-11-27, an RPC that a
busy engine answers only between two steps, switched in by patching
``VLLMEngine.last_delivery``); that path no longer exists, so the A/B is gone and only ours is
measured.

    .venv/bin/python bench/update_phases.py [--layers 4] [--repeats 30] [--busy 32] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import uvloop
from gpu_e2e import _rpc_round_trip_ms, update_phases  # (this folder: as on the GPU)
from safetensors.torch import load_file

from asyncroll import VLLMEngine, WeightPusher
from asyncroll.testing import make_tiny_model
from asyncroll.testing.probes import PROBES_EXTENSION
from asyncroll.weights import SenderChannel


async def measure(layers: int, repeats: int, busy: int, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = make_tiny_model(Path(folder) / "model", num_hidden_layers=layers)
        # CPU tensors go through shared memory, CUDA tensors through CUDA IPC
        stored = load_file(str(path / "model.safetensors"))
        weights = {name: tensor.to(device) for name, tensor in stored.items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        # on a GPU, as bench/gpu_e2e.py starts its engines (docs/gpu.md: async scheduling
        # stalled vLLM 0.24's start-up there); the model's own dtype, as the pushed weights
        gpu = ({"enforce_eager": True, "async_scheduling": False, "gpu_memory_utilization": 0.25}
               if device.startswith("cuda") else {})
        # the probes extension: the worker's report of each push, the no-op round trip
        async with VLLMEngine.launch(path, max_model_len=512, skip_tokenizer_init=True,
                                     worker_extension_cls=PROBES_EXTENSION, **gpu) as engine:
            pusher = WeightPusher([engine])
            steps = itertools.count(1)
            try:
                for _ in range(3):  # attach, warm up
                    await pusher.update(weights, global_steps=next(steps))
                rows = []
                for i in range(repeats):
                    report = await pusher.update(weights, global_steps=next(steps))
                    (worker,) = await engine.collective_rpc("asyncroll_last_receive_report")
                    row = update_phases(report, worker)
                    row["update: push + finish"] = (report.push_seconds
                                                    + report.finish_seconds) * 1e3
                    row["update: outside the pipeline"] = (
                        row["update: push + finish"] - row["phase: first message -> last ack"])
                    rows.append(row)
                    print(f"  update {i + 1}/{repeats}: {row['update: push + finish']:.2f} ms",
                          file=sys.stderr, flush=True)
                order_ms = await _by_order(pusher, weights, steps, repeats)
                busy_ms = await _while_busy(engine, pusher, weights, steps, repeats, busy)
            finally:
                await pusher.aclose()
            rtt_ms = await _rpc_round_trip_ms(engine)
    medians = {name: statistics.median(row[name] for row in rows) for name in rows[0]}
    return {"tensors": len(weights), "MiB": nbytes / 2**20, "repeats": repeats,
            "no-op collective_rpc round trip ms": rtt_ms, "phases ms (median)": medians,
            "update ms by the transfer's order (median)": order_ms,
            f"update() call ms with {busy} requests decoding (median)": busy_ms}


async def _by_order(pusher: WeightPusher, weights: dict[str, Any], steps: Iterator[int],
                    repeats: int) -> dict[str, float]:
    """The update (push + finish) with the workers' receive RPCs sent before the sender's
    first step (ours) or after it (baseline: the order before 2026-11-27), alternating."""
    times: dict[str, list[float]] = {"ours (receivers first)": [], "baseline (sender first)": []}
    for i in range(2 * repeats):
        variant = "baseline (sender first)" if i % 2 else "ours (receivers first)"
        with mock.patch.object(SenderChannel, "_receivers_first", not i % 2):
            report = await pusher.update(weights, global_steps=next(steps))
        times[variant].append((report.push_seconds + report.finish_seconds) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


async def _while_busy(engine: VLLMEngine, pusher: WeightPusher, weights: dict[str, Any],
                      steps: Iterator[int], repeats: int, busy: int) -> dict[str, float]:
    """``update()`` as its caller waits for it, ``busy`` requests decoding all along; the
    report of what the workers took comes back with their take (no A/B any more: module
    doc)."""
    params = {"max_tokens": 400, "ignore_eos": True}
    stop = asyncio.Event()

    async def decode(i: int) -> None:
        for j in itertools.count():
            if stop.is_set():
                return
            await engine.generate(f"busy-{i}-{j}", prompt_ids=[5, 6, 7 + i % 50],
                                  sampling_params=params)

    callers = [asyncio.create_task(decode(i)) for i in range(busy)]
    times: dict[str, list[float]] = {"ours (known)": []}
    try:
        while engine.statistics().in_flight < busy:  # noqa: ASYNC110 - no event says so
            await asyncio.sleep(0.01)
        for i in range(repeats):
            called = time.perf_counter()
            await pusher.update(weights, global_steps=next(steps), mode="keep")
            times["ours (known)"].append((time.perf_counter() - called) * 1e3)
            print(f"  busy update {i + 1}/{repeats}: {times['ours (known)'][-1]:.2f} ms",
                  file=sys.stderr, flush=True)
    finally:
        stop.set()
        await engine.pause("abort")  # the callers' requests end; they see ``stop`` and return
        await engine.resume()
        await asyncio.gather(*callers)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--busy", type=int, default=32, help="requests decoding (second part)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the pushed tensors live (default: cuda if there is one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = uvloop.run(measure(args.layers, args.repeats, args.busy, args.device))
    phases, rtt = result["phases ms (median)"], result["no-op collective_rpc round trip ms"]
    print(f"{result['tensors']} tensors, {result['MiB']:.1f} MiB, median of {args.repeats}")
    for name, ms in phases.items():
        print(f"  {name.removeprefix('phase: '):55s} {ms:8.2f} ms")
    # Ours: what the update costs outside its pipeline (the copies and the loads, bucket by
    # bucket); the floor: vLLM's two RPCs.
    fixed = phases["update: outside the pipeline"]
    print(f"  outside the pipeline: {fixed:.2f} ms; vLLM's RPC floor (2 no-op round trips):"
          f" {2 * rtt:.2f} ms; ratio {fixed / (2 * rtt):.1f}x")
    order = result["update ms by the transfer's order (median)"]
    ours, baseline = order["ours (receivers first)"], order["baseline (sender first)"]
    print(f"update, idle engine: receive RPCs first (ours) {ours:.2f} ms, the sender first"
          f" (baseline) {baseline:.2f} ms: ours / baseline {ours / baseline:.2f}")
    busy = result[f"update() call ms with {args.busy} requests decoding (median)"]
    print(f"update() with {args.busy} requests decoding: {busy['ours (known)']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
