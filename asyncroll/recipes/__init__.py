"""Recipes built on asyncroll: fully-async, one-step-off-policy, synchronous.

Each recipe takes a ``Trainer`` and a ``RolloutSource`` (protocols): ``AgentLoopSource`` trains
any agent loop, tool-using ones included; ``BandTaskSource`` (or a bare ``BandTask``) is the
single-turn toy task of ``make demo``.
"""

from asyncroll.recipes.fully_async import run_fully_async
from asyncroll.recipes.one_step_off import run_one_step_off
from asyncroll.recipes.protocols import RolloutSource, Trainer, train_step
from asyncroll.recipes.report import StepRecord, format_table, plot
from asyncroll.recipes.rollout import Batch, Rollouter, open_rollouter
from asyncroll.recipes.sources import AgentLoopSource, BandTaskSource, Reward
from asyncroll.recipes.synchronous import run_synchronous
from asyncroll.recipes.task import BandTask

__all__ = [
    "AgentLoopSource",
    "BandTask",
    "BandTaskSource",
    "Batch",
    "Reward",
    "RolloutSource",
    "Rollouter",
    "StepRecord",
    "Trainer",
    "format_table",
    "open_rollouter",
    "plot",
    "run_fully_async",
    "run_one_step_off",
    "run_synchronous",
    "train_step",
]
