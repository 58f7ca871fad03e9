"""The engine contract (asyncroll.testing.contract) against a real vLLM CPU engine and the fake.

Any engine that asyncroll routes over or updates must pass the same checks; a new engine (Ray,
HTTP) adds one more parametrisation here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_helpers import FRESH_GREEDY, greedy, load_weights

from asyncroll import VLLMEngine, WeightPusher
from asyncroll.testing import FakeEngine, FakeWeightUpdater
from asyncroll.testing.contract import ENGINE_CHECKS, UPDATE_CHECKS


def _fake() -> FakeEngine:
    return FakeEngine(name="contract", token_delay=0.001)  # the tiny model's vocab and context


@pytest.fixture(scope="module")
async def pusher(engine: VLLMEngine) -> AsyncIterator[WeightPusher]:
    updater = WeightPusher([engine])
    yield updater
    await updater.aclose()


@pytest.mark.parametrize("check", ENGINE_CHECKS)
async def test_fake_engine_keeps_the_engine_contract(check: str) -> None:
    await ENGINE_CHECKS[check](_fake())


@pytest.mark.parametrize("check", UPDATE_CHECKS)
async def test_fake_engine_keeps_the_update_contract(check: str) -> None:
    engine = _fake()
    await UPDATE_CHECKS[check](engine, FakeWeightUpdater([engine]), {})


@pytest.mark.engine
@pytest.mark.parametrize("check", ENGINE_CHECKS)
async def test_vllm_engine_keeps_the_engine_contract(engine: VLLMEngine, check: str) -> None:
    await ENGINE_CHECKS[check](engine)


@pytest.mark.engine
@pytest.mark.parametrize("check", UPDATE_CHECKS)
async def test_vllm_engine_keeps_the_update_contract(
    engine: VLLMEngine, pusher: WeightPusher, tiny_model_a: Path, check: str
) -> None:
    await UPDATE_CHECKS[check](engine, pusher, load_weights(tiny_model_a))
    assert await greedy(engine, f"after-{check}") == FRESH_GREEDY["a"]  # the same weights
