"""Staging-buffer backends: where the two persistent buffers live and how a receiver maps them.

``shm``: POSIX shared memory, a file in /dev/shm created by us (O_CREAT|O_EXCL, 0600), mmapped
on both sides. CPU tensors; the CI path, and the fallback where CUDA IPC is unavailable.

``cuda_ipc``: device buffers shared by CUDA IPC handle (torch's ``reduce_tensor``). Copies run
on a private stream. Each direction has one interprocess CUDA event per staging buffer, polled
from the host by the other side: the sender records its buffer's *copy event* after queuing a
bucket's copies and signals the bucket at once; the receiver polls that event before it issues
its loads (so the signal, the receiver's wake-up and the ack all overlap the device's copies).
The receiver does not synchronise before it acks: it records the buffer's *load event* after
its loads, and the sender polls that event before it queues copies into the buffer again. The
receiver synchronises once, at the end of the push. (A receiver that cannot open the copy
events is signalled once the copies are done, polled by the sender.)

No stream of either side ever waits on the other process's device work: an IPC event recorded by
a process that then dies never fires (seen on an H100), and a stream waiting on it would be stuck
for the life of the process (and with it ``torch.cuda.synchronize()``). Host-side polls are
bounded and give up on a receiver that has left.

Invariants: a buffer is exported exactly once (its descriptor is computed once and cached) and a
receiver maps each descriptor once for the life of the connection. Nothing here calls
``empty_cache()`` or ``gc.collect()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import logging
import mmap
import os
import pickle
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Final, Protocol

import torch

from asyncroll.transport.packing import Span
from asyncroll.transport.security import restricted_loads

__all__ = [
    "BACKENDS",
    "Backend",
    "CudaIpcBackend",
    "MappedBuffer",
    "ShmBackend",
    "StagingBuffer",
    "make_backend",
    "on_local_device",
    "sweep_stale_segments",
]

log = logging.getLogger(__name__)

SHM_DIR: Final = Path("/dev/shm")
_SHM_NAME: Final = re.compile(r"^asyncroll-[0-9a-f]+-\d+(?:-p(?P<pid>\d+))?$")
"""``asyncroll-<nonce>-<buffer>-p<owner's pid>`` (the pid says whose it is, to a person; the
owner's lock says whether it lives, to ``sweep_stale_segments``)."""


class StagingBuffer(Protocol):
    """Sender side of one staging buffer."""

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a flat uint8 tensor."""
        ...

    @property
    def descriptor(self) -> bytes:
        """What a receiver needs to map the buffer (computed once)."""
        ...

    def unlink(self) -> None:
        """Drop the buffer's public name; existing mappings stay valid. Idempotent."""
        ...

    def close(self) -> None:
        """Unlink and release our mapping. Idempotent."""
        ...


