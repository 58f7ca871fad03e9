"""What a second thread that ran torch's parallel CPU ops costs a torch loop on the main thread
while it stays alive, idle (as a worker's landing thread does beside the CPU engine's steps).

Pairs, each on a fresh second thread: the loop's rate alone, then with the thread open. Three
kinds of second thread: it ran parallel ops as it came (``plain``: the landing thread before
session 39), it ran them after ``asyncroll.transport.openmp.one_openmp_thread`` (``ours``), it
ran none (``limit``: what a thread costs that has no OpenMP team). Prints each kind's median
ratio (open / alone) and ours against the limit.

    .venv/bin/python bench/openmp_second_thread_cpu.py [--pairs 12]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from asyncroll.transport.openmp import one_openmp_thread


def loop_rate(a: torch.Tensor, b: torch.Tensor, n: int = 200) -> float:
    """Iterations a second of a small matmul and two reductions (a model step's kind of op)."""
    began = time.perf_counter()
    for _ in range(n):
        torch.relu(a @ b).sum()
    return n / (time.perf_counter() - began)


def ratio(kind: str, a: torch.Tensor, b: torch.Tensor) -> float:
    alone = loop_rate(a, b)
    stop, ready = threading.Event(), threading.Event()

    def second() -> None:
        if kind == "ours":
            one_openmp_thread()
        if kind != "limit":
            xs = [torch.randn(256, 256) for _ in range(50)]
            torch._foreach_copy_([torch.empty_like(x) for x in xs], xs)
            (xs[0] @ xs[1]).sum()
        ready.set()
        while not stop.wait(0.05):  # idle, as a landing thread between pushes
            pass

    thread = threading.Thread(target=second)
    thread.start()
    ready.wait()
    time.sleep(0.3)
    opened = loop_rate(a, b)
    stop.set()
    thread.join()
    return opened / alone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    loop_rate(a, b)  # warm
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" {args.pairs} pairs a kind, interleaved", flush=True)
    ratios: dict[str, list[float]] = {"plain": [], "ours": [], "limit": []}
    for _ in range(args.pairs):
        for kind, found in ratios.items():
            found.append(ratio(kind, a, b))
    medians = {kind: statistics.median(found) for kind, found in ratios.items()}
    for kind, found in ratios.items():
        print(f"{kind:6s} open / alone: median {medians[kind]:.3f}"
              f" ({', '.join(f'{r:.2f}' for r in found)})")
    print(f"ours / limit: {medians['ours'] / medians['limit']:.3f};"
          f" plain / limit: {medians['plain'] / medians['limit']:.3f}")


if __name__ == "__main__":
    main()
