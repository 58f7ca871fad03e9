"""Fully-async training (CPU, or GPUs): rollouts never stop; staleness is bounded.

    .venv/bin/python examples/fully_async.py [--steps 30] [--plot fully_async.png]
"""

from __future__ import annotations

import uvloop
from _common import arguments, run_recipe

from asyncroll.recipes import run_fully_async

if __name__ == "__main__":
    args = arguments()
    uvloop.run(run_recipe(run_fully_async, "fully-async", args, max_staleness=2))
