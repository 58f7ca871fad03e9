"""Shared-memory segments of a sender killed before its receivers mapped them are unlinked by
the next sender on the machine; a live owner's are left alone, wherever it lives (its lock on
the segment says so, not its pid: another PID namespace sharing /dev/shm has pids we cannot
see)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from asyncroll.transport import backends
from asyncroll.transport.backends import ShmBackend, sweep_stale_segments


def test_unlocked_segments_are_swept_and_locked_ones_kept(tmp_path: Path) -> None:
    stale = tmp_path / f"asyncroll-0badc0de-0-p{os.getpid()}"  # our own pid, yet no lock
    live = tmp_path / "asyncroll-0badc0de-1-p999999999"  # no such pid here, yet locked
    unnamed = tmp_path / "asyncroll-0badc0de-2"  # an older sender's name: not ours to judge
    other = tmp_path / "not-ours-p1"
    for path in (stale, live, unnamed, other):
        path.write_bytes(b"x")
    owner = os.open(live, os.O_RDWR)
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)  # held by "another process" (its own description)
        assert sweep_stale_segments(tmp_path) == [stale.name]
    finally:
        os.close(owner)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, unnamed, other))
    assert sweep_stale_segments(tmp_path) == [live.name]  # its owner is gone now


def test_a_sender_locks_its_segments_and_sweeps_first(tmp_path: Path) -> None:
    stale = tmp_path / "asyncroll-0badc0de-0-p1"
    stale.write_bytes(b"x")
    first = ShmBackend(tmp_path).allocate(nonce="feed", index=0, nbytes=64)
    second = ShmBackend(tmp_path).allocate(nonce="beef", index=0, nbytes=64)  # sweeps again
    try:
        assert not stale.exists()
        assert first.descriptor.decode().endswith(f"asyncroll-feed-0-p{os.getpid()}")
        assert Path(first.descriptor.decode()).exists()  # locked by its owner: kept
    finally:
        first.close()
        second.close()
    assert not list(tmp_path.iterdir())


def test_a_sweep_at_the_worst_moment_never_unlinks_a_segment_being_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another sender sweeps right as ours takes the lock on a segment it just created (a
    suite beside another job lost a live segment so, and its engine could not attach)."""
    flock = fcntl.flock
    swept: list[list[str]] = []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if not swept:
            swept.append(sweep_stale_segments(tmp_path))  # (its own flock calls come here too)
        flock(fd, operation)

    monkeypatch.setattr(backends.fcntl, "flock", flock_after_a_sweep)
    buffer = ShmBackend(tmp_path).allocate(nonce="cafe", index=1, nbytes=64)
    try:
        assert swept == [[]]
        path = Path(buffer.descriptor.decode())
        assert path.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]
        monkeypatch.setattr(backends.fcntl, "flock", flock)
        assert sweep_stale_segments(tmp_path) == []  # locked by its owner
    finally:
        buffer.close()
    assert not list(tmp_path.iterdir())
