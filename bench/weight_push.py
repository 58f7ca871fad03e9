"""Weight-push benchmark: double-buffered vs single-buffered vs a naive baseline vs the limit.

All numbers come from ONE run on one machine; only ratios between them mean anything.

* double / single: ``open_weight_sender(buffers=2)`` vs the same code with ``buffers=1``.
* sync acks (CUDA): double buffering with the receiver synchronising its stream before each ack,
  as before device load events (the sender's copies now wait on the receiver's event instead).
* naive: CPU, every tensor's bytes sent through a ZeroMQ ipc socket and copied into place;
  CUDA, one IPC handle per tensor (what the staged, bucketed design replaces).
* limit: a staged push costs two copies (pack, load), so its payload rate is at most half the
  measured copy rate of one big buffer on the device (memcpy on CPU, device-to-device on CUDA).
* floor (CUDA): the same buckets between two processes with no host in the loop, every
  hand-off on the device (``_handoff_floor``): what two processes taking turns on one GPU cost
  by themselves, which no pipeline of two processes beats; and the same copies in one stream of
  one process ("one process"), which takes no turns.

A receiver runs in a spawned child process and copies every bucket into preallocated
destination tensors (a model's parameters). Usage::

    python bench/weight_push.py                      # CPU, shm backend, 1 GiB of bf16
    python bench/weight_push.py --device cuda        # CUDA IPC, 8 GiB, 128/512/2048 MiB
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import uvloop
import zmq

from asyncroll.transport import CudaIpcBackend, ShmBackend, WeightReceiver, open_weight_sender
from asyncroll.transport.backends import Backend, make_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _handoff_floor
from _timeline import render as render_timeline
from _timeline import summarize as summarize_timeline

MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_model(gib: float, device: str) -> dict[str, torch.Tensor]:
    """Transformer-shaped bf16 weights (Llama-like names and shapes) totalling about ``gib``."""
    hidden, inter = (4096, 11008) if gib >= 4 else (2048, 5632)
    vocab, target = 32000, int(gib * (1 << 30))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    layer = 0
    while sum(a * b * 2 for a, b in shapes.values()) < target:
        p = f"model.layers.{layer}"
        for name, shape in {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (hidden // 4, hidden),
            "self_attn.v_proj.weight": (hidden // 4, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (1, hidden),
            "post_attention_layernorm.weight": (1, hidden),
        }.items():
            shapes[f"{p}.{name}"] = shape
        layer += 1
    return {
        name: torch.empty(shape, dtype=torch.bfloat16, device=device).normal_()
        for name, shape in shapes.items()
    }


def copy_rate(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of one large copy on the device (best of ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- receiver child


class _Loader:
    def __init__(self, device: str) -> None:
        self.device = device
        self.dest: dict[str, torch.Tensor] = {}

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in batch:
            target = self.dest.get(name)
            if target is None:
                target = self.dest[name] = torch.empty_like(tensor, device=self.device)
            target.copy_(tensor)


def child_main(conn: Connection, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    loader = _Loader(device)
    while True:
        command, args = conn.recv()
        if command == "exit":
            return
        if command == "receive":
            config, pushes, events = args

            def backend(name: str, events: bool = events) -> Backend:
                made = make_backend(name)
                if isinstance(made, CudaIpcBackend):
                    made.use_load_events = events
                return made

            with WeightReceiver.from_config(
                config, name="bench", backend_factory=backend
            ) as receiver:
                receiver.connect()
                conn.send("connected")
                for _ in range(pushes):
                    report = receiver.receive(loader)
            conn.send([dataclasses.asdict(t) for t in report.timeline])
        elif command == "naive":
            address, pushes = args
            _naive_receive(address, pushes, loader, device)
            conn.send("done")


def _naive_receive(address: str, pushes: int, loader: _Loader, device: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    for _ in range(pushes):
        while True:
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == b"end":
                break
            name, meta = frames[0].bytes.decode(), json.loads(frames[1].bytes)
            if device.startswith("cuda"):
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                tensor = rebuild_cuda_tensor(*pickle.loads(frames[2].bytes))
                loader([(name, tensor)])
                torch.cuda.current_stream().synchronize()
                del tensor
            else:
                raw = torch.frombuffer(frames[2].buffer, dtype=torch.uint8)
                loader([(name, raw.view(getattr(torch, meta["dtype"])).view(meta["shape"]))])
        sock.send(b"ack")
    sock.close(linger=1000)
    ctx.term()


# ---------------------------------------------------------------- sender side


async def bench_staged(
    child: Connection,
    tensors: dict[str, torch.Tensor],
    *,
    device: str,
    bucket: int,
    buffers: int,
    pushes: int,
    events: bool = True,
) -> dict[str, Any]:
    backend = CudaIpcBackend(0) if device.startswith("cuda") else ShmBackend()
    async with open_weight_sender(
        backend=backend, bucket_bytes=bucket, buffers=buffers, receivers=1, ack_timeout=300
    ) as sender:
        child.send(("receive", (sender.receiver_config(), pushes + 1, events)))
        await sender.wait_receivers(1)
        await asyncio.to_thread(child.recv)
        await sender.push(tensors, version=0)  # warm-up: page faults, receiver allocations
        used_first = gpu_used(device)
        reports = [await sender.push(tensors, version=v + 1) for v in range(pushes)]
        used_last = gpu_used(device)
        theirs = await asyncio.to_thread(child.recv)
    seconds = statistics.median(r.seconds for r in reports)
    timeline = summarize_timeline(reports[-1].timeline, theirs, buffers=buffers)
    return {
        "seconds": seconds,
        "gbps": reports[0].bytes / seconds / 1e9,
        "pack": statistics.median(r.pack_seconds for r in reports),
        "wait": statistics.median(r.wait_seconds for r in reports),
        "buckets": reports[0].buckets,
        "timeline": timeline,
        "gpu_used_first": used_first,
        "gpu_used_last": used_last,
    }


def gpu_used(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def bench_naive(
    child: Connection, tensors: dict[str, torch.Tensor], *, device: str, pushes: int
) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/naive.sock"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.bind(address)
        child.send(("naive", (address, pushes + 1)))
        times = []
        for _ in range(pushes + 1):
            t0 = time.perf_counter()
            for name, t in tensors.items():
                meta = json.dumps(
                    {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                )
                payload = _naive_payload(t, device)
                sock.send_multipart([name.encode(), meta.encode(), payload], copy=False)
            sock.send(b"end")
            sock.recv()
            times.append(time.perf_counter() - t0)
        child.recv()
        sock.close(linger=0)
        ctx.term()
    return statistics.median(times[1:])


def _naive_payload(t: torch.Tensor, device: str) -> Any:
    if device.startswith("cuda"):
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(t)[1])
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (shm backend) or cuda (cuda_ipc)")
    parser.add_argument("--gib", type=float, default=None, help="model size (1 on cpu, 8 on cuda)")
    parser.add_argument("--buckets", default=None, help="bucket sizes in MiB, comma separated")
    parser.add_argument("--pushes", type=int, default=None, help="timed pushes per config")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--plot", default=None, help="also draw the rates, as shares of the limit, here (.png)"
    )
    parser.add_argument(
        "--replot",
        default=None,
        metavar="JSON",
        help="only draw --plot from the results a run wrote with --json",
    )
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the sender's event loop (asyncroll's examples run uvloop)",
    )
    parser.add_argument(
        "--torch-copies",
        action="store_true",
        help="baseline: the sender packs with torch's copy_, not the driver's"
        " memcpy from address ranges",
    )
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot or args.replot.removesuffix(".json") + ".png")
        return
    if args.torch_copies:
        CudaIpcBackend.queue_spans = lambda self, spans: False  # type: ignore[method-assign]
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    cuda = args.device.startswith("cuda")
    gib = args.gib or (8.0 if cuda else 1.0)
    buckets = [
        int(b) for b in (args.buckets or ("128,512,2048" if cuda else "16,64,256")).split(",")
    ]
    pushes = args.pushes or (20 if cuda else 5)

    log(
        f"# {platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else "")
    )
    tensors = make_model(gib, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log(f"model: {len(tensors)} bf16 tensors, {nbytes / (1 << 30):.2f} GiB; measuring copy rate")
    rate = copy_rate(args.device)
    limit = rate / 2
    log(f"copy rate {rate / 1e9:.2f} GB/s -> two-copy limit {limit / 1e9:.2f} GB/s payload")

    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(child_end, args.device), daemon=True)
    proc.start()
    rows = []
    try:
        for mib in buckets:
            row: dict[str, Any] = {"bucket_mib": mib}
            configs = [(2, "double", True), (1, "single", True), (3, "triple", True)]
            if cuda:
                configs.append((2, "double_sync", False))
            for buffers, label, events in configs:
                log(f"bucket {mib} MiB, {label} buffer: {pushes} pushes ...")
                row[label] = run(
                    bench_staged(
                        parent,
                        tensors,
                        device=args.device,
                        bucket=mib * MiB,
                        buffers=buffers,
                        pushes=pushes,
                        events=events,
                    )
                )
                r = row[label]
                log(
                    f"  {r['gbps']:.2f} GB/s ({r['seconds'] * 1e3:.1f} ms,"
                    f" pack {r['pack'] * 1e3:.1f} ms, wait {r['wait'] * 1e3:.1f} ms)"
                )
            if cuda:
                contiguous = {n: t.contiguous() for n, t in tensors.items()}
                row["one_process_ms"] = _handoff_floor.serial(contiguous, bucket=mib * MiB)
                log(f"  one process, one stream: {row['one_process_ms']:.2f} ms")
                for buffers in (2, 3):
                    floor = _handoff_floor.measure(contiguous, bucket=mib * MiB, buffers=buffers)
                    row[f"floor_{buffers}"] = floor
                    log(
                        f"  floor, {buffers} buffers, hand-offs on the device:"
                        f" {floor['median_ms']:.2f} ms ({floor['buckets']} buckets)"
                    )
            rows.append(row)
        log(f"naive baseline: {pushes} pushes ...")
        naive_s = bench_naive(parent, tensors, device=args.device, pushes=pushes)
        log(f"  {nbytes / naive_s / 1e9:.2f} GB/s ({naive_s * 1e3:.1f} ms)")
    finally:
        parent.send(("exit", ()))
        proc.join(30)

    rate = max(rate, copy_rate(args.device))  # the limit is the best copy rate seen (noisy hosts)
    limit = rate / 2
    naive_gbps = nbytes / naive_s / 1e9
    print(
        f"\nmodel {nbytes / (1 << 30):.2f} GiB bf16 ({len(tensors)} tensors), device {args.device},"
        f" copy rate {rate / 1e9:.2f} GB/s, two-copy limit {limit / 1e9:.2f} GB/s,"
        f" naive {naive_gbps:.2f} GB/s ({naive_s * 1e3:.1f} ms)\n"
    )
    print(
        "| bucket | double GB/s | single GB/s | double/single | double/limit | double/naive |"
        " double ms (pack/wait) | triple GB/s (limit) |"
        + (
            " double, sync acks GB/s (limit) | floor x2 GB/s (limit) | double/floor x2 |"
            " floor x3 GB/s (limit) | triple/floor x3 | one process GB/s (limit) |"
            if cuda
            else ""
        )
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|" * 6 if cuda else ""))
    for row in rows:
        d, s, t = row["double"], row["single"], row["triple"]
        line = (
            f"| {row['bucket_mib']} MiB ({d['buckets']} buckets) | {d['gbps']:.2f} |"
            f" {s['gbps']:.2f} |"
            f" {d['gbps'] / s['gbps']:.2f}x | {d['gbps'] * 1e9 / limit:.0%} |"
            f" {d['gbps'] / naive_gbps:.1f}x | {d['seconds'] * 1e3:.1f} ({d['pack'] * 1e3:.1f}/"
            f"{d['wait'] * 1e3:.1f}) | {t['gbps']:.2f} ({t['gbps'] * 1e9 / limit:.0%}) |"
        )
        if cuda:
            y = row["double_sync"]
            line += f" {y['gbps']:.2f} ({y['gbps'] * 1e9 / limit:.0%}) |"
            f2, f3 = (nbytes / row[f"floor_{b}"]["median_ms"] / 1e6 for b in (2, 3))
            one = nbytes / row["one_process_ms"] / 1e6
            line += (
                f" {f2:.2f} ({f2 * 1e9 / limit:.0%}) | {d['gbps'] / f2:.0%} |"
                f" {f3:.2f} ({f3 * 1e9 / limit:.0%}) | {t['gbps'] / f3:.0%} |"
                f" {one:.2f} ({one * 1e9 / limit:.0%}) |"
            )
        print(line)
    for row in rows:
        print(f"\nbucket {row['bucket_mib']} MiB, double buffer, the last push by link:")
        print(render_timeline(row["double"]["timeline"]))
    if cuda:
        for row in rows:
            d = row["double"]
            growth = (d["gpu_used_last"] - d["gpu_used_first"]) / max(d["gpu_used_first"], 1)
            print(
                f"GPU memory, bucket {row['bucket_mib']} MiB: after first push "
                f"{d['gpu_used_first'] / (1 << 30):.2f} GiB, after {pushes} more "
                f"{d['gpu_used_last'] / (1 << 30):.2f} GiB ({growth:+.2%})"
            )
    result = {"rate": rate, "naive_s": naive_s, "bytes": nbytes, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


def plot(result: dict[str, Any], path: str) -> None:
    """Bars per bucket size: each configuration's rate as a share of the two-copy limit, ours
    beside the two-process floor (CUDA runs) and the same copies in one process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit, nbytes = result["rate"] / 2, result["bytes"]
    bars: list[tuple[str, str, Any]] = [
        ("single", "#c7c7c7", lambda r: r["single"]["gbps"] * 1e9),
        ("double (ours)", "#1f77b4", lambda r: r["double"]["gbps"] * 1e9),
        ("floor x2", "#aec7e8", lambda r: nbytes / r["floor_2"]["median_ms"] * 1e3),
        ("triple (ours)", "#ff7f0e", lambda r: r["triple"]["gbps"] * 1e9),
        ("floor x3", "#ffbb78", lambda r: nbytes / r["floor_3"]["median_ms"] * 1e3),
        ("one process", "#2ca02c", lambda r: nbytes / r["one_process_ms"] * 1e3),
    ]
    rows = result["rows"]
    figure, axes = plt.subplots(figsize=(2.2 + 2.4 * len(rows), 4.2))
    width = 0.8 / len(bars)
    for i, (label, color, rate) in enumerate(bars):
        xs, ys = [], []
        for j, row in enumerate(rows):
            try:
                ys.append(100 * rate(row) / limit)
            except KeyError:  # no floor on CPU
                continue
            xs.append(j + (i - (len(bars) - 1) / 2) * width)
        axes.bar(xs, ys, width, label=label, color=color)
    axes.axhline(100, color="black", linewidth=0.8)
    axes.set_xticks(range(len(rows)), [f"{r['bucket_mib']} MiB buckets" for r in rows])
    axes.set_ylabel("% of the two-copy limit")
    axes.set_title(f"{nbytes / (1 << 30):.2f} GiB pushed; limit {limit / 1e9:.0f} GB/s")
    axes.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
