"""A compiled load plan: where each pushed tensor's bytes land in a model, learned once.

vLLM loads weights through ``model.load_weights``: a Python loop over per-parameter loaders that
fuse q/k/v and gate/up, cut tensor-parallel shards and copy. On a GPU that loop, not the memory
system, is what a push costs. The plan runs the model's own loaders once, on the first push of a
name, and records every copy they make into a parameter (``Tensor.copy_`` seen through a
``TorchFunctionMode``): the destination view and the source's offset, sizes and strides within
the pushed tensor. Later pushes of that name replay the copies straight from the staging buffer,
with no loader in between. Nothing is derived from a table of model names.

A name is *not planned*, and keeps going through ``load_weights``, when its load did anything the
replay could not reproduce exactly:

* a copy into a parameter from a tensor that is not a view of the pushed one (the loader
  converted, transposed into a temporary, or computed something: quantized or post-processed
  weights);
* any other in-place write to a parameter (``fill_``, ``__setitem__``, an ``out=``): such a
  write cannot be attributed to one name, so the names of that batch are learned again one at a
  time on their next push, and the one whose load writes that way stays unplanned;
* a copy of the pushed bytes into storage that is not a parameter or buffer of the model.

A name the model's loader skips (``load_weights`` returns the names it loaded, and this one
copied nothing: a tied ``lm_head.weight``) is planned as a replay of nothing. A name whose load
fails when the plan loads it apart from the rest of its batch (vLLM checks a tied alias against
its canonical name within one call) loads with its whole batch from then on.

Invariants:

* the first load of a name is the model's own ``load_weights`` (the plan only watches it), so a
  push is exactly what ``load_weights`` would do on every path;
* a recorded copy is replayed only for a tensor of the recorded dtype, shape and strides, and
  only while every parameter keeps the address, shape, strides and dtype it had when recorded
  (checked once a push; a change drops the plan, and it is learned again);
* a name's copies are replayed in the order its loader made them. Within a batch, replayed
  names go before the names still loaded by ``load_weights``: exact as long as no two names
  write the same bytes (vLLM's dense loaders do not; tied weights are one parameter, skipped).

Limits: a loader that writes a parameter from C++ or a custom kernel is invisible to the mode
(its copy would be missing from the plan). vLLM's dense loaders copy from Python; the GPU check
(``bench/gpu_e2e.py --sections push``) compares a planned push bitwise with ``load_weights``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from asyncroll.errors import PieceNotPlannedError
from asyncroll.receive.assembly import Route
from asyncroll.transport.packing import CopySplit, run_copies, split_copies
from asyncroll.transport.plan import Part

__all__ = ["LoadPlan", "PlanStatistics"]

logger = logging.getLogger(__name__)

Batch = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Copy:
    dst: torch.Tensor
    """A view of a parameter (or buffer): kept alive with the plan."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Source offset in elements from the pushed tensor's first element."""


@dataclass(frozen=True, slots=True)
class _Replay:
    """A batch's copies, coalesced and sorted once (``split_copies``), to replay."""

    split: CopySplit
    copies: int
    """Copies of the plan they carry out (more than the calls)."""

    @property
    def calls(self) -> int:
        return len(self.split[0]) + bool(self.split[2])


