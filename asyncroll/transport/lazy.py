"""Tensors made as their bucket is packed: a sharded trainer's full tensors, gathered bucket by
bucket, so that a push never holds more than its staging buffers and the buckets in flight.

A ``LazyTensor`` is planned by its shape and dtype; its bytes come from ``make()`` (an
all-gather of an FSDP shard, say) when the sender packs the first bucket that holds it. A
push's ``Makes`` calls the ``make()`` of its lazy tensors one at a time, in the order of the
plan, under one lock: every trainer rank plans the same buckets from the same shapes, so every
rank issues its collectives in the same order. ``drain()`` makes (and drops) whatever a failed
push did not, so that no other rank is left waiting in a collective this one skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncroll.transport.plan import Bucket

__all__ = ["LazyTensor", "Makes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LazyTensor:
    """A tensor of ``shape`` and ``dtype`` that ``make()`` produces when it is packed.

    ``make()`` may return another dtype of the same shape (a float32 master weight for a
    bf16 engine): the copy into the staging buffer casts it. ``device`` is where ``make()``'s
    tensor will be (the sender packs CUDA tensors on its copy stream)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    make: Callable[[], torch.Tensor]

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class Makes:
    """The lazy tensors of one push, made in plan order, each once."""

    def __init__(self, plan: Sequence[Bucket], tensors: Mapping[str, object]) -> None:
        order: dict[str, None] = {}
        last: dict[str, int] = {}
        for bucket in plan:
            for slot in bucket.slots:
                if isinstance(tensors[slot.name], LazyTensor):
                    order.setdefault(slot.name)
                    last[slot.name] = bucket.index
        self._order = list(order)
        self._last = last
        self._tensors = tensors
        self._next = 0
        self._made: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Makes {self._next} of {len(self._order)} made>"

    @property
    def pending(self) -> int:
        return len(self._order) - self._next

    def for_bucket(self, bucket: Bucket) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every source of ``bucket``'s slots (lazy ones made now, in order), and the tensors
        made for it (to fingerprint). A tensor spanning buckets is made once and kept until
        its last bucket."""
        sources: dict[str, torch.Tensor] = {}
        made: dict[str, torch.Tensor] = {}
        for slot in bucket.slots:
            if slot.name in sources:
                continue
            tensor = self._tensors[slot.name]
            if not isinstance(tensor, LazyTensor):
                assert isinstance(tensor, torch.Tensor)
                sources[slot.name] = tensor
                continue
            if slot.name not in self._made:
                made[slot.name] = self._make_through(slot.name)
            sources[slot.name] = self._made[slot.name]
            if self._last[slot.name] == bucket.index:
                del self._made[slot.name]  # the caller keeps it while its copies may run
        return sources, made

    def drain(self) -> None:
        """Make every lazy tensor not made yet, dropping each."""
        with self._lock:
            while self._next < len(self._order):
                self._make_next()
            self._made.clear()

    def _make_through(self, name: str) -> torch.Tensor:
        with self._lock:
            while name not in self._made:
                if self._next >= len(self._order):
                    raise RuntimeError(f"{name!r} was made and dropped before its last bucket")
                made_name, tensor = self._make_next()
                self._made[made_name] = tensor
            return self._made[name]

    def _make_next(self) -> tuple[str, torch.Tensor]:
        name = self._order[self._next]
        self._next += 1
        lazy = self._tensors[name]
        assert isinstance(lazy, LazyTensor)
        tensor = lazy.make()
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != lazy.shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{name!r}: make() returned {got}, not a tensor of {lazy.shape}")
        return name, tensor
