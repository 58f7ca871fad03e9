"""The floor of a staged push between two processes on one GPU, for ``bench/weight_push.py``.

The same buckets as a staged push, packed by this process into shared staging buffers and
loaded by a child process into its own tensors, with no host in the loop: each side queues a
whole push ahead on one stream, and every hand-off happens on the device (CUDA stream memory
operations: the sender's stream writes a buffer's ticket after its copies and the receiver's
stream waits for it before its loads; the other way round before a buffer is rewritten). What
is left is the device's own cost of two processes taking turns on one GPU; asyncroll's
pipeline, whose hand-offs go through the host, cannot beat it beyond run-to-run noise (it
measured 95-101% of it on an H100 and an H200). ``serial`` is the same copies
in one stream of one process (no turns to take): the gap between the two is what alternating
between the processes costs.

A benchmark tool, not a way to push weights: a stream that waits on a value another process
writes hangs for good if that process dies (asyncroll polls from the host instead, and gives
up on a receiver that left). Loads are memcpys, as asyncroll's are: on an H100 a receiver
stream with kernels (not memcpys) queued behind such a wait hung (2026-11-27).
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

from asyncroll.transport.plan import TensorMeta, default_group
from asyncroll.transport.plan import plan_buckets as asyncroll_plan

_Plan = list[list[tuple[int, int, int, int]]]
"""Per bucket: (tensor index, byte offset in the buffer, byte offset in the tensor, bytes)."""
_POLL_S = 1e-4
_WITHIN_S = 120.0
_Op = Callable[[int, int, int, int], int]


def _stream_ops() -> tuple[_Op, _Op]:
    """The driver's ``cuStreamWaitValue32`` (GEQ) and ``cuStreamWriteValue32``."""
    driver = ctypes.CDLL("libcuda.so.1")
    ops = []
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        op = getattr(driver, name)
        op.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        op.restype = ctypes.c_int
        ops.append(op)
    return ops[0], ops[1]


def _call(op: _Op, *args: int) -> None:
    status = op(*args)
    if status:
        raise RuntimeError(f"CUDA stream memory operation failed: driver error {status}")


def plan_buckets(tensors: dict[str, torch.Tensor], bucket: int) -> _Plan:
    """asyncroll's own bucket plan of ``tensors`` (a staged push's, default fused groups),
    as byte ranges: the floor copies exactly what a push of them copies, where it copies it."""
    metas = [TensorMeta.of(name, t) for name, t in tensors.items()]
    index = {name: i for i, name in enumerate(tensors)}
    return [
        [(index[s.name], s.offset, s.start, s.nbytes) for s in b.slots if s.nbytes]
        for b in asyncroll_plan(metas, bucket_bytes=bucket, group_of=default_group)
    ]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _checksums(tensors: list[torch.Tensor]) -> list[int]:
    return [int(t.view(-1).sum(dtype=torch.int64)) for t in tensors]


def _wait_stream(stream: torch.cuda.Stream, alive: Callable[[], bool], what: str) -> None:
    """Poll ``stream`` until its work is done; raise if the other process died or the work
    took longer than any push could (a device wait that will never be met)."""
    deadline = time.monotonic() + _WITHIN_S
    while not stream.query():  # type: ignore[no-untyped-call]
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the floor's {what} never finished (the other process died?)")
        time.sleep(_POLL_S)


def _receiver(
    inbox: Any, outbox: Any, plan: _Plan, sizes: list[int], buffers: int, device: int
) -> None:
    torch.cuda.set_device(device)
    wait, write = _stream_ops()
    staging, gates = inbox.get()
    ready, freed = gates.data_ptr(), gates.data_ptr() + 4 * buffers
    dst = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    handle = stream.cuda_stream
    ticket = 0
    outbox.put("ready")
    while inbox.get() == "push":
        with torch.cuda.stream(stream):  # the whole push, queued ahead
            for k, bucket in enumerate(plan):
                ticket += 1
                slot = k % buffers
                _call(wait, handle, ready + 4 * slot, ticket, 0)  # 0: value >= ticket
                buffer = staging[slot]
                for index, offset, start, nbytes in bucket:
                    dst[index][start : start + nbytes].copy_(buffer[offset : offset + nbytes])
                _call(write, handle, freed + 4 * slot, ticket, 0)
        outbox.put("queued")
        stream.synchronize()
        done = time.perf_counter()
        sums = _checksums(dst)  # this push's loads, checked apart from the others:
        for t in dst:  # a load that did not happen keeps no earlier push's bytes
            t.zero_()
        outbox.put((done, sums))


