"""The fake engine's own behaviour, and AsyncServerManager over FakeEngines.

No vLLM here (the fake's engine contract is tests/test_contract.py). pytest-asyncio gives each
test a fresh event loop, once asyncio's and once uvloop's (the loop-factory hook in this folder's
conftest.py), under a deadline. Progress is
gated on events (``FakeEngine.wait_generated``, a "clock" request), never on sleeps; the fake's
tokens are a function of the sequence before them, so every output can be compared token for
token with an uninterrupted run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from asyncroll import (
    AsyncServerManager,
    EngineDeadError,
    InvalidRequestError,
    NoEngineAvailableError,
    ResumeMode,
    TokenOutput,
    WeightSyncError,
)
from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),  # a fresh loop a test
    pytest.mark.timeout(120),  # the scenarios take milliseconds: longer is a hang
]

DELAY = 0.0005
"""Seconds per fake token: long enough to interrupt requests mid-generation."""

PARAMS: dict[str, Any] = {"max_tokens": 40, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(params=["abort", "keep"])
def mode(request: pytest.FixtureRequest) -> ResumeMode:
    return request.param  # type: ignore[no-any-return]


def _engines(count: int = 2, **options: Any) -> list[FakeEngine]:
    return [FakeEngine(name=f"e{i}", token_delay=DELAY, **options) for i in range(count)]


def _manager(engines: list[FakeEngine], **options: Any) -> AsyncServerManager:
    updater = options.pop("weights", None) or FakeWeightUpdater(engines)
    return AsyncServerManager(engines, weights=updater, **options)


def _prompt(i: int) -> list[int]:
    return [2 + i % 500, 3, 4]


def _start(
    manager: AsyncServerManager, count: int, params: dict[str, Any] = PARAMS, tag: str = "r"
) -> list[asyncio.Task[TokenOutput]]:
    return [
        asyncio.create_task(
            manager.generate(f"{tag}{i}", prompt_ids=_prompt(i), sampling_params=params)
        )
        for i in range(count)
    ]


async def _reference(count: int, params: dict[str, Any] = PARAMS) -> list[tuple[int, ...]]:
    """The tokens of an uninterrupted run, straight from an instant engine."""
    engine = FakeEngine()
    segments = [
        await engine.generate(f"ref{i}", prompt_ids=_prompt(i), sampling_params=params)
        for i in range(count)
    ]
    return [segment.token_ids for segment in segments]


async def _clock(manager: AsyncServerManager, tag: str = "clock") -> None:
    """Return once the engines ran several token steps (a short request as a clock)."""
    await manager.generate(tag, prompt_ids=[9, 9], sampling_params={"max_tokens": 8})


async def _progress(engines: Sequence[FakeEngine], tokens: int) -> None:
    """Return once some live engine has produced ``tokens`` more tokens."""
    waits = [
        asyncio.ensure_future(engine.wait_generated(engine.num_generated + tokens))
        for engine in engines
        if not engine.is_dead
    ]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def _update_while_running(
    manager: AsyncServerManager,
    engines: Sequence[FakeEngine],
    tasks: Sequence[asyncio.Task[TokenOutput]],
    *,
    every: int = 48,
) -> int:
    """Update the weights (new version each time) whenever the engines made progress, until
    every task is done. Returns how many updates ran."""
    finished = asyncio.ensure_future(asyncio.wait(tasks))
    updates = 0
    while True:
        progress = asyncio.ensure_future(_progress(engines, every))
        done, _ = await asyncio.wait([finished, progress], return_when=asyncio.FIRST_COMPLETED)
        if finished in done:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
            return updates
        await manager.update_weights([], global_steps=(manager.global_steps or 0) + 1)
        updates += 1


def _assert_exact(output: TokenOutput, expected: tuple[int, ...]) -> None:
    assert output.token_ids == expected, output.request_id
    assert len(output.log_probs) == len(output.global_steps) == len(expected)
    assert output.finish_reason == "length"
    assert all(log_prob <= 0 for log_prob in output.log_probs)
    known = [step for step in output.global_steps if step is not None]
    assert known == sorted(known), output.global_steps


def _assert_idle(manager: AsyncServerManager, engines: Sequence[FakeEngine]) -> None:
    stats = manager.statistics()
    assert stats.in_flight == 0 and not stats.updating
    assert all(engine.statistics().in_flight == 0 for engine in engines)


async def test_each_test_runs_on_the_loop_it_names(request: pytest.FixtureRequest) -> None:
    on_uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    assert on_uvloop == ("uvloop" in request.node.callspec.id)


# -- the fake's own behaviour (its engine contract is tests/test_contract.py) ------------------


async def test_fake_engine_statistics_repr_kill_and_revive() -> None:
    engine = FakeEngine(name="shared", token_delay=0.001)
    assert repr(engine) == "<FakeEngine shared running in_flight=0 global_steps=0>"
    running = asyncio.create_task(
        engine.generate("x", prompt_ids=[5], sampling_params={"max_tokens": 400})
    )
    await engine.wait_generated(2)
    engine.kill()
    with pytest.raises(EngineDeadError):
        await running
    with pytest.raises(EngineDeadError):
        await engine.generate("y", prompt_ids=[5], sampling_params={"max_tokens": 4})
    stats = engine.statistics()
    assert stats.dead and stats.in_flight == 0 and stats.num_requests == 1
    assert "FakeEngine shared dead" in repr(engine)
    engine.revive()
    revived = await engine.generate("y", prompt_ids=[5], sampling_params=PARAMS)
    assert len(revived.token_ids) == 40
    assert len((await FakeEngine().generate("z", prompt_ids=[5])).token_ids) == 511
    await engine.aclose()
    await engine.aclose()
    assert engine.is_dead


async def test_fake_engine_resumed_prompt_continues_identically() -> None:
    engine = FakeEngine(eos_token_id=7)
    whole = await engine.generate("w", prompt_ids=[1, 2], sampling_params=PARAMS)
    head = await engine.generate("h", prompt_ids=[1, 2], sampling_params={"max_tokens": 15})
    tail = await engine.generate(
        "t", prompt_ids=[1, 2, *head.token_ids], sampling_params={**PARAMS, "max_tokens": 25}
    )
    assert head.token_ids + tail.token_ids == whole.token_ids
    assert head.log_probs + tail.log_probs == whole.log_probs
    other = await FakeEngine(seed=1).generate("o", prompt_ids=[1, 2], sampling_params=PARAMS)
    assert other.token_ids != whole.token_ids


# -- the manager over fake engines ----------------------------------------------------------


async def test_requests_complete_exactly_across_repeated_updates(
    mode: ResumeMode
) -> None:
    engines = _engines()
    expected = await _reference(64)
    async with _manager(engines, resume_mode=mode) as manager:
        tasks = _start(manager, 64)
        updates = await _update_while_running(manager, engines, tasks)
        outputs = [task.result() for task in tasks]
        _assert_idle(manager, engines)
        stats = manager.statistics()
    assert updates >= 2 and stats.num_updates == updates
    for output, tokens in zip(outputs, expected, strict=True):
        _assert_exact(output, tokens)
    assert any(o.min_global_steps != o.max_global_steps for o in outputs)
    assert {name for o in outputs for name in o.engines} == {"e0", "e1"}
    if mode == "abort":
        assert stats.num_preempted > 0
        assert sum(o.num_preempted for o in outputs) == stats.num_preempted
    else:
        assert stats.num_preempted == 0


async def test_resume_with_unchanged_weights_gives_identical_tokens(
    mode: ResumeMode
) -> None:
    engines = _engines()
    async with _manager(engines, resume_mode=mode) as manager:
        plain = await asyncio.gather(*_start(manager, 8, tag="plain"))
        tasks = _start(manager, 8, tag="resumed")
        await _update_while_running(manager, engines, tasks, every=8)
    resumed = [task.result() for task in tasks]
    assert [o.token_ids for o in resumed] == [o.token_ids for o in plain]
    assert [o.log_probs for o in resumed] == [o.log_probs for o in plain]
    assert any(o.min_global_steps != o.max_global_steps for o in resumed)


async def test_partial_rollout_off_marks_interrupted_requests_abort() -> None:
    engines = _engines(1)
    async with _manager(engines, partial_rollout=False) as manager:
        tasks = _start(manager, 4, {"max_tokens": 400, "ignore_eos": True})
        await _clock(manager)
        await manager.update_weights([], global_steps=1)
        outputs = await asyncio.gather(*tasks)
        _assert_idle(manager, engines)
    for output in outputs:
        assert output.finish_reason == "abort"
        assert 0 < len(output.token_ids) < 400
        assert output.num_preempted == 0
        assert set(output.global_steps) == {0}


async def test_engine_killed_mid_run_requests_finish_on_the_survivor() -> None:
    engines = _engines()
    expected = await _reference(16)
    async with _manager(engines) as manager:
        tasks = _start(manager, 16)
        await engines[1].wait_generated(40)
        on_e1 = manager.statistics().in_flight_per_engine["e1"]
        assert on_e1 > 0
        engines[1].kill()
        outputs = await asyncio.gather(*tasks)
        _assert_idle(manager, engines)
        stats = manager.statistics()
    for output, tokens in zip(outputs, expected, strict=True):
        _assert_exact(output, tokens)
    assert stats.alive_engines == 1 and stats.num_engine_failovers == on_e1
    # A dead engine's segment is lost with it: the survivor generated every token kept.
    assert all(o.engines == ("e0",) for o in outputs)


async def test_engine_killed_while_frozen_in_an_update() -> None:
    engines = _engines()
    expected = await _reference(16)
    hold = asyncio.Event()
    updater = FakeWeightUpdater(engines, hold=hold)
    async with _manager(engines, resume_mode="keep", weights=updater) as manager:
        tasks = _start(manager, 16)
        await engines[1].wait_generated(40)
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await _until(lambda: updater.is_holding)
        on_e1 = manager.statistics().in_flight_per_engine["e1"]
        engines[1].kill()
        hold.set()
        await update
        outputs = await asyncio.gather(*tasks)
        _assert_idle(manager, engines)
    for output, tokens in zip(outputs, expected, strict=True):
        _assert_exact(output, tokens)
    # e1's requests waited out the update at the manager's gate, then ran on e0's new
    # weights from the start; e0's own were frozen and continued on them.
    redone = [o for o in outputs if set(o.global_steps) == {1}]
    assert on_e1 > 0 and len(redone) >= on_e1
    assert all(o.engines == ("e0",) for o in outputs)
    assert engines[0].global_steps == 1 and manager.global_steps == 1


async def _until(condition: Callable[[], bool]) -> None:
    """Let ready tasks run until ``condition`` holds (bounded: they need a few turns)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_revived_engine_gets_traffic_again() -> None:
    engines = _engines()
    async with _manager(engines) as manager:
        engines[1].kill()
        alone = await asyncio.gather(*_start(manager, 8, tag="alone"))
        assert all(o.engines == ("e0",) for o in alone)
        engines[1].revive()
        both = await asyncio.gather(*_start(manager, 8, tag="both"))
        assert manager.statistics().alive_engines == 2
    assert {o.engines for o in both} == {("e0",), ("e1",)}


