"""The tiny models and the shared engines (a pytest plugin, loaded by ``conftest.py``).

``tiny_model_a`` and ``tiny_model_b`` are pure (a seeded random Qwen2 written once per session).
``engine`` and ``engine_b`` are real vLLM CPU engines on them, started once per session (both at
once, on the first test that asks for either, where the run's tests ask for both) and shared by
every test after it: a test that asks for either, directly or through a fixture of its own, is
marked ``engine`` at collection. vLLM is imported inside the fixtures: collecting and running
pure tests never loads it from here.

A test that leaves a shared engine paused, holding or asleep fails in its teardown, and the
engine is put back for the tests after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asyncroll.testing import make_tiny_model

if TYPE_CHECKING:
    from asyncroll import VLLMEngine

SHARED_ENGINES = ("engine", "engine_b")
"""The session's shared engine fixtures; a test that needs one (or ``_shared_engines``, which
starts them) is marked ``engine``."""

_ENGINE_LOOP: list[asyncio.AbstractEventLoop] = []
"""The loop the shared engines run on (the session's)."""

_WANTED: set[str] = set()
"""The shared engines the run's selected tests ask for (known once collection ends)."""


@pytest.fixture(scope="session")
def tiny_model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=1)


@pytest.fixture(scope="session")
async def engine(_shared_engines: SharedEngines) -> VLLMEngine:
    """One real vLLM CPU engine on tiny model A, shared by every test that leaves it clean."""
    return await _shared_engines.get("engine")


@pytest.fixture(scope="session")
async def engine_b(_shared_engines: SharedEngines) -> VLLMEngine:
    """A second real engine, started on tiny model B (same architecture, other seed)."""
    return await _shared_engines.get("engine_b")


@pytest.fixture(scope="session")
async def _shared_engines(
    tiny_model_a: Path, tiny_model_b: Path
) -> AsyncIterator[SharedEngines]:
    shared = SharedEngines(
        {"engine": ("shared", tiny_model_a, "a"), "engine_b": ("second", tiny_model_b, "b")}
    )
    try:
        yield shared
    finally:
        await shared.aclose()


class SharedEngines:
    """The session's shared engines, each started on the first test that asks for it, together
    with every other one the run's tests ask for: two starts at once take about as long as one
    on the two-core machine (28 s; an engine's start waits on its processes more than it
    computes). Closed together at the end of the session."""

    def __init__(self, specs: dict[str, tuple[str, Path, str]]) -> None:
        """``specs``: for each fixture, the engine's name, its model, and the model's key in
        ``FRESH_GREEDY``."""
        self._specs = specs
        self._started: dict[str, asyncio.Task[VLLMEngine]] = {}

    async def get(self, fixture: str) -> VLLMEngine:
        for name in (fixture, *sorted(_WANTED & set(self._specs) - {fixture})):
            if name not in self._started:
                self._started[name] = asyncio.create_task(self._start(name))
        return await self._started[fixture]

    async def _start(self, fixture: str) -> VLLMEngine:
        """An engine whose greedy outputs, fresh, are noted in ``FRESH_GREEDY``."""
        from engine_helpers import ENGINE_ARGS, FRESH_GREEDY, greedy

        from asyncroll import VLLMEngine
        from asyncroll.testing.faults import FAULTS_EXTENSION

        assert ENGINE_ARGS["worker_extension_cls"] == FAULTS_EXTENSION  # named there only
        _ENGINE_LOOP[:] = [asyncio.get_running_loop()]
        name, path, model = self._specs[fixture]
        started = await VLLMEngine.start(path, name=name, **ENGINE_ARGS)
        try:
            FRESH_GREEDY[model] = await greedy(started, f"fresh-{model}")
        except BaseException:
            await started.aclose()
            raise
        return started

    async def aclose(self) -> None:
        from engine_helpers import close_pushers

        await close_pushers()
        tasks = list(self._started.values())
        await asyncio.gather(*tasks, return_exceptions=True)  # a start under way ends first
        engines = [task.result() for task in tasks if not task.cancelled() and not task.exception()]
        await asyncio.gather(*(engine.aclose() for engine in engines))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``engine`` every test that asks for a shared engine (before ``-m`` selects)."""
    for item in items:
        if {*SHARED_ENGINES, "_shared_engines"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _WANTED.update(set(SHARED_ENGINES) & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A test that left a shared engine paused, holding or asleep (it failed midway, or forgot
    to undo its own pause) fails in its teardown, and the engine is put back: every engine test
    after it would otherwise wait at the engine's gate until its own timeout."""
    shared = [getattr(item, "funcargs", {}).get(name) for name in SHARED_ENGINES]
    shared = [engine for engine in shared if engine is not None]
    loops = [loop for loop in _ENGINE_LOOP if not loop.is_closed() and not loop.is_running()]
    if nextitem is None or not shared or not loops:  # the last test: the engines are closing
        return
    from asyncroll import VLLMEngine

    left = []
    for engine in shared:
        if not isinstance(engine, VLLMEngine) or engine.is_dead:
            continue
        stats = engine.statistics()
        states = [state for state in ("paused", "holding", "asleep") if getattr(stats, state)]
        if not states:
            continue
        left.append(f"{engine.name} {'/'.join(states)}")
        if stats.holding:  # a commit of the weights in force ends it
            loops[-1].run_until_complete(engine.weights.commit(None))
        if stats.asleep:
            loops[-1].run_until_complete(engine.wake_up())
        if stats.paused:
            loops[-1].run_until_complete(engine.resume())
    if left:
        raise AssertionError(f"the test left {', '.join(left)} (put back for the tests after it)")
