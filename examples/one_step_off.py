"""One-step-off-policy training: the rollout of batch k+1 overlaps training on batch k.

    .venv/bin/python examples/one_step_off.py [--steps 30] [--plot one_step_off.png]
"""

from __future__ import annotations

import uvloop
from _common import arguments, run_recipe

from asyncroll.recipes import run_one_step_off

if __name__ == "__main__":
    args = arguments()
    uvloop.run(run_recipe(run_one_step_off, "one-step-off", args))
