"""Inside each vLLM worker: adapter revisions pushed by asyncroll, served by vLLM's LoRA.

A pushed revision is registered with the worker's LoRA manager under its revision id, between
two engine steps (the RPC runs there), without a file or a pause. vLLM then serves it as any
LoRA: a request names it with a ``LoRARequest`` of the same id. The worker keeps each
revision's tensors (``RevisionStore``) until asyncroll drops it, and answers vLLM's own load of
a revision it evicted from its caches from them, never from the (made-up) path.

Two ways in, the same bytes in the slot:

- ``vllm``: a ``LoRAModel`` built from the tensors, registered, and moved into a free device
  slot by vLLM's own activation (for a 7B rank-64 adapter about 600 small copies and zero
  fills, and the Python around each). The first revision of a layout to reach a slot goes this
  way, and every write vLLM makes to the slot's tensors is recorded (``SlotWrites``).
- ``replayed``: a later revision of the same layout, bound for a slot already recorded, is
  written there by replaying the recording from its own tensors: one batched zero, one batched
  copy and one batched scale (vLLM folds ``alpha / rank`` into B), in place of vLLM's loop.
  vLLM's book-keeping (which slot holds which id, its LRU order) is still vLLM's own: its
  activation runs with no module to write. The manager registers a stand-in ``LoRAModel``
  with no weights; should vLLM ever activate the revision again itself (after evicting it
  from its slot), the real one is built from the kept tensors first.

Invariants:
- a revision is registered whole or not at all: the tensors are received and checked first
  (``asyncroll.receive.adapter``), then written, and only then named in a step's mapping;
  a push that fails leaves every served revision as it was;
- nothing served is written in place: a new revision takes a free slot, never a busy one;
- a replay writes exactly what vLLM's activation wrote: a recording that holds anything else
  (an op other than a copy or a zero fill, a copy from memory that is not the revision's own
  tensors, a fill after a copy into the same tensor) is refused, and that layout keeps
  vLLM's own way.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncroll.adapters import LAYOUTS_KEPT, Placement, unpack_adapter
from asyncroll.receive.adapter import AdapterTake, Landing

__all__ = ["RevisionStore", "SlotWrites", "store_of"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten

LANDINGS_FREE = 2
"""Landings kept free per layout: a push drops the oldest revision before it receives the next
(one free), and a retried push of a revision drops it again (two)."""

Source = tuple[str, int] | tuple[str, tuple[int, ...], tuple[int, ...], int]
"""Where a recorded copy reads: (chunk, index) for a whole tensor copied flat (the index-th of
its chunk, ``split_adapter``), else (chunk, size, stride, first element in the chunk)."""


def store_of(worker: Any) -> RevisionStore | None:
    """The worker's store of revisions (made on first use); None: LoRA is not enabled."""
    store = getattr(worker, "_asyncroll_revisions", None)
    if store is None:
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None or getattr(worker.vllm_config, "lora_config", None) is None:
            return None
        store = worker._asyncroll_revisions = RevisionStore(worker, manager)
    return store


@dataclass(slots=True)
class _Held:
    chunks: dict[str, torch.Tensor]
    layout: tuple[Placement, ...]
    config: dict[str, Any]
    landing: Landing | None = None
    """The memory ``chunks`` lie in, handed on when the revision is dropped."""


