"""The floor of a staged push between two processes on one GPU, for ``bench/weight_push.py``.

The same buckets as a staged push, packed by this process into shared staging buffers and
loaded by a child process into its own tensors, with no host in the loop: each side queues a
whole push ahead on one stream, and every hand-off happens on the device (CUDA stream memory
operations: the sender's stream writes a buffer's ticket after its copies and the receiver's
stream waits for it before its loads; the other way round before a buffer is rewritten). What
is left is the device's own cost of two processes taking turns on one GPU; asyncroll's
pipeline, whose hand-offs go through the host, cannot beat it. ``serial`` is the same copies
in one stream of one process (no turns to take): the gap between the two is what alternating
between the processes costs.

A benchmark tool, not a way to push weights: a stream that waits on a value another process
writes hangs for good if that process dies (asyncroll polls from the host instead, and gives
up on a receiver that left). Loads are memcpys, as asyncroll's are: on an H100 a receiver
stream with kernels (not memcpys) queued behind such a wait hung (2026-11-27).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

_Plan = list[list[tuple[int, int, int]]]
"""Per bucket: (tensor index, byte offset in the buffer, bytes)."""
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


def plan_buckets(sizes: list[int], bucket: int) -> _Plan:
    """Tensors in order, each whole in one bucket, slots 256-byte aligned (as asyncroll's)."""
    plan: _Plan = [[]]
    offset = 0
    for index, nbytes in enumerate(sizes):
        if nbytes > bucket:
            raise ValueError(f"tensor {index} ({nbytes} bytes) is larger than a bucket")
        if offset + nbytes > bucket and plan[-1]:
            plan.append([])
            offset = 0
        plan[-1].append((index, offset, nbytes))
        offset += -(-nbytes // 256) * 256
    return plan


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _receiver(inbox: Any, outbox: Any, plan: _Plan, sizes: list[int], buffers: int) -> None:
    torch.cuda.set_device(0)
    wait, write = _stream_ops()
    staging, gates = inbox.get()
    ready, freed = gates.data_ptr(), gates.data_ptr() + 4 * buffers
    dst = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    stream = torch.cuda.Stream()
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
                for index, offset, nbytes in bucket:
                    dst[index].copy_(buffer[offset : offset + nbytes])
                _call(write, handle, freed + 4 * slot, ticket, 0)
        outbox.put("queued")
        stream.synchronize()
        outbox.put(time.perf_counter())
    outbox.put([int(t.sum(dtype=torch.int64)) for t in dst])


def measure(
    tensors: dict[str, torch.Tensor], *, bucket: int, buffers: int, pushes: int = 6
) -> dict[str, Any]:
    """Time ``pushes`` device-only staged pushes of ``tensors`` (CUDA, contiguous) between
    this process and a child, ``buffers`` staging buffers of ``bucket`` bytes.

    Returns the milliseconds of each push (from the sender's first copy queued to the
    receiver's last load done; the first push warms up), their median over the rest, and the
    bucket count.

    Raises:
        RuntimeError: the loads did not read what was packed (the device waits did not hold).
    """
    sources = [_flat(t) for t in tensors.values()]
    sizes = [s.numel() for s in sources]
    plan = plan_buckets(sizes, bucket)
    staging = [torch.empty(bucket, dtype=torch.uint8, device="cuda") for _ in range(buffers)]
    gates = torch.zeros(2 * buffers, dtype=torch.int32, device="cuda")
    ready, freed = gates.data_ptr(), gates.data_ptr() + 4 * buffers
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(inbox, outbox, plan, sizes, buffers), daemon=True)
    child.start()
    wait, write = _stream_ops()
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    times: list[float] = []
    try:
        inbox.put((staging, gates))
        if outbox.get(timeout=600) != "ready":
            raise RuntimeError("the floor's receiver did not start")
        ticket = 0
        filled: dict[int, int] = {}  # buffer -> ticket of the bucket last packed into it
        for _ in range(pushes):
            torch.cuda.synchronize()
            inbox.put("push")
            if outbox.get(timeout=60) != "queued":
                raise RuntimeError("the floor's receiver did not queue its loads")
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                for k, bucket_slots in enumerate(plan):
                    ticket += 1
                    slot = k % buffers
                    if slot in filled:  # its last bucket loaded
                        _call(wait, handle, freed + 4 * slot, filled[slot], 0)
                    buffer = staging[slot]
                    for index, offset, nbytes in bucket_slots:
                        buffer[offset : offset + nbytes].copy_(sources[index])
                    _call(write, handle, ready + 4 * slot, ticket, 0)
                    filled[slot] = ticket
            stream.synchronize()
            times.append((outbox.get(timeout=60) - started) * 1e3)
        inbox.put("stop")
        sums = outbox.get(timeout=60)
        if sums != [int(s.sum(dtype=torch.int64)) for s in sources]:
            raise RuntimeError("the floor's loads did not read what was packed")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return {"ms": times, "median_ms": statistics.median(times[1:]), "buckets": len(plan)}


def serial(tensors: dict[str, torch.Tensor], *, bucket: int, repeats: int = 5) -> float:
    """Milliseconds (median) of the same packs and loads in one stream of one process."""
    sources = [_flat(t) for t in tensors.values()]
    plan = plan_buckets([s.numel() for s in sources], bucket)
    dst = [torch.empty_like(s) for s in sources]
    buffer = torch.empty(bucket, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for bucket_slots in plan:
            for index, offset, nbytes in bucket_slots:
                buffer[offset : offset + nbytes].copy_(sources[index])
            for index, offset, nbytes in bucket_slots:
                dst[index].copy_(buffer[offset : offset + nbytes])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])
