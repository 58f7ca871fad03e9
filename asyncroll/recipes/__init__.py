"""Recipes built on asyncroll: fully-async, one-step-off-policy, synchronous."""

from asyncroll.recipes.fully_async import run_fully_async
from asyncroll.recipes.one_step_off import run_one_step_off
from asyncroll.recipes.report import StepRecord, format_table, plot
from asyncroll.recipes.rollout import Batch, Rollouter, open_rollouter
from asyncroll.recipes.synchronous import run_synchronous
from asyncroll.recipes.task import BandTask

__all__ = [
    "BandTask",
    "Batch",
    "Rollouter",
    "StepRecord",
    "format_table",
    "open_rollouter",
    "plot",
    "run_fully_async",
    "run_one_step_off",
    "run_synchronous",
]