class RevisionStore:
    """The revisions asyncroll pushed to one worker, and their registration with vLLM."""

    def __init__(self, worker: Any, manager: Any) -> None:
        self._worker = worker
        self._manager = manager
        """vLLM's ``LRUCacheWorkerLoRAManager``."""
        self._held: dict[int, _Held] = {}
        self._writes: dict[tuple[tuple[Placement, ...], int], SlotWrites | None] = {}
        """(layout, slot) -> what vLLM's activation wrote there (None: not replayable, or a
        replay failed there: vLLM activates each revision of that layout into that slot)."""
        self._stand_ins: set[int] = set()
        """Revisions registered with a weightless ``LoRAModel`` (written by a replay)."""
        self.seconds: dict[str, float] = {}
        """Where the last ``add`` went (benchmarks)."""
        self._landings: collections.OrderedDict[tuple[Placement, ...], list[Landing]] = (
            collections.OrderedDict()
        )
        """Landings no revision holds, by layout (the layouts used last at the end)."""
        self._lent: set[int] = set()
        """``id`` of each landing handed out and not yet back."""
        self._keeping: set[int] = set()
        """``id`` of each landing an ``add(keep_on_failure=True)`` in progress keeps lent."""
        self.landings_made = 0
        """Landings made so far (the rest of the revisions landed in a dropped one's)."""
        self._landings_lock = threading.Lock()
        """``landing`` and ``release`` are called from the worker's landing thread as well
        (``asyncroll.receive.adapter.Landings``)."""
        vllms_load = manager._load_adapter

        def load(lora_request: Any) -> Any:
            held = self._held.get(lora_request.lora_int_id)
            if held is None and str(lora_request.lora_path).startswith("asyncroll://"):
                raise RuntimeError(  # not vLLM's "no such folder" about a made-up path
                    f"LoRA revision {lora_request.lora_name} was dropped while a request still"
                    " named it (the manager drops only revisions no call is pinned to)"
                )
            if held is None:
                return vllms_load(lora_request)
            self._stand_ins.discard(lora_request.lora_int_id)
            return self._build(lora_request.lora_int_id, held)[0]

        manager._load_adapter = load  # a revision vLLM evicted comes back from memory
        adapters = manager._adapter_manager
        self._activate = adapters.activate_adapter
        """vLLM's own activation (the manager's is wrapped: ``_activated``)."""
        adapters.activate_adapter = self._activated

    def layout(self) -> dict[str, Any]:
        """What this worker's LoRA serves (``asyncroll.adapters.AdapterLayout``)."""
        lora_config = self._manager.lora_config
        adapters = self._manager._adapter_manager
        packed = adapters.packed_modules_mapping
        modules: set[str] = set()
        for module in adapters.supported_lora_modules:
            modules.update(packed.get(module, [module]))
        return {
            "max_rank": int(lora_config.max_lora_rank),
            "slots": int(lora_config.max_loras),
            "resident": int(lora_config.max_cpu_loras or lora_config.max_loras),
            "modules": sorted(modules),
        }

    def landing(self, layout: tuple[Placement, ...]) -> Landing:
        """Memory to receive a revision of ``layout`` into: a dropped revision's, where one is
        free (its views made already), else new. It is the revision's once ``add`` takes it;
        until then ``release`` gives it back."""
        with self._landings_lock:
            free = self._landings.get(layout)
            if free:
                landing = free.pop()
            else:
                landing = Landing(layout)
                self.landings_made += 1
            if layout in self._landings:
                self._landings.move_to_end(layout)
            self._lent.add(id(landing))
            return landing

    def release(self, landing: Landing | None) -> None:
        """Take back a landing no revision holds (idempotent). The device may still be
        copying out of it: the next revision's copies into it queue behind on the same
        stream (the worker's step and its RPCs run on one thread; the landing thread's copies
        wait for those queued here until now: ``Landing.freed``)."""
        if landing is None:
            return
        with self._landings_lock:
            if id(landing) not in self._lent or id(landing) in self._keeping:
                return
            if any(held.landing is landing for held in list(self._held.values())):
                return  # a registered revision's memory: back when that revision is dropped
            landing.freed()
            self._lent.discard(id(landing))
            free = self._landings.setdefault(landing.layout, [])
            self._landings.move_to_end(landing.layout)
            if len(free) < LANDINGS_FREE:
                free.append(landing)
            while len(self._landings) > LAYOUTS_KEPT:
                self._landings.popitem(last=False)

    def memory(self) -> dict[int, list[int]]:
        """Where each held revision's chunks lie (device addresses; tests)."""
        return {
            revision: sorted(t.data_ptr() for t in held.chunks.values())
            for revision, held in self._held.items()
        }

    def add(
        self, revision: int, take: AdapterTake, config: dict[str, Any], *,
        keep_on_failure: bool = False,
    ) -> str:
        """Register a revision and, if a device slot is free, write it there (replayed where
        this layout was recorded in that slot before, else by vLLM). A failure registers
        nothing; with ``keep_on_failure`` the revision is still kept as it landed, its
        memory never lent meanwhile (vLLM builds it from there when a step first needs it,
        as for one it evicted). Returns how: ``replayed`` or ``vllm``."""
        if not keep_on_failure:
            return self._add(revision, take, config)
        landing = id(take.landing) if take.landing is not None else None
        with self._landings_lock:
            if landing is not None:
                self._keeping.add(landing)
        try:
            return self._add(revision, take, config)
        except BaseException:
            self._held[revision] = _Held(take.chunks, take.layout, dict(config), take.landing)
            raise
        finally:
            with self._landings_lock:
                self._keeping.discard(landing)

    def _add(self, revision: int, take: AdapterTake, config: dict[str, Any]) -> str:
        held = _Held(take.chunks, take.layout, dict(config), take.landing)
        peft = self._peft(config)  # validated before anything changes
        adapters = self._manager._adapter_manager
        with _sync_allowed():
            self.drop(revision)  # a retried push of the same revision
            if len(adapters) >= adapters.capacity:
                # As vLLM's own add does: its least recent LoRA goes (between two steps, so
                # no forward pass is using it); a revision of ours comes back from memory
                # when a step needs it again (``__init__``).
                adapters.remove_oldest_adapter()
            slot = self._next_slot(adapters)
            key = (held.layout, slot if slot is not None else -1)
            # vLLM 0.32 reads per-module ranks and scales (PEFT's patterns): a replay scales
            # by one; asyncroll's AdapterConfig sets none.
            uniform = not config.get("rank_pattern") and not config.get("alpha_pattern")
            writes = self._writes.get(key) if slot is not None and uniform else None
            if writes is not None:
                from vllm.lora.lora_model import LoRAModel

                # Registered as vLLM's add does, less the packing of its (absent) weights.
                adapters._registered_adapters[revision] = LoRAModel(revision, peft.r, {})
                self._stand_ins.add(revision)
                self._held[revision] = held
                try:
                    began = time.perf_counter()
                    self._bookkeeping(revision)
                    if adapters.lora_index_to_id.index(revision) != slot:
                        raise RuntimeError(f"vLLM put revision {revision} elsewhere than {slot}")
                    booked = time.perf_counter()
                    writes.replay(held.chunks, take.pieces, peft.vllm_lora_scaling_factor,
                                  held.landing)
                    self.seconds = {"bookkeeping": booked - began,
                                    "replay": time.perf_counter() - booked}
                except BaseException:
                    self.drop(revision)
                    self._writes[key] = None  # vLLM's own way from now on
                    raise
                return "replayed"
            began = time.perf_counter()
            lora, scratch = self._build(revision, held, peft)
            adapters.add_adapter(lora)
            self._held[revision] = held
            built = time.perf_counter()
            if slot is not None:  # a step would do it; this is between steps
                record = uniform and key not in self._writes  # (None: refused before)
                try:
                    if record:
                        with _Recording(scratch, held.layout) as recording:
                            self._activate(revision)
                    else:
                        self._activate(revision)
                except BaseException:
                    self.drop(revision)
                    raise
                if record:
                    where = adapters.lora_index_to_id.index(revision)
                    self._writes[(held.layout, where)] = recording.writes()
            self.seconds = {"build": built - began, "activate": time.perf_counter() - built}
            return "vllm"

    def drop(self, revision: int) -> bool:
        """Forget a revision; True if it was held."""
        with _sync_allowed():  # vLLM's first: should it fail, the revision is still ours
            self._manager.remove_adapter(revision)
        held = self._held.pop(revision, None)
        self._stand_ins.discard(revision)
        if held is not None:
            self.release(held.landing)
        return held is not None

    def _activated(self, lora_id: int) -> Any:
        """vLLM activates a LoRA (a step needs it): a stand-in becomes the real ``LoRAModel``
        first (its slot was given to another LoRA since the replay)."""
        adapters = self._manager._adapter_manager
        if lora_id in self._stand_ins and lora_id not in adapters._active_adapters:
            held = self._held[lora_id]
            adapters._add_adapter(self._build(lora_id, held)[0])
            self._stand_ins.discard(lora_id)
        return self._activate(lora_id)

    def _next_slot(self, adapters: Any) -> int | None:
        """The slot vLLM's activation would take now: the first free one (None: none is;
        vLLM moves the revision into one when a step needs it)."""
        try:
            return int(adapters.lora_index_to_id.index(None))
        except ValueError:
            return None

    def _bookkeeping(self, revision: int) -> None:
        """vLLM's activation of ``revision`` with no module to write: its slot, its LRU."""
        adapters = self._manager._adapter_manager
        modules, adapters.modules = adapters.modules, {}
        try:
            self._activate(revision)
        finally:
            adapters.modules = modules

    def _peft(self, config: Mapping[str, Any]) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        peft = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": self._manager.max_position_embeddings}
        )
        peft.validate_legal(self._manager.lora_config)
        return peft

    def _build(
        self, revision: int, held: _Held, peft: Any = None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """vLLM's ``LoRAModel`` of a revision, and the chunks it was built from: a copy of
        the kept ones in vLLM's LoRA dtype (vLLM folds alpha / rank into B in place; what the
        store keeps stays unscaled for a rebuild, and is never scaled twice; and vLLM copies
        from the chunks themselves, which a recording needs)."""
        from vllm.lora.lora_model import LoRAModel

        manager = self._manager
        peft = peft if peft is not None else self._peft(held.config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "get_rename_mapper"):
            mapper = mapper.get_rename_mapper()
        dtype = manager.lora_config.lora_dtype
        dtype = dtype if isinstance(dtype, torch.dtype) else None
        scratch = {name: chunk.to(dtype=dtype, copy=True) for name, chunk in held.chunks.items()}
        device = next(iter(scratch.values())).device
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=revision,
            tensors=unpack_adapter(scratch, held.layout),
            peft_helper=peft,
            device=str(device),
            dtype=dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        return lora, scratch


class SlotWrites:
    """What vLLM's activation of one revision wrote into one LoRA slot, as a replay: the
    slot regions it zero-filled, each region it copied into and from where in the revision's
    chunks, and which of those hold B (vLLM folds ``alpha / rank`` into B before it copies)."""

    def __init__(
        self,
        zeros: list[torch.Tensor],
        targets: list[torch.Tensor],
        sources: list[Source],
        scaled: list[torch.Tensor],
    ) -> None:
        covered = {(t.data_ptr(), t.numel()) for t in targets if t.is_contiguous()}
        self.zeros = [z for z in zeros if not (
            z.is_contiguous() and (z.data_ptr(), z.numel()) in covered
        )]
        """The zero fills a copy does not overwrite whole (none where the rank is the
        slots' own: then vLLM zeroes bytes it copies over at once)."""
        self.targets = targets
        self.sources = sources
        """Each copy's source (``Source``)."""
        self.scaled = scaled

    def __len__(self) -> int:
        return len(self.targets)

    def replay(
        self, chunks: Mapping[str, torch.Tensor],
        pieces: Mapping[str, tuple[torch.Tensor, ...]], scaling: float,
        landing: Landing | None = None,
    ) -> None:
        """Write a revision of the recorded layout (its ``chunks``, and their ``pieces``:
        ``split_adapter``) into the slot, as vLLM would, in three batched ops. ``landing``:
        the chunks are that landing's, which keeps the views read (made once)."""
        with torch.no_grad():
            if self.zeros:
                torch._foreach_zero_(self.zeros)
            if landing is not None and any(
                landing.chunks.get(name) is not chunk for name, chunk in chunks.items()
            ):
                landing = None  # not the landing's chunks: its views read other memory
            sources = landing.sources.get(self) if landing is not None else None
            if sources is None:
                sources = [
                    pieces[source[0]][source[1]] if len(source) == 2
                    else chunks[source[0]].as_strided(
                        source[1], source[2], chunks[source[0]].storage_offset() + source[3])
                    for source in self.sources
                ]
                if landing is not None:
                    landing.sources[self] = sources
            torch._foreach_copy_(self.targets, sources, non_blocking=True)
            if self.scaled and scaling != 1:
                torch._foreach_mul_(self.scaled, scaling)


class _Recording(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the writes an activation makes (``SlotWrites``), or why they cannot be
    replayed. ``scratch``: the chunks the activated ``LoRAModel`` was built from."""

    def __init__(self, scratch: Mapping[str, torch.Tensor], layout: tuple[Placement, ...]):
        super().__init__()  # type: ignore[no-untyped-call]
        self._chunks = {t.untyped_storage().data_ptr(): name for name, t in scratch.items()}
        self._b: dict[str, tuple[list[int], list[int]]] = {}
        """chunk -> (first elements, ends) of its B tensors, in order."""
        self._whole: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
        """(chunk, first element) -> the index in its chunk of the tensor that starts there,
        and its shape."""
        counts: dict[str, int] = {}
        for name, chunk, first, shape in layout:
            self._whole[(chunk, first)] = (counts.get(chunk, 0), tuple(shape))
            counts[chunk] = counts.get(chunk, 0) + 1
            if ".lora_B." in name:
                n = 1
                for dim in shape:
                    n *= dim
                firsts, ends = self._b.setdefault(chunk, ([], []))
                firsts.append(first)
                ends.append(first + n)
        self.zeros: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.sources: list[Source] = []
        self.scaled: list[torch.Tensor] = []
        self.refused = ""
        self._copied_into: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.refused:
            return out
        packet = func._overloadpacket
        if packet is aten.copy_:
            self._copy(args[0], args[1])
        elif packet is aten.zero_ or (packet is aten.fill_ and _is_zero(args[1])):
            target = args[0]
            if target.untyped_storage().data_ptr() in self._copied_into:
                self.refused = "a fill after a copy into the same tensor"
            self.zeros.append(target)
        elif func._schema.is_mutable:
            self.refused = f"{func} writes"
        return out

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        chunk = self._chunks.get(source.untyped_storage().data_ptr())
        if chunk is None:
            self.refused = "a copy from memory other than the revision's tensors"
            return
        if source.dtype != target.dtype or source.device != target.device:
            self.refused = f"a copy that converts ({source.dtype} to {target.dtype})"
            return
        first = int(source.storage_offset())
        whole = self._whole.get((chunk, first))
        if (
            whole is not None and whole[1] == tuple(source.shape) and source.is_contiguous()
            and target.is_contiguous() and target.numel() == source.numel()
        ):  # flat into flat: the chunk's own split gives the source
            target = target.view(-1)
            self.sources.append((chunk, whole[0]))
        else:
            self.sources.append((chunk, tuple(source.shape), tuple(source.stride()), first))
        self.targets.append(target)
        self._copied_into.add(target.untyped_storage().data_ptr())
        firsts, ends = self._b.get(chunk, ([], []))
        at = bisect.bisect_right(firsts, first) - 1
        if at >= 0 and first < ends[at]:
            self.scaled.append(target)

    def writes(self) -> SlotWrites | None:
        if self.refused or not self.targets:
            logger.info("LoRA slot writes not replayable (%s): vLLM activates each revision",
                        self.refused or "no copy")
            return None
        return SlotWrites(self.zeros, self.targets, self.sources, self.scaled)

    def __enter__(self) -> _Recording:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self


def _is_zero(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.item() == 0)
    return bool(value == 0)


def _sync_allowed() -> contextlib.AbstractContextManager[Any]:
    """vLLM 0.32's guard that allows a device sync here (its debug mode flags others)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # vLLM 0.24
        return contextlib.nullcontext()
    return gpu_sync_allowed()  # type: ignore[no-any-return]