async def test_all_engines_dead_raises_no_engine_available() -> None:
    engines = _engines()
    async with _manager(engines) as manager:
        tasks = _start(manager, 4)
        await _progress(engines, 8)
        for engine in engines:
            engine.kill()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, NoEngineAvailableError) for r in results), results
        with pytest.raises(NoEngineAvailableError):
            await manager.generate("late", prompt_ids=[5], sampling_params=PARAMS)
        assert manager.statistics().in_flight == 0
        assert manager.statistics().alive_engines == 0


async def test_global_steps_lower_than_published_is_rejected() -> None:
    engines = _engines(global_steps=5)
    async with _manager(engines) as manager:
        assert manager.global_steps == 5
        with pytest.raises(InvalidRequestError, match="lower than the published"):
            await manager.update_weights([], global_steps=4)
        assert manager.global_steps == 5 and manager.statistics().num_updates == 0
        assert all(engine.global_steps == 5 and not engine.is_paused for engine in engines)
        await manager.update_weights([], global_steps=5)  # equal is fine
        assert manager.statistics().num_updates == 1


async def test_failed_update_keeps_the_published_version(mode: ResumeMode) -> None:
    engines = _engines()
    expected = await _reference(16)
    updater = FakeWeightUpdater(engines, failures=1)
    async with _manager(engines, resume_mode=mode, weights=updater) as manager:
        tasks = _start(manager, 16)
        await _progress(engines, 16)
        with pytest.raises(WeightSyncError):
            await manager.update_weights([], global_steps=1)
        assert manager.global_steps == 0 and manager.statistics().num_updates == 0
        assert all(engine.global_steps == 0 for engine in engines)
        outputs = await asyncio.gather(*tasks)
        _assert_idle(manager, engines)
        stats = manager.statistics()
        await manager.update_weights([], global_steps=1)  # the next one goes through
        assert manager.global_steps == 1
    for output, tokens in zip(outputs, expected, strict=True):
        _assert_exact(output, tokens)
        assert set(output.global_steps) == {0}
    assert (stats.num_preempted > 0) == (mode == "abort")