@dataclass(frozen=True, slots=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    copies: tuple[_Copy, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStatistics:
    planned: int
    """Tensors the last push loaded by replaying the plan."""
    learned: int
    """Tensors the last push loaded with ``load_weights`` while the plan watched (first sight)."""
    fallback: int
    """Tensors the last push loaded with ``load_weights`` because the plan cannot map them."""
    copies: int
    """Copies the last push replayed."""
    calls: int = 0
    """Copy calls those took: adjacent copies coalesced (``q``, ``k``, ``v`` into one fused
    parameter), and every small one in one fused launch (``packing.split_copies``)."""
    unplannable: dict[str, str] = field(default_factory=dict)
    """Name -> why it is not planned (every name seen so far, a few at most per reason)."""
    invalidations: int = 0
    """Times the plan was dropped because a parameter moved."""
    remembered: int = 0
    """Batches of the last push replayed from copies remembered from an earlier push of the
    same layout (the same staging buffers): no per-copy view or check."""
    check_seconds: float = 0.0
    """How long the last push's check that no parameter moved took (``begin_push``)."""


class LoadPlan:
    """Loads batches of (name, tensor) into ``model``: replayed copies where the plan knows
    the name, the model's ``load_weights`` (watched, to learn it) where not."""

    def __init__(self, model: torch.nn.Module, load_weights: Callable[[Batch], Any]) -> None:
        self._model = model
        self._load_weights = load_weights
        self._entries: dict[str, _Entry] = {}
        self._unplannable: dict[str, str] = {}
        self._solo: set[str] = set()
        """Names of a batch whose load could not be attributed: learned one at a time."""
        self._with_batch: set[str] = set()
        """Names that load only together with the rest of their batch (the model's loader
        checks names against each other within one call, e.g. vLLM's tied-alias check):
        a batch holding one goes whole through ``load_weights``."""
        self._failed_part: list[str] = []
        self._layout: list[tuple[int, torch.Size, tuple[int, ...], torch.dtype]] = []
        self._walk = _Walk(model)
        self.generation = 0
        """Counts changes to what the plan maps (a name learned, the plan dropped): answers
        of ``whole_target`` hold while it stays the same."""
        self._invalidations = 0
        self._counts: Counter[str] = Counter()
        self._replays: dict[tuple[Any, ...], _Replay] = {}
        """Batches seen whole-planned, by their layout (names, addresses, dtypes, shapes,
        strides): the (destination, source) pairs of their copies, made and sorted once
        (``split_copies``). A push from the same staging buffers (or of the same trainer
        storages, one-copy) replays these, with no per-copy view or check."""
        self._replays_before: dict[tuple[Any, ...], _Replay] = {}
        """The previous push's: kept one push, then dropped (the sources they hold may be a
        buffer no longer in use)."""
        self._unchecked = False
        """This push has not checked the parameters yet (``begin_push(check_late=True)``)."""
        self.check_seconds = 0.0
        """How long the last check of the parameters took (late or not)."""
        self._spent: list[_Replay] = []
        """Replays run into parameters that had moved (a late check found it): they keep
        the old storages their copies write alive until ``end_push``."""

    def __repr__(self) -> str:
        return (
            f"<LoadPlan planned names={len(self._entries)}"
            f" unplannable={len(self._unplannable)}>"
        )

    def statistics(self) -> PlanStatistics:
        return PlanStatistics(
            planned=self._counts["planned"],
            learned=self._counts["learned"],
            fallback=self._counts["fallback"],
            copies=self._counts["copies"],
            calls=self._counts["calls"],
            unplannable=dict(self._unplannable),
            invalidations=self._invalidations,
            remembered=self._counts["remembered"],
            check_seconds=self.check_seconds,
        )

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def begin_push(self, *, check_late: bool = False) -> None:
        """Reset the per-push counters; drop the plan if any parameter moved or changed its
        layout since.

        ``check_late``: check when the plan is first used instead. A first batch remembered
        by its ``layout`` (a one-copy push of the same storages: the whole push) replays its
        copies first, so that the check (a 7B model's 340 parameters: 0.5-0.8 ms of an H100
        host's Python) overlaps them on the device instead of delaying them. If a parameter
        moved, those copies wrote its old storage, which the replay keeps alive until
        ``end_push`` or the next ``begin_push``, and the batch is loaded again, as a plan
        dropped loads it. Use it only where

        * the device work of a push is synchronised before ``end_push`` (or the next push);
        * a parameter moves only by being replaced or re-pointed (``.data =``, a new
          ``Parameter``, a reload), so that its old storage stays allocated while referenced:
          never by freeing its storage in place (``untyped_storage().resize_(0)``, as FSDP
          does), nor onto memory another live tensor keeps using. vLLM's workers move
          parameters only the first way. (Checked first, the copies would never reach it.)"""
        self._counts.clear()
        self._replays_before, self._replays = self._replays, {}
        self._spent.clear()  # (the last push's device work is done: see above)
        self._unchecked = True
        if not check_late:
            self._check()

    def _ensure_checked(self) -> None:
        if self._unchecked:
            self._check()

    def _check(self) -> bool:
        """``begin_push``'s check of the parameters: whether they held (else the plan is
        dropped). Its duration: ``check_seconds``."""
        self._unchecked = False
        checking = time.perf_counter()
        try:
            return self._parameters_held()
        finally:
            self.check_seconds = time.perf_counter() - checking

    def _parameters_held(self) -> bool:
        if not self._walk.holds():
            self._walk = _Walk(self._model)
        # Without the parameters' own ``__torch_function__`` (vLLM's are a Python subclass:
        # reading 4 properties of 340 parameters through it took 5 ms of every 7B push).
        with torch._C.DisableTorchFunctionSubclass():
            layout = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in self._walk.tensors]
        held = not self._entries or layout == self._layout
        if not held:
            logger.info("model parameters moved since the load plan was made: learning it again")
            self._entries.clear()
            self.generation += 1
            self._invalidations += 1
            self.forget_sources()
        self._layout = layout
        return held

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], part: Part | None = None
    ) -> torch.Tensor | None:
        """Where a contiguous pushed tensor ``name`` of ``dtype`` and ``shape`` lands byte for
        byte: a flat uint8 view of the one contiguous parameter range its load copies it to
        whole, an empty tensor if its load copies nothing (the model skips it: a tied alias),
        or None where the plan does not know it that simply (not learned yet, cut into several
        copies, converted, loaded only with its batch). The receiver writes a tensor larger
        than a bucket there piece by piece, instead of reassembling it first
        (``WeightReceiver.receive(place=...)``); counted as planned.

        For a piece of a tensor (``part``): the one contiguous range its load copies the
        piece to whole, if the load copies exactly the piece's elements, in one copy.
        """
        self._ensure_checked()
        if part is not None:
            return self._piece_destination(name, dtype, shape, part)
        target = self.whole_target(name, dtype, shape)
        if target is None:
            return None
        if target.numel() == 0 and self._entries[name].copies == ():
            self._counts.update(planned=1)
            return torch.empty(0, dtype=torch.uint8)
        self._counts.update(planned=1, copies=1, calls=1)
        return target.reshape(-1).view(torch.uint8)

    def _piece_destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], part: Part
    ) -> torch.Tensor | None:
        entry = self._entries.get(name)
        if entry is None or name in self._with_batch or not _whole_matches(entry, dtype, part):
            return None
        count = math.prod(shape)
        if len(entry.copies) != 1:
            return None
        copy = entry.copies[0]
        view = part.source_view(copy.size, copy.stride, copy.offset, count)
        if (
            view is None
            or view[2] != 0
            or math.prod(view[0]) != count
            or view[1] != _contiguous_strides(view[0])
            or copy.dst.numel() != count
            or not copy.dst.is_contiguous()
            or copy.dst.dtype != dtype
        ):
            return None
        self._counts.update(planned=1, copies=1, calls=1)
        return copy.dst.reshape(-1).view(torch.uint8)

    def read_ranges(self) -> dict[str, tuple[int, ...]]:
        """For each name the plan replays: the range of elements ``[first, end)`` of the
        pushed (contiguous) tensor its copies read, and, where they read only some columns
        of its rows (a row-parallel shard), those: ``(first, end, first column, end
        column)``. A sender may push just that range, or those columns of every row, as a
        piece (``asyncroll.transport.piece``), where it is not the whole tensor. Names loaded
        only with their batch, or that copy nothing, are left out."""
        self._ensure_checked()
        ranges: dict[str, tuple[int, ...]] = {}
        for name, entry in self._entries.items():
            if name in self._with_batch or not entry.copies:
                continue
            if entry.stride != _contiguous_strides(entry.shape):
                continue
            ranges[name] = _read_range(entry.copies) + _read_columns(entry)
        return ranges

    def load_apart(
        self,
        batch: Batch,
        *,
        parts: Mapping[str, Part],
        sources_persist: bool | None = None,
    ) -> None:
        """``load`` of a batch in two loads: its pieces (``parts``: each one the plan loads,
        ``piece_route``), then its whole tensors. For a batch that ``load`` refuses whole
        because a whole tensor of it loads only with its batch (``load_weights`` would take
        the pieces for whole tensors). A piece copied twice lands the same bytes."""
        pieces = [(name, tensor) for name, tensor in batch if name in parts]
        wholes = [(name, tensor) for name, tensor in batch if name not in parts]
        if pieces:
            self.load(pieces, parts=parts, sources_persist=sources_persist)
        if wholes:
            self.load(wholes, parts={}, sources_persist=sources_persist)

    def piece_route(self, name: str, piece: torch.Tensor, part: Part) -> Route:
        """Where a worker fed by every trainer rank (``fan_in``) takes a piece of ``name``:

        - ``load``: the plan loads it (``load(parts=...)``): it holds every element the name's
          load reads, or the load reads nothing;
        - ``skip``: it holds none of them, and the one piece of its size at its place holds
          them all (a tensor-parallel worker's rows are one rank's rows): not needed here;
        - ``assemble``: put together with the other pieces and loaded whole: the plan does not
          know the name (or only with its batch), or what the load reads spans pieces (a
          replicated norm, a row-parallel shard's columns).

        ``skip`` assumes the pieces of a tensor are equal and laid end to end (each rank's
        ``Shard(0)`` rows, as ``fan_in`` sends them); a piece off that grid is put together."""
        self._ensure_checked()
        entry = self._entries.get(name)
        if (
            entry is None
            or name in self._with_batch
            or not piece.is_contiguous()
            or not _whole_matches(entry, piece.dtype, part)
        ):
            return "assemble"
        count = piece.numel()
        copies = [c for c in entry.copies if all(c.size)]
        if all(part.source_view(c.size, c.stride, c.offset, count) is not None for c in copies):
            return "load"
        if (
            part.columns is None
            and count
            and part.offset % count == 0
            and entry.stride == _contiguous_strides(entry.shape)
        ):
            first, end = _read_range(copies)
            disjoint = end <= part.offset or part.offset + count <= first
            if disjoint and first // count == (end - 1) // count:
                return "skip"
        return "assemble"

    def knows(self, name: str) -> bool:
        """Whether the plan maps ``name`` (its loads are replayed)."""
        self._ensure_checked()
        return name in self._entries

    def whole_target(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The parameter range a contiguous pushed tensor ``name`` of ``dtype`` and ``shape``
        is copied to whole and unchanged, as a tensor of that dtype and shape; an empty
        tensor if its load copies nothing; None if the plan does not map it that simply."""
        self._ensure_checked()
        entry = self._entries.get(name)
        if (
            entry is None
            or name in self._with_batch
            or entry.dtype != dtype
            or entry.shape != tuple(shape)
            or entry.stride != _contiguous_strides(entry.shape)
            or len(entry.copies) > 1
        ):
            return None
        if not entry.copies:
            return torch.empty(0, dtype=dtype)
        copy = entry.copies[0]
        dst = copy.dst
        if (
            copy.offset
            or copy.size != entry.shape
            or copy.stride != entry.stride
            or dst.dtype != dtype
            or tuple(dst.shape) != entry.shape
            or not dst.is_contiguous()
        ):
            return None
        return dst

    def end_push(self) -> None:
        """Drop what the previous push remembered and this one did not use: the sources it
        holds may be storages the sender no longer lists (a one-copy push's trainer tensors,
        replaced), which a kept view would keep mapped, and allocated in the trainer."""
        self._replays_before.clear()
        self._spent.clear()

    def forget_sources(self) -> None:
        """Drop every reference to pushed tensors (call when their buffers go away)."""
        self._replays.clear()
        self._replays_before.clear()

    def load(
        self,
        batch: Batch,
        *,
        sources_persist: bool | None = None,
        parts: Mapping[str, Part] | None = None,
    ) -> None:
        """Load ``batch``.

        ``parts`` (default: the batch's own ``parts`` attribute, which the transport's
        receiver sets): the tensors that are pieces of larger ones, and where. A piece is
        replayed from the plan, which must know its name and find every element its copies
        read inside the piece; else ``PieceNotPlannedError`` (nothing of the batch loaded).

        ``sources_persist`` (default: the batch's own ``sources_persist`` attribute, which the
        transport's receiver sets for staging buffers and one-copy pushes, else False): the
        tensors are views of memory that stays mapped at the same addresses while viewed, so
        a batch the plan maps whole is remembered, its copies' (destination, source) pairs
        kept for the next push of the same layout (by address, or by the batch's ``layout``
        where the receiver gives one), until the end of a push that
        does not use them (``end_push``) or ``forget_sources``. False: nothing of the batch is
        kept past the call."""
        if parts is None:
            parts = getattr(batch, "parts", None) or {}
        if sources_persist is None:
            sources_persist = bool(getattr(batch, "sources_persist", False))
        if self._unchecked and not parts and sources_persist and self._replay_first(batch):
            return
        self._ensure_checked()
        if parts:
            self._check_pieces(batch, parts)
        if any(name in self._with_batch for name, _ in batch):
            self._load_weights(list(batch))
            self._counts.update(fallback=len(batch))
            return
        key: tuple[Any, ...] = ()
        if sources_persist:
            layout = getattr(batch, "layout", None)  # the receiver's word for the same views
            key = (layout, len(batch)) if layout is not None and not parts else tuple(
                (name, t.data_ptr(), t.dtype, t.shape, t.stride(), parts.get(name))
                for name, t in batch
            )
            pairs = self._replays.get(key)
            if pairs is None and (pairs := self._replays_before.pop(key, None)) is not None:
                self._replays[key] = pairs
            if pairs is not None:
                with torch.no_grad():
                    run_copies(pairs.split)
                self._counts.update(
                    planned=len(batch), copies=pairs.copies, calls=pairs.calls, remembered=1
                )
                return
        planned: list[tuple[_Entry, torch.Tensor, Part | None]] = []
        """(entry, tensor, where the tensor sits in the pushed whole: None, it is whole)."""
        learn: list[tuple[str, torch.Tensor]] = []
        fallback: list[tuple[str, torch.Tensor]] = []
        for name, tensor in batch:
            entry = self._entries.get(name)
            part = parts.get(name)
            if part is not None:
                assert entry is not None  # _check_pieces
                planned.append((entry, tensor, part))
            elif entry is not None and _matches(entry, tensor):
                planned.append((entry, tensor, None))
            elif name in self._unplannable:
                fallback.append((name, tensor))
            else:
                learn.append((name, tensor))
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for entry, tensor, piece in planned:
            base = tensor.storage_offset()
            for copy in entry.copies:
                size, stride, offset = copy.size, copy.stride, copy.offset
                if piece is not None:  # the same read, of the piece (``_check_pieces``)
                    if not all(size):
                        continue
                    view = piece.source_view(size, stride, offset, tensor.numel())
                    assert view is not None
                    size, stride, offset = view
                dsts.append(copy.dst)
                srcs.append(tensor.as_strided(size, stride, base + offset))
        # Destinations that overlap (a tied alias) keep their copies in order.
        made = _Replay(split_copies(dsts, srcs, disjoint=_disjoint(dsts), coalesce=True), len(dsts))
        with torch.no_grad():
            run_copies(made.split)
        copies = len(dsts)
        if sources_persist and len(planned) == len(batch):
            self._replays[key] = made
        try:
            if learn:
                self._learn(learn)
            if fallback:
                self._load_weights(fallback)
        except Exception as exc:
            split = bool(planned) + bool(learn) + bool(fallback) > 1 or bool(
                self._solo.intersection(name for name, _ in learn)
            )
            if not split:
                raise
            if parts:  # a whole-batch load would take the pieces for whole tensors
                raise PieceNotPlannedError(
                    f"a batch with pieces failed to load apart: {type(exc).__name__}: {exc}"
                ) from exc
            # Loaded apart, a name failed: the loader may need the batch in one call. Whole,
            # the batch loads exactly as without a plan (replayed names again, same bytes).
            self._load_weights(list(batch))
            culprits = self._failed_part or [name for name, _ in fallback]
            for name in culprits:
                self._with_batch.add(name)
                self._unplannable[name] = "it loads only with the rest of its batch"
            logger.info("load plan: %s load only with their whole batch", culprits[:4])
            self._counts.update(fallback=len(batch))
            return
        self._counts.update(
            planned=len(planned),
            learned=len(learn),
            fallback=len(fallback),
            copies=copies,
            calls=made.calls,
        )

    def _replay_first(self, batch: Batch) -> bool:
        """``begin_push(check_late=True)``'s first load: a batch remembered by its layout
        replays, then the parameters are checked. True: they held, the batch is loaded.
        False: the check ran (and a replay, into moved parameters, is kept in ``_spent``);
        load the batch as usual."""
        layout = getattr(batch, "layout", None)
        key = (layout, len(batch))
        pairs = self._replays.get(key) or self._replays_before.get(key)
        if layout is None or pairs is None or any(n in self._with_batch for n, _ in batch):
            self._check()
            return False
        with torch.no_grad():
            run_copies(pairs.split)
        if not self._check():
            self._spent.append(pairs)
            return False
        self._replays[key] = pairs
        self._replays_before.pop(key, None)
        self._counts.update(
            planned=len(batch), copies=pairs.copies, calls=pairs.calls, remembered=1
        )
        return True

    def _check_pieces(self, batch: Batch, parts: Mapping[str, Part]) -> None:
        """Every piece of ``batch`` can be replayed: the plan knows its name (and not only
        with its batch), for a whole tensor of its dtype and shape, and every element its
        copies read lies inside the piece; and no name of the batch loads only with its
        batch (``load_weights`` would take the pieces for whole tensors)."""
        together = [name for name, _ in batch if name in self._with_batch]
        if together:
            raise PieceNotPlannedError(
                f"a batch with pieces holds {together[0]!r}, which loads only with its whole"
                " batch"
            )
        for name, tensor in batch:
            part = parts.get(name)
            if part is None:
                continue
            entry = self._entries.get(name)
            why = None
            if entry is None:
                why = "the load plan has not learned it (a whole push teaches it)"
            elif name in self._with_batch:
                why = "it loads only with its whole batch"
            elif not _whole_matches(entry, tensor.dtype, part):
                why = f"the plan knows it as {entry.dtype} {entry.shape}, not as {part.whole}"
            elif not tensor.is_contiguous():
                why = "the piece is not contiguous"
            else:
                count = tensor.numel()
                if any(all(c.size) and part.source_view(c.size, c.stride, c.offset, count) is None
                       for c in entry.copies):
                    first, end = _read_range(entry.copies)
                    held = (f"columns {list(part.columns)} of {count} elements" if part.columns
                            else f"elements [{part.offset}, {part.offset + count})")
                    why = f"its load reads elements [{first}, {end}), the piece holds {held}"
            if why is not None:
                raise PieceNotPlannedError(f"a piece of {name!r} cannot be loaded: {why}")

    def _learn(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        together = [item for item in batch if item[0] not in self._solo]
        alone = [[item] for item in batch if item[0] in self._solo]
        self._failed_part = []
        for part in ([together] if together else []) + alone:
            try:
                self._learn_part(part, alone=len(part) == 1 and part[0][0] in self._solo)
            except Exception:
                self._failed_part = [name for name, _ in part]
                raise

    def _learn_part(self, batch: list[tuple[str, torch.Tensor]], *, alone: bool) -> None:
        state = _state(self._model)
        recorder = _Recorder(state, batch)
        with recorder:
            loaded = self._load_weights(batch)
        skipped = (
            {name for name, _ in batch} - set(loaded)
            if isinstance(loaded, set | frozenset | list | tuple)
            else set()
        )
        if recorder.batch_unplannable is not None and not alone:
            self._solo.update(name for name, _ in batch)  # isolate the culprit next time
            logger.info(
                "load plan: a load in a batch of %d wrote the model unattributably (%s); its"
                " names are learned one at a time next push", len(batch),
                recorder.batch_unplannable,
            )
            return
        for name, tensor in batch:
            reason = recorder.unplannable.get(name) or recorder.batch_unplannable
            if reason is None and not recorder.copies.get(name) and name not in skipped:
                reason = "its load copied nothing into the model"
            if reason is not None:
                if len(self._unplannable) < 10_000:
                    self._unplannable[name] = reason
                logger.info("load plan: %s stays with load_weights (%s)", name, reason)
                continue
            self.generation += 1
            self._entries[name] = _Entry(  # no copies: the model skips it (a tied alias)
                dtype=tensor.dtype,
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                copies=tuple(recorder.copies.get(name, ())),
            )


def _whole_matches(entry: _Entry, dtype: torch.dtype, part: Part) -> bool:
    return (
        entry.dtype == dtype
        and entry.shape == tuple(part.whole)
        and entry.stride == _contiguous_strides(entry.shape)
    )


def _read_columns(entry: _Entry) -> tuple[int, ...]:
    """``(first, end)``: the columns of the whole tensor's rows (``shape[0]`` rows) that every
    copy of ``entry`` stays within, where they all read runs within rows or row-major blocks
    of rows, and not every column; else ``()``."""
    if len(entry.shape) < 2:
        return ()
    row, count = math.prod(entry.shape[1:]), math.prod(entry.shape)
    rows = Part(whole=entry.shape, offset=0, columns=(0, row))  # every column: the whole
    first, end = row, 0
    for copy in entry.copies:
        if not all(copy.size):
            continue
        if rows.source_view(copy.size, copy.stride, copy.offset, count) is None:
            return ()
        left = copy.offset % row
        first, end = min(first, left), max(end, left + copy.size[-1])
    return (first, end) if 0 < end - first < row else ()


def _read_range(copies: Sequence[_Copy]) -> tuple[int, int]:
    """[first, end) of the elements of the pushed tensor that ``copies`` read (empty: (0, 0))."""
    first, end = None, 0
    for copy in copies:
        if not all(copy.size):
            continue
        span = sum((n - 1) * s for n, s in zip(copy.size, copy.stride, strict=True)) + 1
        first = copy.offset if first is None else min(first, copy.offset)
        end = max(end, copy.offset + span)
    return (0, 0) if first is None else (first, end)


def _matches(entry: _Entry, tensor: torch.Tensor) -> bool:
    return (
        tensor.dtype == entry.dtype
        and tuple(tensor.shape) == entry.shape
        and tuple(tensor.stride()) == entry.stride
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]


_registrations = [0]
"""Modules, parameters and buffers registered anywhere in this process (torch's global
registration hooks count them, once ``_count_registrations`` installed them)."""


def _count_registrations() -> None:
    if _registrations[0]:
        return

    def registered(*_: object) -> None:
        _registrations[0] += 1

    _registrations[0] = 1
    torch.nn.modules.module.register_module_parameter_registration_hook(registered)
    torch.nn.modules.module.register_module_buffer_registration_hook(registered)
    torch.nn.modules.module.register_module_module_registration_hook(registered)


class _Walk:
    """The model's parameters and buffers from one walk of its modules, and a check that the
    walk still holds that costs a tenth of walking again (a vLLM 7B model's walk took about 2
    ms of every push): nothing was registered since (a module, parameter or buffer added or
    replaced anywhere), each owner still has the tables of parameters and buffers it had (not
    replaced whole), and each tensor is still in its owner's table (not deleted, not replaced
    there behind the hooks). The tables are read directly: through ``getattr``
    (``Module.__getattr__``) the check of 340 tensors took 0.2-0.4 ms of every push."""

    def __init__(self, model: torch.nn.Module) -> None:
        _count_registrations()
        self.generation = _registrations[0]
        named = [
            *((name, tensor, "_parameters") for name, tensor in model.named_parameters()),
            *((name, tensor, "_buffers") for name, tensor in model.named_buffers()),
        ]
        self.tensors = [tensor for _, tensor, _ in named]
        self._tables: list[dict[str, Any]] = []
        self._attributes: list[str] = []
        owned: dict[tuple[int, str], tuple[torch.nn.Module, str, dict[str, Any]]] = {}
        for name, _, kind in named:
            prefix, _, attribute = name.rpartition(".")
            owner = model.get_submodule(prefix)
            table = getattr(owner, kind)
            self._tables.append(table)
            self._attributes.append(attribute)
            owned[id(owner), kind] = (owner, kind, table)
        self._owners = [owner for owner, _, _ in owned.values()]
        self._kinds = [kind for _, kind, _ in owned.values()]
        self._owned_tables = [table for _, _, table in owned.values()]

    def holds(self) -> bool:
        return (
            self.generation == _registrations[0]
            and all(map(operator.is_, map(getattr, self._owners, self._kinds), self._owned_tables))
            and all(map(operator.is_, map(dict.get, self._tables, self._attributes), self.tensors))
        )


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory a strided tensor reads."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    if any(s < 0 for s in tensor.stride()):
        return start, -1  # never inside a pushed tensor's extent
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    return start, start + span * tensor.element_size()


def _disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """No two of ``tensors`` share a byte of memory (judged by their extents)."""
    extents = sorted(_extent(t) for t in tensors if t.numel())
    if any(end < start for start, end in extents):  # a negative stride
        return False
    return all(b[0] >= a[1] for a, b in itertools.pairwise(extents))


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return str(tensor.device), storage.data_ptr()


def _in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "").split(".")[0]  # aten overloads: "copy_.default"
    return name in ("__setitem__", "__set__") or name.startswith("__i") or (
        name.endswith("_") and not name.startswith("__")
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


class _Recorder(TorchFunctionMode):
    """Watches one ``load_weights`` call: records copies into the model's tensors."""

    def __init__(self, state: Iterable[torch.Tensor], batch: Sequence[tuple[str, torch.Tensor]]):
        super().__init__()
        self._model_storages = {_storage_key(t) for t in state}
        ranges = sorted(
            (_extent(tensor), name, tensor) for name, tensor in batch if tensor.numel()
        )
        self._starts = [start for (start, _end), _, _ in ranges]
        self._ranges = ranges
        self.copies: dict[str, list[_Copy]] = {}
        self.unplannable: dict[str, str] = {}
        self.batch_unplannable: str | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        try:
            self._watch(func, args, kwargs)
        except Exception as exc:  # never break the load itself: just do not plan this batch
            self.batch_unplannable = f"the load plan could not follow it ({exc!r})"
        return result

    def _watch(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        what = getattr(func, "__name__", str(func))
        if any(self._is_model(t) for t in _tensors(kwargs.get("out"))):
            self.batch_unplannable = f"{what}(out=) into the model"
            return
        if not args or not _in_place(func):
            return
        targets = [t for t in _tensors(args[0]) if t.numel()]  # e.g. zeroing padding of none
        if what.split(".")[0] == "copy_" and len(args) > 1 and isinstance(args[0], torch.Tensor):
            source = args[1]
            if isinstance(source, torch.Tensor) and targets:
                self._on_copy(targets[0], source)
                return
        if any(self._is_model(t) for t in targets):
            self.batch_unplannable = f"{what} on a model tensor"

    def _on_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        owner = self._owner(src)
        into_model = self._is_model(dst)
        if owner is None:
            if into_model:  # from a temporary: the loader computed something
                self.batch_unplannable = "a copy into the model from a tensor not pushed"
            return
        name, pushed = owner
        if not into_model:
            self.unplannable[name] = "its bytes were copied outside the model's tensors"
        elif src.dtype != pushed.dtype:
            self.unplannable[name] = f"its loader viewed it as {src.dtype}"
        elif dst.device != src.device:
            self.unplannable[name] = "its loader copies across devices"
        else:
            delta = src.data_ptr() - pushed.data_ptr()
            if delta % src.element_size():
                self.unplannable[name] = "its loader read it at an unaligned offset"
                return
            self.copies.setdefault(name, []).append(
                _Copy(
                    dst=dst.detach(),
                    size=tuple(src.shape),
                    stride=tuple(src.stride()),
                    offset=delta // src.element_size(),
                )
            )

    def _is_model(self, tensor: torch.Tensor) -> bool:
        return _storage_key(tensor) in self._model_storages

    def _owner(self, src: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The pushed tensor ``src`` is a view of (its whole extent inside that tensor's)."""
        start, end = _extent(src)
        index = bisect.bisect_right(self._starts, start) - 1
        if index < 0 or end < 0:
            return None
        (lo, hi), name, tensor = self._ranges[index]
        if lo <= start and end <= hi and src.device == tensor.device:
            return name, tensor
        return None
