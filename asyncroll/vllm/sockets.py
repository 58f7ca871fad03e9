"""Where vLLM binds its ZeroMQ ``ipc://`` sockets, so that none is left behind.

vLLM binds each engine's sockets (seven on the CPU build: the client's input and output, the
workers' queues) as files in ``VLLM_RPC_BASE_PATH``, by default the temp directory, and leaves
them there when the engine closes: a test suite or a long run leaves thousands in ``/tmp``.
Unless the user set that variable, a process's engines bind theirs in a directory of its own,
``asyncroll-vllm-*`` in the temp directory, removed when the process exits; a directory whose
process was killed is removed by the next process that starts an engine. A live process holds
an exclusive ``flock`` on its directory's ``.lock`` (the kernel drops it with the process), so
a directory another process can lock has no owner; a pid would not do (another PID namespace
may share the temp directory). The directory is made under a hidden name, locked, and only
then renamed into view: a sweeper never sees it unlocked.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

from asyncroll.transport.backends import ownerless

__all__ = ["private_rpc_directory", "sweep_rpc_directories"]

logger = logging.getLogger(__name__)

PREFIX = "asyncroll-vllm-"
OWNER = "ASYNCROLL_VLLM_RPC_OWNER"
"""Set beside ``VLLM_RPC_BASE_PATH`` to ``pid:path`` of the process that made the directory: a
child process that inherits both (not one of vLLM's own) makes a directory of its own."""
_directory: Path | None = None


def private_rpc_directory() -> Path | None:
    """This process's directory for vLLM's sockets, made and set as ``VLLM_RPC_BASE_PATH`` on
    the first call (before the first engine starts: its processes inherit the variable);
    None where the user set the variable. Idempotent."""
    global _directory
    if _directory is not None:
        return _directory
    base = os.environ.get("VLLM_RPC_BASE_PATH")
    if base is not None and not os.environ.get(OWNER, "").endswith(f":{base}"):
        return None  # the user's
    sweep_rpc_directories()
    root = Path(tempfile.gettempdir())
    hidden = Path(tempfile.mkdtemp(prefix=f".{PREFIX}", dir=root))
    lock = os.open(hidden / ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until the process ends
    directory = root / hidden.name.removeprefix(".")
    hidden.rename(directory)
    os.environ["VLLM_RPC_BASE_PATH"] = str(directory)
    os.environ[OWNER] = f"{os.getpid()}:{directory}"
    atexit.register(_remove, directory, os.getpid())
    _directory = directory
    return directory


def _remove(directory: Path, owner: int = 0) -> None:
    """Remove ``directory``: its sockets, then its lock, then itself (a process killed midway
    leaves a directory the next sweep still finds). At exit, only in the process that made it
    (a forked child inherits the exit handler, not the directory)."""
    if owner and os.getpid() != owner:
        return
    for path in directory.glob("*"):
        if path.name == ".lock":
            continue
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    with contextlib.suppress(OSError):
        (directory / ".lock").unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def sweep_rpc_directories(root: Path | None = None) -> list[str]:
    """Remove the ``asyncroll-vllm-*`` directories whose process is gone (their lock is free);
    returns their names. Only this user's."""
    root = Path(tempfile.gettempdir()) if root is None else root
    swept = []
    for directory in root.glob(f"{PREFIX}*"):
        with ownerless(directory / ".lock") as gone:  # no lock file: not ours, or going
            if gone:
                _remove(directory)
                swept.append(directory.name)
    if swept:
        logger.info("removed %d socket directories of vLLM engines whose process is gone",
                    len(swept))
    return swept
