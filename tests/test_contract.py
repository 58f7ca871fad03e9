"""The engine contract (asyncroll.testing.contract) against a real vLLM CPU engine and the fake.

Any engine that asyncroll routes over or updates must pass the same checks; a new engine (Ray,
HTTP) adds one more parametrisation here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import FRESH_GREEDY, greedy, load_weights

from asyncroll import VLLMEngine, WeightPusher
from asyncroll.testing import FakeEngine, FakeWeightUpdater, contract
from asyncroll.testing.contract import ENGINE_CHECKS, UPDATE_CHECKS, LateAction, retry_if_late


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


async def test_a_late_action_runs_the_scenario_again_and_fails_only_if_it_stays_late() -> None:
    runs: list[int] = []

    @retry_if_late
    async def late_twice(answer: int) -> int:
        runs.append(answer)
        if len(runs) < contract.ATTEMPTS:
            raise LateAction("stalled")
        return answer

    assert await late_twice(7) == 7 and runs == [7] * contract.ATTEMPTS

    @retry_if_late
    async def always_late() -> None:
        runs.append(0)
        raise LateAction("stalled")

    runs.clear()
    with pytest.raises(AssertionError, match=f"came late in all {contract.ATTEMPTS} runs"):
        await always_late()
    assert len(runs) == contract.ATTEMPTS

    @retry_if_late
    async def broken() -> None:
        runs.append(1)
        raise AssertionError("a real failure")

    runs.clear()
    with pytest.raises(AssertionError, match="a real failure"):
        await broken()
    assert runs == [1]  # a failure is never run again


def _stalled_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The contract's ``until_decoding``, except that its first call returns only once the
    requests ran out their tokens: a checker stalled between the first tokens and its action."""
    real = contract.until_decoding
    stalls: list[int] = []

    async def stalled(engine: Any, tasks: Any) -> None:
        if not stalls:
            stalls.append(len(tasks))
            await asyncio.wait(tasks)
        await real(engine, tasks)

    monkeypatch.setattr(contract, "until_decoding", stalled)
    return stalls


@pytest.mark.engine
@pytest.mark.parametrize("check", [
    "abort_returns_partial_output",
    "pause_keep_freezes_and_resumes_to_completion",
    "cancelling_the_caller_aborts_the_request",
])
async def test_a_stalled_checker_runs_again_on_a_real_engine(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    check: str,
) -> None:
    stalls = _stalled_once(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=contract.__name__):
        await ENGINE_CHECKS[check](engine)
    assert stalls and f"{check}: run 1 of {contract.ATTEMPTS} came late" in caplog.text


@pytest.mark.engine
async def test_a_stalled_update_check_runs_again_on_a_real_engine(
    engine: VLLMEngine, pusher: WeightPusher, tiny_model_a: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    stalls = _stalled_once(monkeypatch)
    check = "an_update_ends_requests_in_abort_mode"
    with caplog.at_level(logging.WARNING, logger=contract.__name__):
        await UPDATE_CHECKS[check](engine, pusher, load_weights(tiny_model_a))
    assert stalls and f"{check}: run 1 of {contract.ATTEMPTS} came late" in caplog.text
    assert await greedy(engine, "after-stalled-update") == FRESH_GREEDY["a"]


async def test_an_abort_that_never_lands_fails_the_check() -> None:
    engine = _fake()

    async def lost(request_ids: Any) -> None:
        """An engine that drops aborts: its requests always run out their tokens."""

    engine.abort = lost  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="came late in all"):
        await ENGINE_CHECKS["abort_returns_partial_output"](engine)
