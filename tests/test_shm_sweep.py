"""Shared-memory segments of a sender killed before its receivers mapped them are unlinked by
the next sender on the machine; a live owner's are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncroll.transport.backends import ShmBackend, sweep_stale_segments


@pytest.mark.process
def test_segments_of_a_dead_owner_are_swept_and_a_live_owners_kept(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)  # exited and reaped: no process has this pid now (or a new one)
    stale = tmp_path / f"asyncroll-0badc0de-0-p{dead}"
    mine = tmp_path / f"asyncroll-0badc0de-1-p{os.getpid()}"
    unnamed = tmp_path / "asyncroll-0badc0de-2"  # an older sender's name: no owner to ask
    other = tmp_path / "not-ours-p1"
    for path in (stale, mine, unnamed, other):
        path.write_bytes(b"x")
    assert sweep_stale_segments(tmp_path) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (mine, unnamed, other))


def test_a_sender_names_its_segments_after_itself_and_sweeps_first(tmp_path: Path) -> None:
    stale = tmp_path / "asyncroll-0badc0de-0-p999999999"  # beyond any pid: never alive
    stale.write_bytes(b"x")
    buffer = ShmBackend(tmp_path).allocate(nonce="feed", index=0, nbytes=64)
    try:
        assert not stale.exists()
        assert buffer.descriptor.decode().endswith(f"asyncroll-feed-0-p{os.getpid()}")
    finally:
        buffer.close()
    assert not list(tmp_path.iterdir())