def measure(
    tensors: dict[str, torch.Tensor], *, bucket: int, buffers: int, pushes: int = 6
) -> dict[str, Any]:
    """Time ``pushes`` device-only staged pushes of ``tensors`` (CUDA, contiguous, on one GPU)
    between this process and a child, ``buffers`` staging buffers of ``bucket`` bytes.

    Each side queues a whole push ahead (about 250 device operations for weight_push.py's 8 GiB
    model; tens of thousands could fill a stream's queue before the other side starts).

    Returns the milliseconds of each push (from the sender's first copy queued to the
    receiver's last load done; the first push warms up), their median over the rest, and the
    bucket count.

    Raises:
        RuntimeError: a push's loads did not read what was packed (their checksums differ:
            a device wait did not hold), or the other process died.
    """
    if pushes < 2:
        raise ValueError("pushes must be at least 2 (the first one warms up)")
    sources = [_flat(t) for t in tensors.values()]
    device = sources[0].device
    sizes = [s.numel() for s in sources]
    plan = plan_buckets(tensors, bucket)
    expected = _checksums(sources)
    staging = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(buffers)]
    gates = torch.zeros(2 * buffers, dtype=torch.int32, device=device)
    ready, freed = gates.data_ptr(), gates.data_ptr() + 4 * buffers
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_receiver,
        args=(inbox, outbox, plan, sizes, buffers, device.index or 0),
        daemon=True,
    )
    child.start()
    wait, write = _stream_ops()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    handle = stream.cuda_stream
    times: list[float] = []
    ticket = 0
    filled: dict[int, int] = {}  # buffer -> ticket of the bucket last packed into it

    def answer(what: str) -> Any:
        deadline = time.monotonic() + _WITHIN_S
        while True:
            try:
                return outbox.get(timeout=1)
            except queue.Empty:
                if not child.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the floor's receiver did not {what}") from None

    try:
        inbox.put((staging, gates))
        answer("start")
        for _ in range(pushes):
            torch.cuda.synchronize(device)
            inbox.put("push")
            answer("queue its loads")
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                for k, bucket_slots in enumerate(plan):
                    ticket += 1
                    slot = k % buffers
                    if slot in filled:  # its last bucket loaded
                        _call(wait, handle, freed + 4 * slot, filled[slot], 0)
                    buffer = staging[slot]
                    for index, offset, start, nbytes in bucket_slots:
                        buffer[offset : offset + nbytes].copy_(
                            sources[index][start : start + nbytes]
                        )
                    _call(write, handle, ready + 4 * slot, ticket, 0)
                    filled[slot] = ticket
            _wait_stream(stream, child.is_alive, "packing")
            done, sums = answer("finish its loads")
            if sums != expected:
                raise RuntimeError(
                    f"push {len(times)}: the floor's loads did not read what was packed"
                )
            times.append((done - started) * 1e3)
    except BaseException:
        # Our stream may wait on a value the receiver will never write: write it ourselves.
        with contextlib.suppress(Exception):  # (the error to report is the one raised)
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            for slot, value in filled.items():
                _call(write, side.cuda_stream, freed + 4 * slot, value, 0)
            side.synchronize()
        raise
    finally:
        inbox.put("stop")
        child.join(30)
        if child.is_alive():
            child.kill()
    return {"ms": times, "median_ms": statistics.median(times[1:]), "buckets": len(plan)}


def serial(tensors: dict[str, torch.Tensor], *, bucket: int, repeats: int = 5) -> float:
    """Milliseconds (median) of the same packs and loads in one stream of one process, on the
    device's clock (CUDA events): the copies' own cost when no process takes turns with
    another and no host is in the way (``measure`` queues its pushes ahead for the same
    reason; its clock is the host's, from the first copy queued to the last load seen done)."""
    sources = [_flat(t) for t in tensors.values()]
    device = sources[0].device
    plan = plan_buckets(tensors, bucket)
    dst = [torch.empty_like(s) for s in sources]
    buffer = torch.empty(bucket, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for bucket_slots in plan:
            for index, offset, begin, nbytes in bucket_slots:
                buffer[offset : offset + nbytes].copy_(sources[index][begin : begin + nbytes])
            for index, offset, begin, nbytes in bucket_slots:
                dst[index][begin : begin + nbytes].copy_(buffer[offset : offset + nbytes])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])
