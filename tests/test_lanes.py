"""The lanes of ``tests/conftest.py`` hold: collecting the suite loads no vLLM, so a run of the
pure tests (``make test-fast``) pays for none of it."""

from __future__ import annotations

HEAVY = ("vllm", "asyncroll.vllm.worker", "asyncroll.testing.faults")
"""Modules a test module may import only inside its tests (each loads vLLM)."""


def test_collecting_the_suite_loads_no_vllm(modules_loaded_by_collection: frozenset[str]) -> None:
    loaded = sorted(name for name in HEAVY if name in modules_loaded_by_collection)
    assert not loaded, (
        f"a test module imports {loaded} at its top: import it inside the tests that need it"
        " (engine_helpers.inject_fault for the faults), see tests/conftest.py"
    )
