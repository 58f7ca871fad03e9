"""What counting samples (``asyncroll.vllm.worker.SampleCounter``, on in every engine so that
an update can commit between two steps) adds to each engine step, on this host's CPU: the
counter's bookkeeping for a batch of N running requests, against the step it rides on.

    python bench/sample_count_cost.py [--step-ms 13.5]

``--step-ms``: the engine's median step on the machine that matters (13.5-15 ms on one H200,
the 0.5B rollout benchmark with 256 callers; docs/performance.md)."""

from __future__ import annotations

import argparse
import time
import types

import numpy as np

from asyncroll.vllm.worker import SampleCounter


class _Runner:
    """The two things the counter reads of vLLM's model runner, for ``n`` running requests."""

    def __init__(self, n: int) -> None:
        self.input_batch = types.SimpleNamespace(
            req_id_to_index={f"request-{i}-abcdefgh": i for i in range(n)})
        self.discard_request_mask = types.SimpleNamespace(np=np.zeros(n, bool))

    def execute_model(self, scheduler_output: object, *args: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-ms", type=float, default=13.5)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print("| running requests | counting a step (us) | share of a "
          f"{args.step_ms:g} ms step |\n|---|---|---|")
    for n in (64, 256, 1024):
        runner = _Runner(n)
        SampleCounter(runner)
        step = types.SimpleNamespace(
            finished_req_ids=set(), total_num_scheduled_tokens=n,
            num_scheduled_tokens={f"request-{i}-abcdefgh": 1 for i in range(n)})
        began = time.perf_counter()
        for _ in range(args.steps):
            runner.execute_model(step)  # the counter's wrapper around a step that does nothing
        seconds = (time.perf_counter() - began) / args.steps
        print(f"| {n} | {seconds * 1e6:.1f} | {seconds * 1e3 / args.step_ms:.2%} |")


if __name__ == "__main__":
    main()
