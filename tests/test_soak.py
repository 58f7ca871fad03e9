"""The soak of bench/soak.py, shortened to fit the suite, on the two shared engines.

Each mode: 64 callers kept in flight while 15 updates alternate models A and B every 0.3 s,
10% of callers cancelled (after a random delay, or while an update runs); then every check of
the soak (exact lengths, per-token versions never decreasing and within what was pushed,
nothing left in flight, no transport leftovers, RSS and /dev/shm back near the start).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from engine_helpers import load_weights

from asyncroll import ResumeMode, VLLMEngine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

UPDATES = 15
"""Odd: update k pushes model A for even k, so the shared engines end serving model A (other
tests' greedy checks expect the models the fixtures started, and pushes of A or B only)."""

CONCURRENCY = 64


def _load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("bench_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the body runs
    spec.loader.exec_module(module)
    return module


soak_module = _load_soak()


@pytest.fixture(scope="module")
async def warm_engines(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> list[VLLMEngine]:
    """The shared engines after a short soak (checked, but for RSS): a worker's RSS grows the
    first times it decodes this many requests at once, then levels off (bench/soak.py)."""
    weights = [load_weights(tiny_model_a), load_weights(tiny_model_b)]
    warmup = await soak_module.soak(
        [engine, engine_b], weights, mode="abort", updates=3, concurrency=CONCURRENCY,
        seed=2, max_tokens=(8, 48), rss_slack_mib=math.inf, engine_rss_slack_mib=math.inf,
    )
    assert warmup.failures == []
    return [engine, engine_b]


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_soak_across_weight_updates(
    mode: ResumeMode, warm_engines: list[VLLMEngine], tiny_model_a: Path, tiny_model_b: Path
) -> None:
    weights: list[dict[str, Any]] = [load_weights(tiny_model_a), load_weights(tiny_model_b)]
    result = await soak_module.soak(
        warm_engines,
        weights,
        mode=mode,
        updates=UPDATES,
        interval=0.3,
        concurrency=CONCURRENCY,
        seed=1,
        max_tokens=(8, 200),
    )
    print(soak_module.summary(result))
    assert result.failures == []
    assert result.updates == UPDATES
    assert result.completed > 0 and result.cancelled > 0
    assert result.spanning > 0, "some outputs must span several versions"
    if mode == "abort":
        assert result.num_preempted > 0
    else:  # kept requests continue inside vLLM; the manager resubmits nothing
        assert result.num_preempted == 0 and result.num_reprefill_tokens == 0
