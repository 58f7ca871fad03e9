"""The tiny models and the shared engines (a pytest plugin, loaded by ``conftest.py``).

``tiny_model_a`` and ``tiny_model_b`` are pure (a seeded random Qwen2 written once per session).
``engine`` and ``engine_b`` are real vLLM CPU engines on them, started once per session on the
first test that asks and shared by every test after it: a test that asks for either, directly or
through a fixture of its own, is marked ``engine`` at collection. vLLM and the adapter are
imported inside the fixtures, so a run of pure tests never loads them.

A test that leaves a shared engine paused, holding or asleep fails in its teardown, and the
engine is put back for the tests after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asyncroll.testing import make_tiny_model

if TYPE_CHECKING:
    from asyncroll import VLLMEngine

SHARED_ENGINES = ("engine", "engine_b")
"""The session's shared engine fixtures; a test that needs one is marked ``engine``."""

_ENGINE_LOOP: list[asyncio.AbstractEventLoop] = []
"""The loop the shared engines run on (the session's)."""


@pytest.fixture(scope="session")
def tiny_model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=1)


@pytest.fixture(scope="session")
async def engine(tiny_model_a: Path) -> AsyncIterator[VLLMEngine]:
    """One real vLLM CPU engine on tiny model A, shared by every test that leaves it clean."""
    async with _shared(tiny_model_a, name="shared", model="a") as started:
        yield started


@pytest.fixture(scope="session")
async def engine_b(tiny_model_b: Path) -> AsyncIterator[VLLMEngine]:
    """A second real engine, started on tiny model B (same architecture, other seed)."""
    async with _shared(tiny_model_b, name="second", model="b") as started:
        yield started


@contextlib.asynccontextmanager
async def _shared(path: Path, *, name: str, model: str) -> AsyncIterator[VLLMEngine]:
    """An engine on ``path`` whose greedy outputs, fresh, are noted in ``FRESH_GREEDY``."""
    from engine_helpers import ENGINE_ARGS, FRESH_GREEDY, greedy

    from asyncroll import VLLMEngine
    from asyncroll.testing.faults import FAULTS_EXTENSION

    assert ENGINE_ARGS["worker_extension_cls"] == FAULTS_EXTENSION  # named there, not imported
    _ENGINE_LOOP[:] = [asyncio.get_running_loop()]
    async with VLLMEngine.launch(path, name=name, **ENGINE_ARGS) as started:
        FRESH_GREEDY[model] = await greedy(started, f"fresh-{model}")
        yield started


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``engine`` every test that asks for a shared engine (before ``-m`` selects)."""
    for item in items:
        if set(SHARED_ENGINES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


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
        if stats.holding:
            engine.release_hold()
        if stats.asleep:
            loops[-1].run_until_complete(engine.wake_up())
        if stats.paused:
            loops[-1].run_until_complete(engine.resume())
    if left:
        raise AssertionError(f"the test left {', '.join(left)} (put back for the tests after it)")
