"""``asyncroll.frozen_heap``: start-up's heap frozen out of the collector's walks, young
collections rarer, and everything handed back on exit."""

from __future__ import annotations

import gc
import weakref

import pytest

from asyncroll import frozen_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A two-node cycle nobody references: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_heap_is_frozen_inside_and_handed_back_with_the_thresholds() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with frozen_heap(young_threshold=12_345) as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (12_345, *before[1:])
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_cycle_frozen_at_entry_waits_for_the_exit_and_a_new_one_does_not() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    old = weakref.ref(a)
    with frozen_heap():
        del a, b
        new = cycle()
        gc.collect()
        assert new() is None  # made after entry: collected as ever
        assert old() is not None  # frozen: not walked
    gc.collect()
    assert old() is None


def test_an_inner_block_thaws_nothing_and_the_outer_thaws_all() -> None:
    with frozen_heap(young_threshold=1000):
        with frozen_heap(young_threshold=2000):
            assert gc.get_threshold()[0] == 2000
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == 1000
    assert gc.get_freeze_count() == 0


def test_a_threshold_below_one_is_refused_and_nothing_changes() -> None:
    before = gc.get_threshold()
    for bad in (0, 5e4, True):
        with pytest.raises(ValueError, match="an int of at least 1"), frozen_heap(
            young_threshold=bad  # type: ignore[arg-type]
        ):
            pass
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