async def test_new_calls_during_an_update_wait_instead_of_failing() -> None:
    engines = _engines()
    hold = asyncio.Event()
    async with _manager(engines, weights=FakeWeightUpdater(engines, hold=hold)) as manager:
        update = asyncio.create_task(manager.update_weights([], global_steps=3))
        await asyncio.sleep(0)
        assert manager.statistics().updating
        late = asyncio.create_task(
            manager.generate("late", prompt_ids=[5, 6], sampling_params={"max_tokens": 4})
        )
        await asyncio.sleep(0)
        assert not late.done() and manager.statistics().in_flight == 0
        hold.set()
        await update
        assert (await late).global_steps == (3,) * 4


async def test_bad_input_never_reaches_an_engine() -> None:
    engines = _engines()
    async with _manager(engines) as manager:
        good = asyncio.create_task(
            manager.generate("good", prompt_ids=[5, 6], sampling_params={"max_tokens": 32})
        )
        for prompt, params in [
            ([], {"max_tokens": 4}),
            ([5, 99_999], {"max_tokens": 4}),
            ([5], {"max_tokens": 0}),
            ([5] * 500, {"max_tokens": 100}),
            ([5], {"max_tokens": 4, "logprobs": 3}),
        ]:
            with pytest.raises(InvalidRequestError):
                await manager.generate("bad", prompt_ids=prompt, sampling_params=params)
        assert len((await good).token_ids) == 32
    seen = [e.statistics().num_requests + e.statistics().num_rejected for e in engines]
    assert sum(seen) == 1  # only the good request reached an engine


