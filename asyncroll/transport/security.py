"""Per-job identity of a transport: nonce, secret, private runtime directory, safe unpickling.

Invariants:

* the runtime directory is created fresh (never reused), mode 0700, owned by us, not a symlink;
  everything we put in it or in /dev/shm is created 0600 with O_EXCL;
* the secret never appears in a repr or a log line;
* ``restricted_loads`` is the only unpickling in the transport, it runs only on bytes whose MAC
  already checked out, and it resolves no global outside a short allow-list of torch names
  needed to rebuild a CUDA IPC tensor.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

__all__ = [
    "JobIdentity",
    "RateLimitedLog",
    "make_runtime_dir",
    "restricted_loads",
]

NONCE_BYTES: Final = 8
SECRET_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """The per-job nonce (public: it names files) and secret (private: it keys every MAC)."""

    nonce: str
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> JobIdentity:
        return cls(nonce=secrets.token_hex(NONCE_BYTES), secret=secrets.token_bytes(SECRET_BYTES))


def runtime_base() -> Path:
    """$XDG_RUNTIME_DIR when it is a usable private directory of ours, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def make_runtime_dir(nonce: str, base: Path | None = None) -> Path:
    """Create ``<base>/asyncroll-<nonce>`` with mode 0700 and check nobody else can enter it.

    Raises:
        FileExistsError: the directory already exists (a collision or a squatter: never reuse).
        PermissionError: the created directory is not a private directory of ours.
    """
    path = (base or runtime_base()) / f"asyncroll-{nonce}"
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; make it exact
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"runtime directory {path} is not private to this user")
    return path


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals a CUDA IPC handle tuple needs."""

    _ALLOWED: Final = frozenset(
        {
            ("torch", "Tensor"),
            ("torch", "Size"),
            ("torch", "UntypedStorage"),
            ("torch", "TypedStorage"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
            ("collections", "OrderedDict"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` allowing only torch's tensor-rebuild names (see module docstring).

    Raises:
        pickle.UnpicklingError: the pickle names anything else.
    """
    return _TorchOnlyUnpickler(io.BytesIO(data)).load()


class RateLimitedLog:
    """Logs a warning at most once per ``interval`` seconds; counts what it swallowed."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self._interval
        suppressed, self._suppressed = self._suppressed, 0
        self._logger.warning(msg + " (%d similar suppressed)", *args, suppressed)
