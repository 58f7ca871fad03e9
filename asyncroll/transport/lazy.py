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

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

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
    batch: Callable[[], AbstractContextManager[object]] | None = None
    """A context the lazy tensors first packed in one bucket are made in, together (say, one
    launch for all their all-gathers); what ``make()`` returns is read only after it exits."""

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
    """The lazy tensors of one push, made a bucket at a time in plan order, each once: those
    whose first slot is in a bucket are made when it is packed, those of one ``batch()``
    context together inside it."""

    def __init__(self, plan: Sequence[Bucket], tensors: Mapping[str, object]) -> None:
        firsts: dict[int, list[str]] = {}
        last: dict[str, int] = {}
        first: dict[str, int] = {}
        for bucket in plan:
            for slot in bucket.slots:
                if isinstance(tensors[slot.name], LazyTensor):
                    if slot.name not in last:
                        firsts.setdefault(bucket.index, []).append(slot.name)
                        first[slot.name] = bucket.index
                    last[slot.name] = bucket.index
        self._batches = sorted(firsts.items())
        """(bucket index, the lazy tensors first in it), in plan order."""
        self._last = last
        self._first = first
        self._taken: set[str] = set()
        self._tensors = tensors
        self._next = 0
        """The first batch not made yet."""
        self._made: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Makes {self._next} of {len(self._batches)} batches made>"

    @property
    def pending(self) -> int:
        """Lazy tensors not made yet."""
        return sum(len(names) for _, names in self._batches[self._next :])

    def for_bucket(self, bucket: Bucket) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every source of ``bucket``'s slots (its lazy ones made now), and the tensors made
        for it (to fingerprint). A tensor spanning buckets is made once and kept until its
        last bucket."""
        made = self._make_through(bucket.index)
        sources: dict[str, torch.Tensor] = {}
        for slot in bucket.slots:
            if slot.name in sources:
                continue
            tensor = self._tensors[slot.name]
            if not isinstance(tensor, LazyTensor):
                assert isinstance(tensor, torch.Tensor)
                sources[slot.name] = tensor
                continue
            if slot.name not in self._made:
                raise RuntimeError(f"{slot.name!r} was made and dropped before its last bucket")
            sources[slot.name] = self._made[slot.name]
            if self._last[slot.name] == bucket.index:
                del self._made[slot.name]  # the caller keeps it while its copies may run
        return sources, made

    def take(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names``, whole, each once (the lazy ones made now, in plan order with
        every batch planned before theirs): for a sender whose transfers are not the plan's
        buckets (``asyncroll.transport.broadcast``) but must make them in the plan's order,
        the one every rank follows. A lazy tensor made for a later name is kept until taken."""
        lazies = [n for n in names if isinstance(self._tensors[n], LazyTensor)]
        if lazies:
            self._make_through(max(self._first[n] for n in lazies))
        out: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = self._tensors[name]
            if not isinstance(tensor, LazyTensor):
                assert isinstance(tensor, torch.Tensor)
                out[name] = tensor
                continue
            if name in self._taken or name not in self._made:
                raise RuntimeError(f"{name!r} was taken already")
            self._taken.add(name)
            out[name] = self._made.pop(name)
        return out

    def drain(self) -> None:
        """Make every lazy tensor not made yet (batch by batch, as a push would), dropping
        each."""
        with self._lock:
            while self._next < len(self._batches):
                self._make_batch()
            self._made.clear()

    def _make_through(self, index: int) -> dict[str, torch.Tensor]:
        """Make the batches up to bucket ``index``'s; the tensors made."""
        made: dict[str, torch.Tensor] = {}
        with self._lock:
            while self._next < len(self._batches) and self._batches[self._next][0] <= index:
                made |= self._make_batch()
        self._made |= made
        return made

    def _make_batch(self) -> dict[str, torch.Tensor]:
        _, names = self._batches[self._next]
        self._next += 1
        lazies: list[LazyTensor] = []
        for name in names:
            lazy = self._tensors[name]
            assert isinstance(lazy, LazyTensor)
            lazies.append(lazy)
        # Those of one ``batch`` context are made together inside it (in plan order), those
        # of none alone; contexts in the order of their first tensor (the same on every rank).
        by_context: dict[object, list[int]] = {}
        for index, lazy in enumerate(lazies):
            by_context.setdefault(lazy.batch, []).append(index)
        made: list[torch.Tensor] = [None] * len(lazies)  # type: ignore[list-item]
        failure: Exception | None = None
        for context, indices in by_context.items():
            batch = cast("Callable[[], AbstractContextManager[object]] | None", context)
            try:
                with batch() if batch is not None else contextlib.nullcontext():
                    for index in indices:
                        try:
                            made[index] = lazies[index].make()
                        except Exception as exc:  # the rest still made: other ranks wait
                            failure = failure or exc
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        for name, lazy, tensor in zip(names, lazies, made, strict=True):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != lazy.shape:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
                raise ValueError(f"{name!r}: make() returned {got}, not a tensor of {lazy.shape}")
        return dict(zip(names, made, strict=True))
