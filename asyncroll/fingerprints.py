"""Fingerprints of tensors: a cheap, exact check that a push delivered what the trainer sent.

A fingerprint is the bytes of 64 of a tensor's elements at fixed, evenly spread positions
(element ``i * (n // 64)``; all of a tensor of 64 elements or fewer): at most 512 bytes, and
comparing two costs nothing. Compare fingerprints of tensors of one dtype and shape (a receiver
checks those first). Equal tensors always have equal fingerprints, whatever device or process
computes them; a tensor that a training step moved (every element) almost surely a new one; a
corrupted element is seen when it is sampled (the sampled positions include the first element).

``Fingerprinter`` computes many at once with one gather and one copy to the host per device
and dtype. It keeps the strided sample views of contiguous tensors from one call to the next
(a view costs a few microseconds of Python; a 7B model has 339 tensors), only for the tensors
of the last call, so it never keeps a tensor alive longer than one call after its owner let go.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import Any, Final

import torch

__all__ = [
    "SAMPLES",
    "Fingerprinter",
    "PackedPrints",
    "fingerprints",
    "holds_exactly",
    "packed_fingerprints",
    "sampled",
]

SAMPLES: Final = 64

logger = logging.getLogger(__name__)

_Key = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


class Fingerprinter:
    """``fingerprinter(tensors) -> {name: fingerprint}``; reuses the sample views of the
    tensors it saw in its last call, and everything else it worked out about them."""

    def __init__(self) -> None:
        self._views: dict[_Key, torch.Tensor] = {}
        self._last: _Prepared | None = None
        """The last call's mapping and what was worked out for it: passed again (the same
        object, unchanged: a caller that caches it says so), reused without a look."""
        self._no_kernel = False
        self._early: tuple[_Prepared, torch.cuda.Event] | None = None
        """The read ``read_early`` queued: its mapping's prepared state, and the event after
        its copy to the host."""
        self.early_reads = 0
        """How many calls used a read ``read_early`` queued."""

    def __call__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> dict[str, bytes]:
        """``dtypes``: fingerprint a tensor as that dtype (its samples cast on the host), for
        a destination that holds a pushed tensor widened exactly (bf16 served as float32)."""
        prepared = self._prepared(tensors, dtypes)
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            blob = self._gathered(prepared) if prepared.uniform is not None else None
            if blob is None:
                found = _to_host(prepared.samples, prepared.targets)
            else:  # one dtype on a GPU: one kernel, then slices
                found, at = [], 0
                for end in prepared.ends:
                    found.append(blob[at:end])
                    at = end
        return dict(zip(tensors, found, strict=True))

    def differing(
        self,
        tensors: Mapping[str, torch.Tensor],
        expected: Mapping[str, bytes],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> list[str]:
        """The names (sorted) of ``tensors`` whose fingerprint (as ``dtypes``, see
        ``__call__``) is not ``expected[name]``: one comparison of all the bytes at once, and
        a look name by name only if that differs. Every name must be in ``expected``."""
        prepared = self._prepared(tensors, dtypes)
        wanted = b"".join([expected[name] for name in tensors])
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            if prepared.uniform is not None:  # one group: no slicing at all
                joined = self._gathered(prepared)
                if joined is None:
                    joined = _joined(prepared.samples, prepared.uniform)
                if joined == wanted:
                    return []
            found = _to_host(prepared.samples, prepared.targets)
        return sorted(name for name, got in zip(tensors, found, strict=True)
                      if got != expected[name])

    def read_early(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> bool:
        """Queue the read of ``tensors``' fingerprints on the current stream now, behind the
        work queued there to fill them, and its copy to the host; the next call or
        ``differing`` with the same mapping object (and ``dtypes``) uses it, without a kernel
        launch or a device sync of its own. A receiver queues it behind its last load, before
        the device sync it makes anyway: the check then costs a comparison of bytes (7B on an
        H100: 0.35-0.6 ms less an update). What it reads is what the tensors hold once the
        queued work is done: do not change them before the check. A read not used by then
        stays until the next ``read_early``, ``discard_early`` or ``clear``: discard it where
        its tensors may change before a later check (a receiver does, as each push begins).
        False (nothing queued) where the kernel does not apply (see ``_gathered``)."""
        self._early = None
        prepared = self._prepared(tensors, dtypes)
        table = self._table(prepared)
        if table is None:
            return False
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            self._early = (prepared, table.queue())
        return True

    def discard_early(self) -> None:
        """Forget the read ``read_early`` queued, if any: the next check reads afresh."""
        self._early = None

    def _prepared(
        self, tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None
    ) -> _Prepared:
        last = self._last
        if last is not None and tensors is last.tensors and dtypes is last.dtypes:
            return last  # the same tensors as last time: the same views, the same table
        samples = self._samples(tensors)
        targets = [(dtypes or {}).get(name, t.dtype) for name, t in tensors.items()]
        uniform = None
        if samples and len({(x.device, x.dtype, d)
                            for x, d in zip(samples, targets, strict=True)}) == 1:
            uniform = targets[0]
        ends, at = [], 0
        for sample, target in zip(samples, targets, strict=True):
            at += sample.numel() * target.itemsize
            ends.append(at)
        self._last = _Prepared(tensors, dtypes, samples, targets, uniform, ends)
        return self._last

    def _gathered(self, prepared: _Prepared) -> bytes | None:
        """The bytes of every sample in order, read on a CUDA device by one Triton kernel
        from a table of their addresses (kept with the samples). ``torch.cat`` of a 7B
        model's 339 strided samples cost 0.5-1 ms of host time in vLLM's worker; the kernel
        about 0.05. None where it does not apply (CPU, no Triton, samples of several devices
        or dtypes, a widened dtype): the caller joins them with ``torch.cat``."""
        early, self._early = self._early, None
        if early is not None and early[0] is prepared:
            assert prepared.table is not None
            early[1].synchronize()  # done already where a device sync followed the queueing
            self.early_reads += 1
            return prepared.table.host_bytes()
        table = self._table(prepared)
        return None if table is None else table.read()

    def _table(self, prepared: _Prepared) -> _AddressTable | None:
        """The kernel's table for ``prepared`` (made once); None where it does not apply."""
        samples = prepared.samples
        if (self._no_kernel or prepared.uniform is None or not samples[0].is_cuda
                or samples[0].dtype != prepared.uniform):
            return None
        if prepared.table is None:
            try:
                prepared.table = _AddressTable(samples)
            except Exception as exc:  # no Triton here, or a dtype it does not read
                logger.info("fingerprints: no gather kernel (%s); using torch.cat", exc)
                self._no_kernel = True
                return None
        return prepared.table

    def _samples(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        views: dict[_Key, torch.Tensor] = {}
        samples: list[torch.Tensor] = []
        # vLLM's parameters are a Python tensor subclass: skip its __torch_function__.
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            for tensor in tensors.values():
                if not tensor.is_contiguous():
                    samples.append(sampled(tensor))  # a copy: nothing to keep
                    continue
                key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
                       tensor.device)
                view = self._views.get(key)
                if view is None:
                    view = sampled(tensor)
                views[key] = view
                samples.append(view)
        self._views = views
        return samples

    def clear(self) -> None:
        self._views.clear()
        self._last = None
        self._early = None


