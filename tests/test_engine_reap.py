"""Closing an engine's EngineCore process objects waits for vLLM's monitor thread: closed
under it, the thread's read of ``exitcode`` raises (CI saw it in a test that killed a worker)."""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace
from typing import Any

from asyncroll.vllm import compat
from asyncroll.vllm.engine import _reap


class _Process:
    """A process object as ``multiprocessing`` has it: ``exitcode`` raises once closed."""

    def __init__(self) -> None:
        self.joined = threading.Event()
        self.closed = False

    def join(self, timeout: float | None = None) -> None:
        self.joined.set()

    @property
    def exitcode(self) -> int:
        if self.closed:
            raise ValueError("process object is closed")
        return -9

    def close(self) -> None:
        self.closed = True


class _Client:
    """vLLM's ``MPClient`` as far as the finder reads it (weakly referable, as vLLM's is)."""

    def __init__(self, manager: Any) -> None:
        self.resources = SimpleNamespace(engine_manager=manager)


def _client_with_monitor(
    process: _Process, read: threading.Event, *, by_client: bool = False
) -> tuple[Any, threading.Thread]:
    """A client as vLLM's ``AsyncLLM`` has it, with a monitor thread named and built as
    vLLM 0.32's (its target closes over the engine manager) or, ``by_client``, as older
    vLLMs' (over a weak reference to the client and the processes), that reads ``exitcode``
    once ``read`` is set."""
    manager = SimpleNamespace(processes=[process])
    client = _Client(manager)
    errors: list[BaseException] = []

    if by_client:
        client_ref, processes = weakref.ref(client), [process]

        def monitor_engine_cores() -> None:
            read.wait()
            assert client_ref() is not None
            try:
                _ = processes[0].exitcode
            except ValueError as exc:
                errors.append(exc)
    else:

        def monitor_engine_cores() -> None:
            read.wait()
            try:
                _ = manager.processes[0].exitcode
            except ValueError as exc:
                errors.append(exc)

    thread = threading.Thread(  # a daemon, as vLLM's: a failing test never hangs on it
        target=monitor_engine_cores, name="MPClientEngineMonitor", daemon=True
    )
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return SimpleNamespace(engine_core=client), thread


def test_the_monitor_thread_is_found_by_what_it_watches() -> None:
    read = threading.Event()
    llm, monitor = _client_with_monitor(_Process(), read)
    other, stranger = _client_with_monitor(_Process(), read)
    older, by_client = _client_with_monitor(_Process(), read, by_client=True)
    try:
        assert compat.engine_monitor_threads(llm) == [monitor]
        assert compat.engine_monitor_threads(other) == [stranger]
        assert compat.engine_monitor_threads(older) == [by_client]
        assert compat.engine_monitor_threads(SimpleNamespace()) == []
    finally:
        read.set()
        for thread in (monitor, stranger, by_client):
            thread.join()


def test_processes_close_only_after_the_monitor_read_their_exit() -> None:
    process = _Process()
    read = threading.Event()
    llm, monitor = _client_with_monitor(process, read)
    monitors = compat.engine_monitor_threads(llm)
    # No bound on the joins: the order is what is tested, not how long the monitor takes.
    closing = threading.Thread(target=_reap, args=([process], monitors), kwargs={"timeout": None})
    closing.start()
    try:
        process.joined.wait()
        assert not process.closed  # the monitor has not read yet: the process stays open
    finally:
        read.set()
    closing.join()
    monitor.join()
    assert process.closed
    assert monitor.errors == []  # type: ignore[attr-defined]


def test_a_monitor_that_outlives_the_wait_leaves_the_processes_open() -> None:
    process = _Process()
    read = threading.Event()
    llm, monitor = _client_with_monitor(process, read)
    try:
        _reap([process], compat.engine_monitor_threads(llm), timeout=0.0)
        assert not process.closed
    finally:
        read.set()
        monitor.join()
