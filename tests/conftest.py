"""The suite's lanes, its one event loop, and the report of a test that hung.

Every test says what it starts, by a mark (registered in pyproject.toml):

- ``engine``: it starts or uses a real vLLM engine, in this process or another (a subprocess,
  torchrun, a Ray actor). A test that asks for the shared ``engine`` or ``engine_b`` fixture
  (directly or through another fixture) is marked for you (``engine_fixtures.py``); one that
  starts its own engine, or runs something that does, carries the mark itself (a module's
  ``pytestmark = pytest.mark.engine``, or ``@pytest.mark.engine`` on the test).
- ``process``: it starts other processes (``multiprocessing``, ``subprocess``) but no engine.
- no mark: the test is pure. It starts no process and no engine, and runs in ``make test-fast``
  (``-m "not engine and not process and not slow"``, under a minute on two cores).

The marks are enforced, not trusted: a test without ``engine`` or ``process`` that starts a
process (``subprocess.Popen``, ``multiprocessing``'s ``Process.start``: an engine starts its
core so), or a test marked ``process`` that starts a ``VLLMEngine``, fails loudly, in its setup
or its call, whatever it caught. (An engine in a subprocess the test started is on its word.)
The tiny models (``tiny_model_a``, ``tiny_model_b``) are pure: any test may ask for them.

Collecting the suite loads no vLLM (``tests/test_lanes.py`` checks): a test module imports vLLM,
``asyncroll.testing.faults`` or ``asyncroll.vllm.worker`` inside its tests, never at its top
(``engine_helpers.inject_fault`` imports on the call). This file and ``engine_fixtures.py``
import the adapter only inside hooks and fixtures that engine tests reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import multiprocessing.process
import os
import platform
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

pytest_plugins = ("engine_fixtures",)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# One OpenMP thread a process (this one, and every engine's worker and subprocess, which inherit
# it): unbound, each vLLM CPU worker's pool would take every core and spin while it waits, and
# two of them (a TP=2 engine, two engines at once, an engine beside a trainer) slow each step
# by up to 25x on a two-core machine (a TP=2 engine's 96 greedy tokens: 11.8 s, 0.5 s so).
os.environ.setdefault("OMP_NUM_THREADS", "1")

_SESSION_LOOP: list[asyncio.AbstractEventLoop] = []
"""The loop every async test and fixture runs on (``asyncio_default_test_loop_scope``)."""

LANE_MARKS = ("engine", "process")
"""What a test may start, by mark; a test with neither is pure."""


_COLLECTED_WITH: list[frozenset[str]] = []
"""The modules loaded once the suite was collected (before any test ran)."""


@pytest.fixture
def world_of_one(tmp_path: Any) -> Iterator[None]:
    """``torch.distributed`` as a world of one rank (gloo, a file store), for the pure tests
    of the sharded pusher; torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
async def _session_loop() -> AsyncIterator[None]:
    _SESSION_LOOP.append(asyncio.get_running_loop())
    yield


def pytest_collection_finish(session: pytest.Session) -> None:
    _COLLECTED_WITH.append(frozenset(sys.modules))


@pytest.fixture(scope="session")
def modules_loaded_by_collection() -> frozenset[str]:
    """The names in ``sys.modules`` when collection ended, before any test ran."""
    return _COLLECTED_WITH[-1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _refusing_unmarked_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _refusing_unmarked_starts(item):
        return (yield)


@contextlib.contextmanager
def _refusing_unmarked_starts(item: pytest.Item) -> Iterator[None]:
    """Fail ``item`` if it starts what its marks do not declare. A refused start raises in the
    test, and the test fails afterwards even if it caught that error."""
    marks = {mark.name for mark in item.iter_markers() if mark.name in LANE_MARKS}
    if "engine" in marks:
        yield
        return
    refused: list[str] = []

    def refuse(what: str, mark: str, allowed: Callable[..., Any] | None = None) -> Any:
        def start(*args: Any, **kwargs: Any) -> Any:
            if allowed is not None and _asked_by_platform():
                return allowed(*args, **kwargs)
            refused.append(f"{what} (mark the test {mark!r}: see tests/conftest.py)")
            raise RuntimeError(f"{item.nodeid} started {what} unmarked: mark it {mark!r}")

        return start

    with pytest.MonkeyPatch.context() as patch:
        if "process" not in marks:
            run = subprocess.Popen._execute_child  # type: ignore[attr-defined]
            patch.setattr(
                subprocess.Popen, "_execute_child", refuse("a subprocess", "process", run)
            )
            patch.setattr(
                multiprocessing.process.BaseProcess, "start", refuse("a process", "process")
            )
        else:  # a pure test's engine is refused above (vLLM's engine core is a process)
            from asyncroll.vllm.engine import VLLMEngine

            patch.setattr(VLLMEngine, "start", refuse("a vLLM engine", "engine"))
        try:
            yield
        finally:
            if refused:
                pytest.fail(f"{item.nodeid} started {'; '.join(refused)}", pytrace=False)


def _asked_by_platform() -> bool:
    """Whether the standard library's ``platform`` module asks (``uname -p``, ``file -b``: the
    probes vLLM's import runs), which is no process of the test's own."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == platform.__file__:
            return True
        frame = frame.f_back
    return False


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