class _Prepared:
    """One mapping's samples, the dtype each is fingerprinted as, the one dtype they share on
    one device (None if not), where each one's bytes end, and the kernel's table."""

    __slots__ = ("dtypes", "ends", "samples", "table", "targets", "tensors", "uniform")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None,
        samples: list[torch.Tensor],
        targets: list[torch.dtype],
        uniform: torch.dtype | None,
        ends: list[int],
    ) -> None:
        self.tensors, self.dtypes, self.samples, self.targets = tensors, dtypes, samples, targets
        self.uniform, self.ends = uniform, ends
        self.table: _AddressTable | None = None


_WIDER: Final = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def holds_exactly(served: torch.dtype, pushed: torch.dtype) -> bool:
    """Whether a tensor served as ``served`` holds every ``pushed`` value exactly (the same
    dtype, or a wider float: then its fingerprint as ``pushed`` is the pushed one's)."""
    return served == pushed or served in _WIDER.get(pushed, ())


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """The fingerprint of each tensor (see the module doc)."""
    return Fingerprinter()(tensors)


def packed_fingerprints(
    chunks: Mapping[str, torch.Tensor],
    layout: tuple[tuple[str, str, int, tuple[int, ...]], ...],
) -> dict[str, bytes]:
    """The fingerprint of each tensor of a packed adapter (``asyncroll.adapters.pack_adapter``:
    ``layout`` places each one in a flat chunk), equal to ``fingerprints`` of the tensors
    themselves, from one gather and one copy to the host per chunk."""
    out: dict[str, bytes] = {}
    with torch.no_grad():
        for chunk, flat in chunks.items():
            names, index, ends = _packed_samples(layout, chunk, flat.device)
            if not names:
                continue
            blob = flat[index].cpu().view(torch.uint8).numpy().tobytes()
            size, at = flat.element_size(), 0
            for name, end in zip(names, ends, strict=True):
                out[name] = blob[at * size:end * size]
                at = end
    return out


