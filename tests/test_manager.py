"""AsyncServerManager against two real vLLM CPU engines."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    DOOMED_ARGS,
    ENGINE_ARGS,
    hold,
    load_weights,
    start_engines,
    until_decoding,
)

import asyncroll.transport.pipeline as pipeline_module
from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    ResumeMode,
    TokenOutput,
    VLLMEngine,
)
from asyncroll.testing import vllm_client
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late
from asyncroll.vllm import compat


@pytest.fixture(scope="module")
def weights_a(tiny_model_a: Path) -> dict[str, Any]:
    return load_weights(tiny_model_a)


@pytest.fixture(scope="module")
async def both_on_a(
    engine: VLLMEngine, engine_b: VLLMEngine, weights_a: dict[str, Any]
) -> list[VLLMEngine]:
    """Both shared engines serving model A, so outputs do not depend on routing."""
    async with AsyncServerManager([engine, engine_b]) as manager:
        await manager.update_weights(weights_a, global_steps=(manager.global_steps or 0) + 1)
    return [engine, engine_b]


@pytest.fixture(params=["abort", "keep", "recompute"])
async def manager(
    request: pytest.FixtureRequest, both_on_a: list[VLLMEngine]
) -> AsyncIterator[AsyncServerManager]:
    mode: ResumeMode = request.param
    async with AsyncServerManager(both_on_a, resume_mode=mode) as started:
        yield started
    for engine in both_on_a:
        assert engine.statistics().in_flight == 0


class ThreadRecorder:
    """Wraps a function and records the threads it ran on."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.threads: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        return self.function(*args, **kwargs)


def _assert_monotone(output: TokenOutput) -> None:
    known = [s for s in output.global_steps if s is not None]
    assert known == sorted(known), output.global_steps


async def _update_until_done(
    manager: AsyncServerManager,
    weights: dict[str, Any],
    tasks: list[asyncio.Task[TokenOutput]],
    *,
    budget: int,
    at_least: int = 1,
) -> int:
    """Push updates while ``tasks`` run. The first ``at_least`` land mid-decode (after
    ``until_decoding`` and ``hold``, back to back); more follow every 0.5 s while any task is
    left. ``LateAction`` if every task had run out its ``budget`` of tokens before the first
    update's pause."""
    await until_decoding(manager, tasks)
    await hold(manager)
    first = (manager.global_steps or 0) + 1
    for _ in range(at_least):
        await manager.update_weights(weights, global_steps=(manager.global_steps or 0) + 1)
    updates = at_least
    pending = {task for task in tasks if not task.done()}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        if pending:
            await manager.update_weights(weights, global_steps=(manager.global_steps or 0) + 1)
            updates += 1
    if all(ran_to_budget(task.result(), budget, update=first) for task in tasks):
        raise LateAction("every request ran out its tokens before the first update")
    return updates


