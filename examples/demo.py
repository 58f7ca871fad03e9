"""`make demo`: a real fully-async training run (CPU, or the GPU), rollouts and pushes.

A tiny random Qwen2 learns a toy task (answer with tokens of a band of the vocabulary) while
rollouts stream through the AsyncServerManager and every trainer step's weights are pushed into
the vLLM engine. Prints a per-step table (reward, staleness, push time, requests resumed) and
writes demo.png (reward curve, staleness, push times, rollout/trainer KL).
``--metrics-port 9400`` also serves Prometheus metrics at http://127.0.0.1:9400/metrics.
"""

from __future__ import annotations

import uvloop
from _common import arguments, run_recipe

from asyncroll.recipes import run_fully_async

if __name__ == "__main__":
    args = arguments(default_steps=30)
    args.plot = args.plot or "demo.png"
    uvloop.run(run_recipe(run_fully_async, "fully-async", args, max_staleness=2))
