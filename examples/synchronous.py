"""Synchronous training on CPU (the baseline): rollout, train, push. ``--hybrid`` sleeps the
engine while the trainer runs (on GPU that frees its memory for training).

    .venv/bin/python examples/synchronous.py [--steps 30] [--plot synchronous.png]
"""

from __future__ import annotations

import sys

import uvloop
from _common import arguments, run_recipe

from asyncroll.recipes import run_synchronous

if __name__ == "__main__":
    hybrid = "--hybrid" in sys.argv
    if hybrid:
        sys.argv.remove("--hybrid")
    args = arguments()
    uvloop.run(
        run_recipe(run_synchronous, "synchronous", steps=args.steps, plot_path=args.plot,
                   metrics_port=args.metrics_port, use_ray=args.ray,
                   hybrid=hybrid)
    )
