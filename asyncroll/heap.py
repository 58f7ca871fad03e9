"""Garbage collection that stays off a rollout's event loop.

A process that runs vLLM's client, the manager and often the trainer holds a large heap: on the
CPU machine, about 660,000 objects the collector tracks once one engine has started (torch,
vLLM, the model's config). CPython's full collection walks all of them, and it runs on the
thread that happened to allocate, here the event loop's: measured by ``bench/loop_turns.py``, one
full pass took 640-765 ms, and the loop's worst turn was 380-400 ms of its CPU time (9-11 ms
inside ``frozen_heap``). The rollout's own churn (each step's outputs, each request's
lists) runs young collections every 700 allocations, 50 a second or more.

``frozen_heap()`` does what vLLM does in its own processes after start-up (``freeze_gc_heap``):
collect once, then freeze what survived, so that later collections never walk it; and it makes
young collections rarer. Enter it once the engines have started. On exit the frozen objects are
handed back to the collector, and the thresholds restored.

What freezing costs: a cycle among objects frozen here is not collected while frozen (their
reference counts still free everything else). Start-up's objects live as long as the engines do.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen_heap"]

YOUNG_THRESHOLD = 50_000
"""Allocations (less deallocations) between two young collections; CPython's default is 700.
The rollout's young objects die by reference count, so collecting them 70x less often frees
the same memory and spares the loop (``bench/loop_turns.py``)."""


@contextlib.contextmanager
def frozen_heap(*, young_threshold: int = YOUNG_THRESHOLD) -> Iterator[int]:
    """Freeze the heap as it stands and collect young objects every ``young_threshold``
    allocations, until exit; yields how many objects were frozen.

    Nests: an inner one freezes what was made since the outer one, and thaws nothing on exit
    (the outermost exit thaws all)."""
    if not isinstance(young_threshold, int) or isinstance(young_threshold, bool) or (
        young_threshold < 1
    ):
        raise ValueError(f"young_threshold must be an int of at least 1, not {young_threshold!r}")
    thresholds = gc.get_threshold()
    outermost = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *thresholds[1:])
    try:
        yield gc.get_freeze_count()
    finally:
        gc.set_threshold(*thresholds)
        if outermost:
            gc.unfreeze()