class MappedBuffer(Protocol):
    """Receiver side of one staging buffer."""

    @property
    def tensor(self) -> torch.Tensor: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One kind of staging memory, both sides of it."""

    name: str

    def allocate(self, *, nonce: str, index: int, nbytes: int) -> StagingBuffer: ...

    def copy_context(self) -> AbstractContextManager[object]:
        """Context in which the sender's packing copies run (a side stream on CUDA)."""
        ...

    def mark_sources_ready(self) -> None:
        """On the caller's thread, before packing: later copies wait for work queued so far."""
        ...

    def queue_spans(self, spans: list[Span]) -> bool:
        """Queue raw copies (``packing.bucket_spans``) where copy_context's copies run; False,
        queuing nothing, where this backend has no such path (torch's copies then)."""
        ...

    async_copies: bool
    """Whether copies issued in copy_context may still be running when the call returns."""

    def mark_copies(self) -> object:
        """A marker of the copies issued in copy_context so far (for ``finish_copies``)."""
        ...

    inline_packing: bool
    """Packing only queues device work: the sender packs on the event loop's thread (no
    thread hop a bucket) and polls ``copies_done`` and ``peer_loads_done``, yielding to the
    loop in between. False: packing blocks, and runs in the sender's packing thread."""

    def copies_done(self, marker: object) -> bool:
        """Whether the copies before ``marker`` are visible to other processes (never blocks)."""
        ...

    def finish_copies(self, marker: object, *, within: float) -> None:
        """Block until the copies before ``marker`` are visible to other processes.

        Raises:
            TimeoutError: not done within ``within`` seconds (the device work the copies wait
                for, queued by the caller before the push, is still running).
        """
        ...

    def open_peer_events(self, handles: list[bytes]) -> list[object] | None:
        """Sender: open a receiver's per-buffer load events (None: that receiver syncs)."""
        ...

    def peer_loads_done(self, event: object) -> bool:
        """Sender: whether the loads behind a receiver's load event have finished."""
        ...

    def export_copy_events(self, buffers: int) -> list[bytes]:
        """Sender, once: one event handle per buffer that ``record_copies`` records, for
        receivers to poll before they read (then a bucket is signalled while its copies
        still run); [] where copies are synchronous or events cannot be shared."""
        ...

    def record_copies(self, buffer: int) -> object:
        """Sender, after queuing a bucket's copies into ``buffer``: record its copy event;
        returns a marker of the copies so far (for ``copies_done``)."""
        ...

    def open_copy_events(self, handles: list[bytes]) -> bool:
        """Receiver, after ``open``: open the sender's copy events; whether it will poll them
        (False: buckets come only once their copies are done)."""
        ...

    def copies_landed(self, buffer: int) -> bool:
        """Receiver: whether the sender's copies into ``buffer`` have finished (never
        blocks)."""
        ...

    def open(self, descriptor: bytes, *, nbytes: int) -> MappedBuffer: ...

    def export_load_events(self, buffers: int) -> list[bytes]:
        """Receiver, after ``open``: one event handle per buffer, or [] to sync before acks."""
        ...

    def loads_issued(self, buffer: int) -> None:
        """Receiver, after the loader returned: the buffer may be reused once its reads are
        done (records the buffer's event, or synchronises if there are no events)."""
        ...

    def finish_loads(self) -> None:
        """Receiver: block until the loader's device work is done."""
        ...


@contextlib.contextmanager
def ownerless(lock: Path) -> Iterator[bool]:
    """Whether the owner of ``lock`` (a file its owner holds an exclusive ``flock`` on for as
    long as it lives) is gone; while this is entered, the lock is ours, so no other sweeper
    acts on it. False for a file of another user's or none at all."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        if os.fstat(fd).st_uid != os.getuid():
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # its owner lives
            return
        yield True
    finally:
        os.close(fd)


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink the segments whose owner is gone (killed before its receivers had mapped them,
    after which names are unlinked at once); returns their names. An owner holds an exclusive
    ``flock`` on each of its segments for as long as it lives, and the kernel drops it with
    the process: a segment we can lock has no owner. (A pid would not do: another PID
    namespace sharing /dev/shm has pids this one cannot see.) Only this user's segments, only
    those named the way lock-holding owners name them."""
    swept = []
    for path in directory.glob("asyncroll-*-p*"):
        if _SHM_NAME.match(path.name) is None:
            continue
        with ownerless(path) as gone:
            if gone:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    swept.append(path.name)
    if swept:
        log.info("unlinked %d shared-memory segments of dead owners", len(swept))
    return swept


def _create_locked(path: Path, nbytes: int) -> int:
    """Create segment ``path`` (``nbytes``, this user's only) already locked by us, and return
    the descriptor that holds the lock. The segment is made and locked under a hidden name and
    only then linked to ``path``: a sweeper on another process never sees it unlocked (created
    and locked in place, a sweep between the two unlinked a live sender's segment under it)."""
    hidden = path.with_name(f".{path.name}.{os.urandom(4).hex()}")
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        os.link(hidden, path)  # FileExistsError where the name is taken, as O_EXCL did
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(hidden)
    return fd