async def test_session_sticks_to_its_engine_until_it_is_too_busy() -> None:
    engines = _engines()
    async with _manager(engines, sticky_margin=2) as manager:
        params = {"max_tokens": 4}
        first = await manager.generate("t1", prompt_ids=[5], sampling_params=params,
                                       session_key="chat")
        second = await manager.generate("t2", prompt_ids=[5, 6], sampling_params=params,
                                        session_key="chat")
        assert second.engines == first.engines
        (home,) = first.engines
        busy = [engine for engine in engines if engine.name == home]
        await busy[0].pause("keep")  # pile requests up on the session's engine
        piled = []
        for i in range(6):
            piled.append(asyncio.create_task(manager.generate(
                f"p{i}", prompt_ids=[7], sampling_params=params, session_key="chat")))
            await asyncio.sleep(0)
        # Sticky while at most 2 above the least loaded, then the session moves on.
        assert manager.statistics().in_flight_per_engine == {"e0": 3, "e1": 3}
        await busy[0].resume()
        await asyncio.gather(*piled)
        assert manager.statistics().sticky_sessions == 1


# -- cancellation: every point where a generate call can wait --------------------------------


async def test_cancel_mid_generation_leaves_nothing_in_flight() -> None:
    engines = _engines()
    async with _manager(engines) as manager:
        task = _start(manager, 1, {"max_tokens": 400})[0]
        await _progress(engines, 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _assert_idle(manager, engines)
        assert all(e.num_unfinished_in_vllm() == 0 for e in engines)
        again = await manager.generate("r0", prompt_ids=[5], sampling_params={"max_tokens": 4})
        assert len(again.token_ids) == 4  # the id is free again


async def test_timeout_around_generate_leaves_nothing_in_flight() -> None:
    engines = _engines()
    async with _manager(engines) as manager:

        async def freeze_engines_mid_generation(deadline: asyncio.Timeout) -> None:
            """Freeze the engines mid-generation, then let the caller's timeout expire: the
            deadline follows the freeze (a fixed 50 ms could expire first on a busy machine,
            and the freezer would then wait forever for tokens)."""
            await _progress(engines, 4)
            for engine in engines:
                await engine.pause("keep")
            deadline.reschedule(asyncio.get_running_loop().time())

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                freezer = asyncio.create_task(freeze_engines_mid_generation(deadline))
                await manager.generate("t", prompt_ids=[5], sampling_params={"max_tokens": 400})
        await freezer
        for engine in engines:
            await engine.resume()
        _assert_idle(manager, engines)
        assert sum(engine.num_generated for engine in engines) < 400


async def test_cancel_while_waiting_at_the_manager_gate() -> None:
    engines = _engines()
    hold = asyncio.Event()
    async with _manager(engines, weights=FakeWeightUpdater(engines, hold=hold)) as manager:
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await asyncio.sleep(0)
        task = _start(manager, 1)[0]
        await asyncio.sleep(0)
        assert manager.statistics().updating and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        hold.set()
        await update
        _assert_idle(manager, engines)
        assert sum(e.statistics().num_requests for e in engines) == 0


@pytest.mark.parametrize("pause_mode", ["keep", "wait"])
async def test_cancel_while_waiting_at_the_engine_gate(pause_mode: str) -> None:
    engines = _engines(1)
    async with _manager(engines) as manager:
        await engines[0].pause(pause_mode)  # type: ignore[arg-type]
        task = _start(manager, 1)[0]
        await asyncio.sleep(0)
        assert manager.statistics().in_flight == 1  # dispatched, not admitted
        assert engines[0].statistics().in_flight == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engines[0].resume()
        _assert_idle(manager, engines)
        again = await manager.generate("r0", prompt_ids=[5], sampling_params={"max_tokens": 4})
        assert len(again.token_ids) == 4


async def test_cancel_while_frozen_in_a_keep_update() -> None:
    engines = _engines()
    hold = asyncio.Event()
    updater = FakeWeightUpdater(engines, hold=hold)
    async with _manager(engines, resume_mode="keep", weights=updater) as manager:
        tasks = _start(manager, 4)
        await _progress(engines, 4)
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await _until(lambda: updater.is_holding)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert manager.statistics().in_flight == 0
        hold.set()
        await update
        _assert_idle(manager, engines)


# -- an output never moves to older weights ------------------------------------------------


async def test_an_output_never_moves_to_older_weights() -> None:
    engines = _engines()
    hold = asyncio.Event()
    updater = FakeWeightUpdater(engines, hold=hold)
    async with _manager(engines, weights=updater) as manager:
        engines[1].kill()
        hold.set()
        await manager.update_weights([], global_steps=1)  # e1 misses it
        engines[1].revive()  # back on version 0, like an engine restarted from a checkpoint
        tasks = _start(manager, 8)
        await engines[0].wait_generated(8)
        hold.clear()
        updater.failures = 1
        update = asyncio.create_task(manager.update_weights([], global_steps=2))
        await _until(lambda: updater.is_holding)
        engines[0].kill()  # e0's preempted requests (version 1 so far) go to e1
        hold.set()
        with pytest.raises(WeightSyncError):
            await update
        results = await asyncio.gather(*tasks, return_exceptions=True)
    # Failing the request (no engine can continue it without going back) would be correct.
    outputs = [r for r in results if not isinstance(r, NoEngineAvailableError)]
    for output in outputs:
        assert isinstance(output, TokenOutput), output
        known = [step for step in output.global_steps if step is not None]
        assert known == sorted(known), output.global_steps
