"""Worker extension of the vLLM-``ipc`` baseline engines in ``bench/gpu_e2e.py``.

vLLM 0.24's built-in ``ipc`` weight-transfer module imports ``ray`` at import time, for a
send mode the benchmark does not use, and the GPU machine has no ray. An empty module stands in
for it, in the baseline engine's worker (this module is imported there before the model loads)
and in the benchmark process (``install_ray_stub``). Nothing else changes: the baseline runs
vLLM's own code.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

from asyncroll.testing.probes import ProbingExtension


def install_ray_stub() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        stub = types.ModuleType("ray")
        stub.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        stub.is_initialized = lambda: False  # type: ignore[attr-defined]
        sys.modules["ray"] = stub


install_ray_stub()


class BaselineWorkerExtension(ProbingExtension):
    """asyncroll's worker extension and its probes (digests for the checks), with the stub
    installed."""