class _ShmBuffer:
    def __init__(self, path: Path, nbytes: int, *, create: bool) -> None:
        self.path = path
        fd = _create_locked(path, nbytes) if create else os.open(path, os.O_RDWR)
        self._lock: int | None = None
        """The owner's descriptor, holding an exclusive lock while the segment lives
        (``sweep_stale_segments``)."""
        try:
            if not create:
                _check_private(fd, path, nbytes)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        if create:
            self._lock = fd
        else:
            os.close(fd)
        self._tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._linked = create

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"shared-memory buffer {self.path.name} is closed")
        return self._tensor

    @property
    def descriptor(self) -> bytes:
        return str(self.path).encode()

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self._tensor = None
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)
        if self._mmap is not None:
            mapping, self._mmap = self._mmap, None
            try:
                mapping.close()
            except BufferError:
                # A loader kept a view past its callback; the pages go when that view dies.
                log.warning("views of %s outlived the transport; unmapped later", self.path.name)


def _check_private(fd: int, path: Path, nbytes: int) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"shared-memory segment {path} is not private to this user")
    if info.st_size < nbytes:
        raise ValueError(f"shared-memory segment {path} is smaller than {nbytes} bytes")


class ShmBackend:
    """POSIX shared memory in /dev/shm (CPU tensors)."""

    name = "shm"

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self.directory = directory

    def __repr__(self) -> str:
        return f"<ShmBackend directory={self.directory}>"

    def allocate(self, *, nonce: str, index: int, nbytes: int) -> StagingBuffer:
        if index == 0:
            sweep_stale_segments(self.directory)
        name = f"asyncroll-{nonce}-{index}-p{os.getpid()}"
        return _ShmBuffer(self.directory / name, nbytes, create=True)

    def copy_context(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def mark_sources_ready(self) -> None:
        pass

    def queue_spans(self, spans: list[Span]) -> bool:
        return False

    async_copies = False
    inline_packing = False

    def mark_copies(self) -> object:
        return None

    def copies_done(self, marker: object) -> bool:
        return True

    def finish_copies(self, marker: object, *, within: float) -> None:
        pass

    def open_peer_events(self, handles: list[bytes]) -> list[object] | None:
        return None

    def peer_loads_done(self, event: object) -> bool:
        return True

    def export_copy_events(self, buffers: int) -> list[bytes]:
        return []

    def record_copies(self, buffer: int) -> object:
        return self.mark_copies()

    def open_copy_events(self, handles: list[bytes]) -> bool:
        return False

    def copies_landed(self, buffer: int) -> bool:
        return True

    def open(self, descriptor: bytes, *, nbytes: int) -> MappedBuffer:
        path = Path(descriptor.decode())
        if not _SHM_NAME.match(path.name):
            raise ValueError(f"not an asyncroll shared-memory name: {path.name!r}")
        return _ShmBuffer(path, nbytes, create=False)

    def export_load_events(self, buffers: int) -> list[bytes]:
        return []

    def loads_issued(self, buffer: int) -> None:
        pass  # the loader's copies out of host memory are done when it returns

    def finish_loads(self) -> None:
        pass


class _CudaBuffer:
    def __init__(self, tensor: torch.Tensor, descriptor: bytes = b"") -> None:
        self._tensor: torch.Tensor | None = tensor
        self._descriptor = descriptor

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("CUDA staging buffer is closed")
        return self._tensor

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        self._tensor = None


class CudaIpcBackend:
    """Device buffers shared by CUDA IPC handle; one handle per buffer, exported once."""

    name = "cuda_ipc"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if device is None:
            device = torch.cuda.current_device()
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        self._stream: torch.cuda.Stream | None = None
        self._sources_ready: torch.cuda.Event | None = None
        self._load_events: list[torch.cuda.Event] = []  # receiver side, one per buffer
        self._copy_events: list[torch.cuda.Event] = []  # sender side, one per buffer
        self._peer_copy_events: list[torch.cuda.Event] = []  # receiver side, the sender's
        self._torch_copies = False
        """The driver's memcpy failed once: ``queue_spans`` declines from then on."""
        self.use_load_events = True
        """Receiver: export load events when the buffers live on our current GPU (else sync)."""

    def __repr__(self) -> str:
        return f"<CudaIpcBackend device={self.device}>"

    def _copy_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._stream

    def allocate(self, *, nonce: str, index: int, nbytes: int) -> StagingBuffer:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return _CudaBuffer(tensor, _export(tensor))

    def export_storage(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        """Sender, one-copy mode: the whole storage under ``tensor`` as a flat uint8 tensor
        (keep it: it keeps the storage alive while receivers map it) and its descriptor."""
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        whole.set_(tensor.untyped_storage())
        return whole, _export(whole)

    def sources_done(self) -> bool:
        """Whether the work queued before ``mark_sources_ready`` is done (one-copy mode:
        receivers read the sources themselves, from other processes; never blocks)."""
        event = self._sources_ready
        return event is None or bool(event.query())  # type: ignore[no-untyped-call]

    def copy_context(self) -> AbstractContextManager[object]:
        stream = self._copy_stream()
        if self._sources_ready is not None:
            stream.wait_event(self._sources_ready)
        return torch.cuda.stream(stream)

    def mark_sources_ready(self) -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        self._sources_ready = event

    def queue_spans(self, spans: list[Span]) -> bool:
        """The copies on the copy stream, one driver ``cuMemcpyDtoDAsync`` each: about 1 us
        of host time a copy against ``copy_``'s 10-14 us (an H100 machine), with the same
        device work (``copy_`` of contiguous same-typed tensors is that memcpy too)."""
        memcpy = None if self._torch_copies else _driver_memcpy()
        index = self.device.index
        if memcpy is None or index is None or torch.cuda.current_device() != index:
            return False  # (the driver copies in the context current here: the device's)
        stream = self._copy_stream()
        if self._sources_ready is not None:
            stream.wait_event(self._sources_ready)
        handle = stream.cuda_stream
        for dst, src, nbytes in spans:
            status = memcpy(dst, src, nbytes, handle)
            if status:
                # Another context current here, say: torch's copies from now on. Those it
                # queues after ours rewrite the whole bucket, in the same stream's order.
                log.warning("cuMemcpyDtoDAsync failed (CUDA driver error %d): the sender packs"
                            " with torch's copies from now on", status)
                self._torch_copies = True
                return False
        return True

    async_copies = True
    inline_packing = True

    def mark_copies(self) -> object:
        marker = torch.cuda.Event()  # type: ignore[no-untyped-call]
        marker.record(self._copy_stream())
        return marker

    def copies_done(self, marker: object) -> bool:
        assert isinstance(marker, torch.cuda.Event)
        return bool(marker.query())  # type: ignore[no-untyped-call]

    def finish_copies(self, marker: object, *, within: float) -> None:
        assert isinstance(marker, torch.cuda.Event)
        poll_until(marker.query, within=within)

    def open_peer_events(self, handles: list[bytes]) -> list[object] | None:
        if not handles:
            return None
        with torch.cuda.device(self.device):
            return [
                torch.cuda.Event.from_ipc_handle(self.device, h)  # type: ignore[no-untyped-call]
                for h in handles
            ]

    def peer_loads_done(self, event: object) -> bool:
        assert isinstance(event, torch.cuda.Event)
        return bool(event.query())  # type: ignore[no-untyped-call]

    def export_copy_events(self, buffers: int) -> list[bytes]:
        with torch.cuda.device(self.device):
            self._copy_events = [
                torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                for _ in range(buffers)
            ]
            return [bytes(e.ipc_handle()) for e in self._copy_events]  # type: ignore[no-untyped-call]

    def record_copies(self, buffer: int) -> object:
        if not self._copy_events:
            return self.mark_copies()
        event = self._copy_events[buffer]
        event.record(self._copy_stream())
        return event

    def open_copy_events(self, handles: list[bytes]) -> bool:
        if not handles:
            return False
        with torch.cuda.device(self.device):
            self._peer_copy_events = [
                torch.cuda.Event.from_ipc_handle(self.device, h)  # type: ignore[no-untyped-call]
                for h in handles
            ]
        return True

    def copies_landed(self, buffer: int) -> bool:
        return bool(self._peer_copy_events[buffer].query())  # type: ignore[no-untyped-call]

    def open(self, descriptor: bytes, *, nbytes: int) -> MappedBuffer:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = restricted_loads(descriptor)
        if not isinstance(args, tuple):
            raise ValueError("CUDA IPC descriptor is not an argument tuple")
        rebuild: Callable[..., torch.Tensor] = rebuild_cuda_tensor
        tensor = rebuild(*on_local_device(args, torch.cuda.device_count()))
        if tensor.dtype != torch.uint8 or tensor.numel() < nbytes:
            raise ValueError("CUDA IPC buffer has the wrong type or size")
        self.device = tensor.device
        return _CudaBuffer(tensor)

    def export_load_events(self, buffers: int) -> list[bytes]:
        if not self.use_load_events or self.device != torch.device(
            "cuda", torch.cuda.current_device()
        ):
            return []  # another GPU than our loads run on: sync before each ack instead
        with torch.cuda.device(self.device):
            self._load_events = [
                torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                for _ in range(buffers)
            ]
            return [bytes(e.ipc_handle()) for e in self._load_events]  # type: ignore[no-untyped-call]

    def loads_issued(self, buffer: int) -> None:
        if self._load_events:
            self._load_events[buffer].record(torch.cuda.current_stream(self.device))
        else:
            self.finish_loads()

    def finish_loads(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


@functools.cache
def _driver_memcpy() -> Callable[[int, int, int, int], int] | None:
    """The CUDA driver's ``cuMemcpyDtoDAsync`` (addresses, bytes, stream), or None where the
    driver library cannot be loaded (torch's copies then). It copies in the context current
    on the calling thread: torch's, on the thread that made the staging buffers."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        memcpy = driver.cuMemcpyDtoDAsync_v2
    except (OSError, AttributeError):
        log.info("no CUDA driver memcpy: the sender packs with torch's copies")
        return None
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    return memcpy


def on_local_device(args: tuple[object, ...], devices: int) -> tuple[object, ...]:
    """torch's CUDA IPC arguments, opened on a device this process has.

    ``rebuild_cuda_tensor`` opens the handle on the sender's device index (argument 6). A
    receiver started on one GPU of several (``CUDA_VISIBLE_DEVICES``, as the examples start an
    engine beside a trainer on ``cuda:N``) sees that GPU as its device 0: an index it does not
    have means its current device."""
    index = args[6] if len(args) > 6 else None
    if isinstance(index, int) and not 0 <= index < devices:
        return (*args[:6], torch.cuda.current_device(), *args[7:])
    return args


def _export(tensor: torch.Tensor) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    return pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)


def poll_until(
    done: Callable[[], bool], *, within: float, give_up: Callable[[], bool] | None = None
) -> bool:
    """Poll ``done`` until it is true (returns True) or ``give_up`` is (returns False).

    For device work, where ``synchronize`` has no deadline. A bucket's copies take ~0.1-2 ms and
    these waits are on a push's critical path: spin (yielding the GIL) for the first 10 ms, then
    back off to 1 ms.

    Raises:
        TimeoutError: neither within ``within`` seconds.
    """
    for pause in _polls(done, within, give_up):
        if pause is None:
            return False
        time.sleep(pause)
    return True


async def apoll_until(
    done: Callable[[], bool], *, within: float, give_up: Callable[[], bool] | None = None
) -> bool:
    """``poll_until`` on the event loop: between polls, other tasks run (the first 10 ms a
    loop turn apart, then 1 ms apart).

    Raises:
        TimeoutError: neither within ``within`` seconds.
    """
    for pause in _polls(done, within, give_up):
        if pause is None:
            return False
        await asyncio.sleep(pause)
    return True


def _polls(
    done: Callable[[], bool], within: float, give_up: Callable[[], bool] | None
) -> Iterator[float | None]:
    """The schedule of ``poll_until``: yields the pause before the next poll until ``done``
    (then stops), or None once ``give_up`` is true.

    Raises:
        TimeoutError: neither within ``within`` seconds.
    """
    started = time.monotonic()
    while not done():
        if give_up is not None and give_up():
            yield None
            return
        waited = time.monotonic() - started
        if waited > within:
            raise TimeoutError(f"not done within {within:g} s")
        yield 0 if waited < 0.01 else 0.001


BACKENDS: Final[dict[str, Callable[[], Backend]]] = {
    "shm": ShmBackend,
    "cuda_ipc": CudaIpcBackend,
}


def make_backend(name: str) -> Backend:
    """A backend by its name, with default options (the receiver's view of it)."""
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown transport backend {name!r}; known: {sorted(BACKENDS)}") from None
