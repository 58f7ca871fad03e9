"""Shared fixtures: tiny models built once, real vLLM CPU engines started once per session."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from engine_helpers import ENGINE_ARGS, FRESH_GREEDY, greedy

from asyncroll import VLLMEngine
from asyncroll.testing import make_tiny_model

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

_SESSION_LOOP: list[asyncio.AbstractEventLoop] = []
"""The loop every async test and fixture runs on (``asyncio_default_test_loop_scope``)."""


@pytest.fixture(scope="session", autouse=True)
async def _session_loop() -> AsyncIterator[None]:
    _SESSION_LOOP.append(asyncio.get_running_loop())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that timed out says what every task of the loop was waiting on, first thing in
    its report (pytest-timeout shows only the loop's thread, idle in its selector)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    # pytest-asyncio closes a session loop per loop-factory group (``tests/both_loops``): the
    # suite's own is the one still open.
    loops = [loop for loop in _SESSION_LOOP if not loop.is_closed()]
    if report.when != "call" or not report.failed or not loops:
        return
    text = str(report.longrepr)
    if "Timeout" not in text:
        return
    dump = io.StringIO()
    for task in asyncio.all_tasks(loops[-1]):
        print(f"{task.get_name()}:", file=dump)
        for where in _awaiting(task.get_coro()):
            print(f"    {where}", file=dump)
    report.longrepr = f"asyncio tasks pending at the timeout:\n{dump.getvalue()}\n{text}"


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A test that left a shared engine paused, holding or asleep (it failed midway, or forgot
    to undo its own pause) fails in its teardown, and the engine is put back: every engine test
    after it would otherwise wait at the engine's gate until its own timeout."""
    loops = [loop for loop in _SESSION_LOOP if not loop.is_closed() and not loop.is_running()]
    if nextitem is None or not loops:  # the last test: the engines are closing
        return
    left = []
    for name in ("engine", "engine_b"):
        shared = getattr(item, "funcargs", {}).get(name)
        if not isinstance(shared, VLLMEngine) or shared.is_dead:
            continue
        stats = shared.statistics()
        states = [state for state in ("paused", "holding", "asleep") if getattr(stats, state)]
        if not states:
            continue
        left.append(f"{shared.name} {'/'.join(states)}")
        if stats.holding:
            shared.release_hold()
        if stats.asleep:
            loops[-1].run_until_complete(shared.wake_up())
        if stats.paused:
            loops[-1].run_until_complete(shared.resume())
    if left:
        raise AssertionError(f"the test left {', '.join(left)} (put back for the tests after it)")


def _awaiting(coro: object) -> Iterator[str]:
    """Where a coroutine waits, outermost first, down its chain of awaits."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(
            coro, "gi_frame", None
        )
        if frame is not None:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(
            coro, "gi_yieldfrom", None
        )

@pytest.fixture(scope="session")
def tiny_model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=1)


@pytest.fixture(scope="session")
async def engine(tiny_model_a: Path) -> AsyncIterator[VLLMEngine]:
    """One real vLLM CPU engine on tiny model A, shared by every test that leaves it clean."""
    async with VLLMEngine.launch(
        tiny_model_a, name="shared", **ENGINE_ARGS
    ) as started:
        FRESH_GREEDY["a"] = await greedy(started, "fresh-a")
        yield started


@pytest.fixture(scope="session")
async def engine_b(tiny_model_b: Path) -> AsyncIterator[VLLMEngine]:
    """A second real engine, started on tiny model B (same architecture, other seed)."""
    async with VLLMEngine.launch(
        tiny_model_b, name="second", **ENGINE_ARGS
    ) as started:
        FRESH_GREEDY["b"] = await greedy(started, "fresh-b")
        yield started

