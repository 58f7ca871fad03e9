"""Synchronous training (the baseline): rollout, train, push. ``--hybrid`` sleeps the
engine while the trainer runs (on GPU that frees its memory for training).

    .venv/bin/python examples/synchronous.py [--steps 30] [--plot synchronous.png]
"""

from __future__ import annotations

import uvloop
from _common import parser, run_recipe

from asyncroll.recipes import run_synchronous

if __name__ == "__main__":
    options = parser()
    options.add_argument("--hybrid", action="store_true",
                         help="the engine sleeps while the trainer trains (frees its GPU memory)")
    args = options.parse_args()
    uvloop.run(run_recipe(run_synchronous, "synchronous", args, hybrid=args.hybrid))
