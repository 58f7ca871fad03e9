"""Choosing an engine for a request: pure functions, no I/O, no event loop.

Policy: least-loaded (in-flight requests) among live engines, with stickiness: a call whose
session already ran on an engine goes back there while that engine is at most ``margin`` busier
than the least-loaded one, so its prefix cache hits. Ties rotate so new sessions spread out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from asyncroll.errors import NoEngineAvailableError

__all__ = ["EngineLoad", "StickyTable", "choose_engine"]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What routing needs to know of one engine."""

    in_flight: int
    alive: bool = True


def choose_engine(
    loads: Sequence[EngineLoad], *, sticky: int | None = None, margin: int = 4, rotation: int = 0
) -> int:
    """Return the index of the engine to use.

    Args:
        loads: One entry per engine.
        sticky: The engine this session used last, if any.
        margin: How many more in-flight requests than the least-loaded engine the sticky engine
            may have and still be chosen.
        rotation: Breaks ties among the least-loaded engines (pass a counter).

    Raises:
        NoEngineAvailableError: no engine is alive.
    """
    alive = [index for index, load in enumerate(loads) if load.alive]
    if not alive:
        raise NoEngineAvailableError("no live engine is left to serve the request")
    least = min(loads[index].in_flight for index in alive)
    if sticky is not None and 0 <= sticky < len(loads):
        chosen = loads[sticky]
        if chosen.alive and chosen.in_flight <= least + margin:
            return sticky
    tied = [index for index in alive if loads[index].in_flight == least]
    return tied[rotation % len(tied)]


class StickyTable:
    """Session key -> engine index, bounded (least recently used sessions are forgotten)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._table: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: str) -> int | None:
        index = self._table.get(key)
        if index is not None:
            self._table.move_to_end(key)
        return index

    def set(self, key: str, index: int) -> None:
        self._table[key] = index
        self._table.move_to_end(key)
        while len(self._table) > self._capacity:
            self._table.popitem(last=False)
