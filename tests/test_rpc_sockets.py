"""vLLM's socket files go to a directory of the process's own, removed when it exits, and swept
by the next process where it was killed (``asyncroll.vllm.sockets``; an engine's own sockets:
``tests/test_leftovers.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

BIND = textwrap.dedent("""
    import os, socket, sys
    from asyncroll.vllm.sockets import private_rpc_directory
    directory = private_rpc_directory()
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(directory)
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(directory / "engine-input"))  # what vLLM does with the variable
    print(directory, flush=True)
    if sys.argv[1] == "wait":
        sys.stdin.read()
""")


def environment(tmp_path: Path) -> dict[str, str]:
    """Ours, less the directory this process's own engines set (a test run that started one
    before has it: a child would take it for the user's)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_RPC_BASE_PATH", "ASYNCROLL_VLLM_RPC_OWNER")}
    return {**env, "PYTHONPATH": PYTHONPATH, "TMPDIR": str(tmp_path)}


def start(tmp_path: Path, how: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BIND, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd=ROOT, env=environment(tmp_path),
    )


def socket_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_socket())


def test_a_process_that_exits_leaves_no_socket_file(tmp_path: Path) -> None:
    process = start(tmp_path, "exit")
    out, _ = process.communicate(timeout=120)
    directory = Path(out.strip())
    assert process.returncode == 0 and directory.parent == tmp_path
    assert not directory.exists() and socket_files(tmp_path) == []


def test_a_killed_process_is_swept_by_the_next_and_a_live_one_is_not(tmp_path: Path) -> None:
    killed = start(tmp_path, "wait")
    assert killed.stdout is not None
    dead = Path(killed.stdout.readline().strip())
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert dead.exists()  # no exit handler ran
    live = start(tmp_path, "wait")
    assert live.stdout is not None
    alive = Path(live.stdout.readline().strip())
    assert not dead.exists() and alive.exists()  # its start swept the dead one's
    last = start(tmp_path, "exit")
    last.communicate(timeout=120)
    assert alive.exists()  # locked by a live process: kept
    live.communicate(input="", timeout=120)
    assert socket_files(tmp_path) == []


def test_the_users_own_directory_is_left_to_them(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    code = ("from asyncroll.vllm.sockets import private_rpc_directory; import os;"
            " print(private_rpc_directory(), os.environ['VLLM_RPC_BASE_PATH'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=True,
                          env={**environment(tmp_path), "VLLM_RPC_BASE_PATH": str(mine)})
    assert done.stdout.split() == ["None", str(mine)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_child_that_inherits_the_directory_makes_its_own(tmp_path: Path) -> None:
    """A process started by one whose engines set the variable (not one of vLLM's own) binds
    its sockets in a directory of its own: the parent removes its directory when it exits."""
    parent = start(tmp_path, "wait")
    assert parent.stdout is not None
    theirs = Path(parent.stdout.readline().strip())
    child = subprocess.run(
        [sys.executable, "-c", BIND, "exit"], capture_output=True, text=True, cwd=ROOT,
        timeout=120, check=True, env={**environment(tmp_path), "VLLM_RPC_BASE_PATH": str(theirs),
                                      "ASYNCROLL_VLLM_RPC_OWNER": f"{parent.pid}:{theirs}"})
    assert Path(child.stdout.strip()) not in (theirs, Path("None")) and theirs.exists()
    parent.communicate(input="", timeout=120)
    assert socket_files(tmp_path) == []
