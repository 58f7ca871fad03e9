"""Routing policy: loop-free unit tests of choose_engine and StickyTable."""

from __future__ import annotations

import pytest

from asyncroll.errors import NoEngineAvailableError
from asyncroll.routing import EngineLoad, StickyTable, choose_engine


def _loads(*in_flight: int, dead: tuple[int, ...] = ()) -> list[EngineLoad]:
    return [EngineLoad(n, alive=i not in dead) for i, n in enumerate(in_flight)]


def test_least_loaded_engine_wins() -> None:
    assert choose_engine(_loads(5, 2, 7)) == 1
    assert choose_engine(_loads(0, 3, 3)) == 0


def test_sticky_engine_kept_within_margin() -> None:
    loads = _loads(6, 2)
    assert choose_engine(loads, sticky=0, margin=4) == 0  # 6 <= 2 + 4
    assert choose_engine(loads, sticky=1, margin=4) == 1
    assert choose_engine(_loads(2, 2), sticky=1, margin=0) == 1  # a tie stays sticky


def test_sticky_engine_dropped_beyond_margin() -> None:
    assert choose_engine(_loads(7, 2), sticky=0, margin=4) == 1  # 7 > 2 + 4
    assert choose_engine(_loads(3, 2), sticky=0, margin=0) == 1


def test_dead_engines_are_never_chosen() -> None:
    loads = _loads(0, 9, 4, dead=(0,))
    assert choose_engine(loads) == 2
    for rotation in range(6):
        assert choose_engine(_loads(0, 0, 0, dead=(1,)), rotation=rotation) in (0, 2)


def test_sticky_to_a_dead_engine_is_rerouted() -> None:
    assert choose_engine(_loads(0, 5, dead=(0,)), sticky=0, margin=100) == 1


def test_sticky_index_out_of_range_is_ignored() -> None:
    assert choose_engine(_loads(3, 1), sticky=7) == 1
    assert choose_engine(_loads(3, 1), sticky=-1) == 1


def test_ties_rotate_over_the_least_loaded() -> None:
    loads = _loads(1, 0, 0, 0)
    chosen = [choose_engine(loads, rotation=r) for r in range(6)]
    assert chosen == [1, 2, 3, 1, 2, 3]


def test_no_live_engine_raises() -> None:
    with pytest.raises(NoEngineAvailableError):
        choose_engine(_loads(0, 0, dead=(0, 1)))
    with pytest.raises(NoEngineAvailableError):
        choose_engine([])


def test_sticky_table_remembers_and_forgets_least_recently_used() -> None:
    table = StickyTable(capacity=2)
    table.set("a", 0)
    table.set("b", 1)
    assert table.get("a") == 0  # "a" is now the most recently used
    table.set("c", 2)
    assert len(table) == 2
    assert table.get("b") is None
    assert (table.get("a"), table.get("c")) == (0, 2)


def test_sticky_table_set_overwrites_and_refreshes() -> None:
    table = StickyTable(capacity=2)
    table.set("a", 0)
    table.set("b", 1)
    table.set("a", 3)
    table.set("c", 2)
    assert table.get("a") == 3
    assert table.get("b") is None
    assert table.get("missing") is None