@retry_if_late
async def test_requests_complete_exactly_across_repeated_updates(
    manager: AsyncServerManager, weights_a: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop must stay free while weights move: packing (the push's only heavy work in our
    # process) runs in the sender's worker thread. A check on threads, not on timings: a timed
    # bound on loop turns flakes on the garbage collector's full passes (~0.3 s of CPU with torch
    # and vLLM loaded), which are not our code; bench/rollout_throughput.py reports loop lag.
    packer = ThreadRecorder(pipeline_module.pack_bucket)
    monkeypatch.setattr(pipeline_module, "pack_bucket", packer)
    params = {"max_tokens": 200, "ignore_eos": True, "temperature": 1.0}
    updates_before = manager.statistics().num_updates  # a run again follows a late one
    tasks = [
        asyncio.create_task(
            manager.generate(f"r{i}", prompt_ids=[2 + i % 50, 3, 4], sampling_params=params)
        )
        for i in range(64)
    ]
    updates = await _update_until_done(
        manager, weights_a, tasks, budget=params["max_tokens"], at_least=2
    )
    outputs = [task.result() for task in tasks]
    assert updates >= 2
    for output in outputs:
        assert len(output.token_ids) == len(output.log_probs) == 200
        assert len(output.global_steps) == 200
        assert output.finish_reason == "length"
        _assert_monotone(output)
    spanning = [o for o in outputs if o.min_global_steps != o.max_global_steps]
    assert spanning, "some outputs must span several versions"
    if manager.resume_mode == "abort":
        assert sum(o.num_preempted for o in outputs) > 0
    stats = manager.statistics()
    assert stats.in_flight == 0 and not stats.updating
    assert stats.num_updates - updates_before == updates
    assert len(packer.threads) >= updates  # every update packed at least one bucket
    assert threading.get_ident() not in packer.threads


@retry_if_late
async def test_resume_changes_nothing_when_weights_do_not_change(
    manager: AsyncServerManager, weights_a: dict[str, Any]
) -> None:
    greedy = {"max_tokens": 150, "ignore_eos": True, "temperature": 0.0}
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]

    async def run(tag: str) -> list[asyncio.Task[TokenOutput]]:
        return [
            asyncio.create_task(
                manager.generate(f"{tag}{i}", prompt_ids=p, sampling_params=greedy)
            )
            for i, p in enumerate(prompts)
        ]

    plain = await asyncio.gather(*await run("plain"))
    tasks = await run("resumed")
    await _update_until_done(manager, weights_a, tasks, budget=greedy["max_tokens"])
    resumed = [task.result() for task in tasks]
    assert [o.token_ids for o in resumed] == [o.token_ids for o in plain]
    assert any(o.min_global_steps != o.max_global_steps for o in resumed)


@retry_if_late
async def test_sampling_params_never_mutated_and_budget_charged(
    manager: AsyncServerManager, weights_a: dict[str, Any]
) -> None:
    params = {"max_tokens": 120, "ignore_eos": True}
    snapshot = dict(params)
    tasks = [
        asyncio.create_task(
            manager.generate(f"m{i}", prompt_ids=[5, i + 1], sampling_params=params)
        )
        for i in range(8)
    ]
    await _update_until_done(manager, weights_a, tasks, budget=params["max_tokens"])
    assert params == snapshot
    assert all(len(t.result().token_ids) == 120 for t in tasks)


async def test_second_turn_sticks_to_first_engine_and_hits_prefix_cache(
    manager: AsyncServerManager,
) -> None:
    prompt = [10 + i % 400 for i in range(300)]  # the CPU build's KV blocks hold 128 tokens
    params = {"max_tokens": 16, "ignore_eos": True}
    turn1 = await manager.generate("t1", prompt_ids=prompt, sampling_params=params, session_key="c")
    follow_up = prompt + list(turn1.token_ids) + [7, 8, 9]
    turn2 = await manager.generate(
        "t2", prompt_ids=follow_up, sampling_params=params, session_key="c"
    )
    assert turn2.engines == turn1.engines
    assert turn2.num_cached_tokens > 0


async def test_new_calls_during_an_update_wait_instead_of_failing(
    manager: AsyncServerManager, weights_a: dict[str, Any]
) -> None:
    update = asyncio.create_task(
        manager.update_weights(weights_a, global_steps=(manager.global_steps or 0) + 1)
    )
    await asyncio.sleep(0)  # the update has closed the gate
    assert manager.statistics().updating
    # ignore_eos: a random model may sample EOS early; the test is about the labels of 4 tokens
    params = {"max_tokens": 4, "ignore_eos": True}
    late = await manager.generate("late", prompt_ids=[5, 6], sampling_params=params)
    await update
    assert late.global_steps == (manager.global_steps,) * 4


async def test_bad_input_never_reaches_an_engine(manager: AsyncServerManager) -> None:
    engines = manager.engines
    seen = [e.statistics().num_requests + e.statistics().num_rejected for e in engines]
    good = asyncio.create_task(
        manager.generate(
            "good", prompt_ids=[5, 6], sampling_params={"max_tokens": 32, "ignore_eos": True}
        )
    )
    for prompt, params in [
        ([], {"max_tokens": 4}),
        ([5, 99_999], {"max_tokens": 4}),
        ([5], {"max_tokens": 0}),
        ([5] * 500, {"max_tokens": 100}),
    ]:
        with pytest.raises(InvalidRequestError):
            await manager.generate("bad", prompt_ids=prompt, sampling_params=params)
    assert len((await good).token_ids) == 32
    after = [e.statistics().num_requests + e.statistics().num_rejected for e in engines]
    assert sum(after) - sum(seen) == 1  # only the good request reached an engine


@retry_if_late
async def test_cancelled_generate_leaves_nothing_behind(manager: AsyncServerManager) -> None:
    task = asyncio.create_task(
        manager.generate(
            "c", prompt_ids=[5, 6], sampling_params={"max_tokens": 400, "ignore_eos": True}
        )
    )
    await until_decoding(manager, [task])  # inside its engine, decoding (a clock there)
    task.cancel()
    try:
        output = await task
    except asyncio.CancelledError:
        pass
    else:
        assert ran_to_budget(output, 400), output
        raise LateAction("the request ran out its 400 tokens before the cancel")
    assert manager.statistics().in_flight == 0
    assert all(e.statistics().in_flight == 0 for e in manager.engines)


@retry_if_late
async def test_partial_rollout_off_marks_interrupted_requests_abort(
    both_on_a: list[VLLMEngine], weights_a: dict[str, Any]
) -> None:
    async with AsyncServerManager(both_on_a, partial_rollout=False) as manager:
        tasks = [
            asyncio.create_task(
                manager.generate(
                    f"p{i}",
                    prompt_ids=[5, i + 2],
                    sampling_params={"max_tokens": 400, "ignore_eos": True},
                )
            )
            for i in range(4)
        ]
        await until_decoding(manager, tasks)
        await hold(manager)
        steps = (manager.global_steps or 0) + 1
        await manager.update_weights(weights_a, global_steps=steps)
        outputs = await asyncio.gather(*tasks)
    if any(ran_to_budget(output, 400, update=steps) for output in outputs):
        raise LateAction("a request ran out its 400 tokens before the update's pause")
    for output in outputs:
        assert output.finish_reason == "abort"
        assert 0 < len(output.token_ids) < 400
        assert output.num_preempted == 0


async def _until_in_flight(manager: AsyncServerManager, name: str) -> None:
    """Return once the manager has dispatched a request to the engine called ``name`` (a
    state to reach, checked each few milliseconds; no duration is assumed)."""
    while True:
        if manager.statistics().in_flight_per_engine[name]:
            return
        await asyncio.sleep(0.005)


@pytest.mark.timeout(1800)  # each run starts engines (a late run, then two more)
@retry_if_late
async def test_engine_killed_mid_run_requests_finish_on_survivor(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    # The replacement starts with the doomed engine (two starts take about as long as one),
    # and joins only once the doomed one is dead.
    doomed, replacement = await start_engines(
        (tiny_model_a, "doomed-2", DOOMED_ARGS), (tiny_model_a, "replacement", ENGINE_ARGS)
    )
    try:
        (core,) = (process.pid for process in compat.engine_core_processes(vllm_client(doomed)))
        async with AsyncServerManager([engine, doomed]) as manager:
            # Budgets far longer than the clock below: the doomed engine's requests finish
            # before the kill only if this process stalls that long (then: LateAction).
            params = {"max_tokens": 400, "ignore_eos": True}
            tasks = [
                asyncio.create_task(
                    manager.generate(f"k{i}", prompt_ids=[5, i + 2], sampling_params=params)
                )
                for i in range(16)
            ]
            # Kill only once the manager shows requests on the doomed engine and they are
            # decoding there (a clock on that engine alone: event order, not timing).
            await _until_in_flight(manager, "doomed-2")
            await until_decoding(
                doomed, lambda: manager.statistics().in_flight_per_engine["doomed-2"]
            )
            os.kill(core, signal.SIGKILL)
            outputs = await asyncio.gather(*tasks)
            stats = manager.statistics()
            if any(o.engines[-1] == "doomed-2" for o in outputs):  # it ended before the kill
                raise LateAction("a request ran out its 400 tokens before the kill")
            assert all(len(o.token_ids) == 400 for o in outputs)
            assert stats.alive_engines == 1 and stats.num_engine_failovers > 0
            assert all(o.engines[-1] == "shared" for o in outputs)
            # A replacement joins: the next update reaches it, and it gets traffic.
            manager.add_engine(replacement)
            steps = (manager.global_steps or 0) + 1
            await manager.update_weights(load_weights(tiny_model_a), global_steps=steps)
            assert replacement.global_steps == engine.global_steps == steps
            short = {"max_tokens": 150, "ignore_eos": True}
            later = await asyncio.gather(
                *(
                    manager.generate(f"n{i}", prompt_ids=[5, i + 2], sampling_params=short)
                    for i in range(8)
                )
            )
            assert {o.engines[0] for o in later} == {"shared", "replacement"}
            assert all(o.global_steps == (steps,) * 150 for o in later)
    finally:
        await asyncio.gather(doomed.aclose(), replacement.aclose())


@pytest.mark.engine
def test_same_scenario_on_uvloop_with_a_real_engine(tiny_model_a: Path) -> None:
    """uvloop in a subprocess: the suite's session loop (and its engines) is asyncio's."""
    import subprocess
    import sys

    script = Path(__file__).with_name("uvloop_scenario.py")
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_model_a)],
        capture_output=True,
        text=True,
        timeout=840,  # a hang guard (an engine start took over 2 minutes under load), not a bound
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "uvloop scenario ok (abort)" in result.stdout
    assert "uvloop scenario ok (keep)" in result.stdout