class PackedPrints:
    """``packed_fingerprints`` of chunks taken as they land: each chunk's samples are gathered
    and sent to the host as soon as it is loaded (``start``; on a GPU, without waiting for
    the device), and read when the check needs them (``result``). A worker's adapter
    receive starts them before the sender's last message, which then hides their wait."""

    def __init__(self, layout: tuple[tuple[str, str, int, tuple[int, ...]], ...]) -> None:
        self._layout = layout
        self._sizes: dict[str, int] = {}
        """Each chunk's length, as the layout tiles it."""
        for _, chunk, first, shape in layout:
            self._sizes[chunk] = max(self._sizes.get(chunk, 0), first + math.prod(shape))
        self._started: dict[str, tuple[torch.Tensor, list[str], list[int], torch.Tensor,
                                       Any]] = {}
        """chunk -> (the tensor it landed as, its tensors' names, where each one's samples
        end, the samples (on the host), the event that says they are there)."""

    def start(self, chunk: str, flat: torch.Tensor) -> None:
        """Gather ``flat``'s samples (chunk ``chunk`` as it landed) and queue their copy."""
        if flat.dim() != 1 or flat.numel() != self._sizes.get(chunk):
            return  # not as the layout says: the check refuses it (and fingerprints it then)
        with torch.no_grad():
            names, index, ends = _packed_samples(self._layout, chunk, flat.device)
            if not names:
                return
            samples = flat[index]
            done = None
            if samples.is_cuda:
                host = torch.empty(samples.shape, dtype=samples.dtype, pin_memory=True)
                host.copy_(samples, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(torch.cuda.current_stream(flat.device))
                samples = host
            self._started[chunk] = (flat, names, ends, samples, done)

    def result(self, chunks: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        """``packed_fingerprints(chunks, layout)``: from the samples started of the very
        tensors in ``chunks``, the others' taken now."""
        out: dict[str, bytes] = {}
        for chunk, flat in chunks.items():
            started = self._started.get(chunk)
            if started is None or started[0] is not flat:
                out.update(packed_fingerprints({chunk: flat}, self._layout))
                continue
            _, names, ends, samples, done = started
            if done is not None:
                done.synchronize()
            blob = samples.view(torch.uint8).numpy().tobytes()
            size, at = flat.element_size(), 0
            for name, end in zip(names, ends, strict=True):
                out[name] = blob[at * size:end * size]
                at = end
        return out


@functools.lru_cache(maxsize=16)
def _packed_samples(
    layout: tuple[tuple[str, str, int, tuple[int, ...]], ...], chunk: str, device: torch.device
) -> tuple[list[str], torch.Tensor, list[int]]:
    """The positions ``sampled`` reads of each tensor of ``chunk``, as one index into it; the
    tensors' names, and where each one's samples end."""
    names: list[str] = []
    firsts: list[int] = []
    steps: list[int] = []
    counts: list[int] = []
    for name, where, offset, shape in layout:
        if where != chunk:
            continue
        n = 1
        for dim in shape:
            n *= dim
        names.append(name)
        firsts.append(offset)
        steps.append(n // SAMPLES if n > SAMPLES else 1)
        counts.append(min(n, SAMPLES))
    if not names:
        return names, torch.zeros(0, dtype=torch.long, device=device), []
    count = torch.tensor(counts)
    ends = count.cumsum(0)
    owner = torch.repeat_interleave(torch.arange(len(names)), count)
    within = torch.arange(int(ends[-1])) - (ends - count)[owner]
    index = torch.tensor(firsts)[owner] + within * torch.tensor(steps)[owner]
    return names, index.to(device), ends.tolist()


def sampled(tensor: torch.Tensor) -> torch.Tensor:
    """The elements a fingerprint samples: element ``i * (n // SAMPLES)`` of the flattened
    tensor, ``SAMPLES`` of them, or all of a tensor of ``SAMPLES`` or fewer; a strided view of
    a contiguous tensor (no copy)."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n <= SAMPLES:
        return flat
    return flat[:: n // SAMPLES][:SAMPLES]


def _joined(samples: list[torch.Tensor], as_dtype: torch.dtype) -> bytes:
    """The bytes of every sample in order, as ``as_dtype`` (one gather, one copy to the
    host)."""
    joined = torch.cat(samples).cpu() if len(samples) > 1 else samples[0].cpu()
    if joined.dtype != as_dtype:
        joined = joined.to(as_dtype)
    return joined.contiguous().view(torch.uint8).numpy().tobytes()


def _to_host(samples: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[bytes]:
    """Each sample's bytes as ``dtypes[i]``, in order: one gather, one copy to the host and
    one conversion to bytes per (device, dtype, as dtype), then slices (no torch call per
    tensor: a 7B model has 339)."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, (sample, dtype) in enumerate(zip(samples, dtypes, strict=True)):
        groups.setdefault((sample.device, sample.dtype, dtype), []).append(i)
    out: list[bytes] = [b""] * len(samples)
    for (_device, _dtype, as_dtype), members in groups.items():
        parts = [samples[i] for i in members]
        blob = _joined(parts, as_dtype)
        width = as_dtype.itemsize
        at = 0
        for i, part in zip(members, parts, strict=True):
            end = at + part.numel() * width
            out[i] = blob[at:end]
            at = end
    return out


_INT_OF_WIDTH: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _AddressTable:
    """Where each sample starts (its address), its stride and length, on its device, for
    ``_gather_kernel``; valid while the samples are (it keeps them alive)."""

    def __init__(self, samples: list[torch.Tensor]) -> None:
        width = samples[0].element_size()
        if width not in _INT_OF_WIDTH or any(s.dim() != 1 for s in samples):
            raise ValueError(f"element size {width}")
        self.samples = samples
        self.kernel = _gather_kernel()
        device = samples[0].device
        self.address = torch.tensor([s.data_ptr() for s in samples], dtype=torch.int64,
                                    device=device)
        self.stride = torch.tensor([s.stride(0) for s in samples], dtype=torch.int64,
                                   device=device)
        self.count = torch.tensor([s.numel() for s in samples], dtype=torch.int32, device=device)
        self.counts = [s.numel() for s in samples]
        self.out = torch.empty(len(samples), SAMPLES, dtype=_INT_OF_WIDTH[width], device=device)
        self.host: torch.Tensor | None = None
        """Pinned host rows for ``queue`` (made at its first use)."""
        self.width = width

    def read(self) -> bytes:
        self._gather()
        return self._rows(self.out.cpu().numpy())

    def queue(self) -> torch.cuda.Event:
        """Gather and copy to ``host`` on the current stream; the event follows the copy."""
        self._gather()
        if self.host is None:
            self.host = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
        self.host.copy_(self.out, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.out.device))
        return done

    def host_bytes(self) -> bytes:
        """The rows ``queue`` copied (synchronise with its event first)."""
        assert self.host is not None
        return self._rows(self.host.numpy())

    def _gather(self) -> None:
        self.kernel[(len(self.samples),)](
            self.address, self.stride, self.count, self.out, SAMPLES=SAMPLES,
            BITS=self.width * 8,
        )

    def _rows(self, rows: Any) -> bytes:
        if all(n == SAMPLES for n in self.counts):
            whole: bytes = rows.tobytes()
            return whole
        return b"".join(rows[i, :n].tobytes() for i, n in enumerate(self.counts))


@functools.cache
def _gather_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def gather(  # type: ignore[no-untyped-def]
        address, stride, count, out, SAMPLES: tl.constexpr, BITS: tl.constexpr
    ):
        row = tl.program_id(0)
        start = tl.load(address + row)
        step = tl.load(stride + row)
        n = tl.load(count + row)
        j = tl.arange(0, SAMPLES)
        if BITS == 8:
            base = start.to(tl.pointer_type(tl.int8))
        elif BITS == 16:
            base = start.to(tl.pointer_type(tl.int16))
        elif BITS == 32:
            base = start.to(tl.pointer_type(tl.int32))
        else:
            base = start.to(tl.pointer_type(tl.int64))
        values = tl.load(base + j * step, mask=j < n, other=0)
        tl.store(out + row * SAMPLES + j, values)

    return gather
