"""LoRA adapters pushed through asyncroll's transport, served by revision (no engine pause).

An adapter update makes a new *revision* of the adapter: a LoRA of its own in every engine
(vLLM's ``lora_int_id``), added between two engine steps next to the revisions already there.
Nothing is overwritten in place, so no forward pass can see half an update, and no engine is
paused. The manager (``AsyncServerManager.update_adapter``) owns the revisions:

- a call made with ``adapter=name`` starts on that adapter's newest revision and keeps it to
  its end, through every resume (it is *pinned* to it); its tokens carry that revision's
  ``global_steps``;
- every engine holds at most ``resident`` revisions (vLLM's ``max_cpu_loras``, set by the user:
  at least the number of adapters plus the staleness allowed); a revision is dropped only when
  no live call is pinned to it, superseded ones first;
- an update that would need to drop a pinned revision waits for its calls to end (they run
  on: the newest revision takes the new calls), and says how long it waited;
- each revision has a name of its own in vLLM (``name@revision``), so vLLM's prefix cache,
  keyed by the LoRA's name, never serves one revision's KV to another.

An adapter travels packed (``pack_adapter``): its tensors joined into one flat tensor per dtype,
with a layout saying where each lies. A rank-64 adapter of a 7B model is 392 small matrices; one
tensor a push, not one a matrix, keeps every per-tensor cost (a view, a fingerprint's sample, a
message entry, a copy) off the update, on both sides. Each matrix is still fingerprinted on its
own (``asyncroll.fingerprints.packed_fingerprints``), so the check proves what it proved before.

This module is pure (torch only): the tensors' names and shapes checked against what an engine
serves (``AdapterLayout``), the packing, and the revision table (``Revisions``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

from asyncroll.errors import InvalidRequestError, WeightSyncError
from asyncroll.update_check import nonfinite

if TYPE_CHECKING:
    from asyncroll.interfaces import Delivery
    from asyncroll.transport import PushReport

__all__ = [
    "AdapterConfig",
    "AdapterLayout",
    "AdapterPlan",
    "AdapterPlans",
    "AdapterReport",
    "LAYOUTS_KEPT",
    "LAYOUTS_SENT",
    "AdapterRevision",
    "PackedAdapter",
    "Placement",
    "Revisions",
    "adapter_tensors",
    "check_adapter",
    "check_adapter_name",
    "check_finite",
    "decoder_shapes",
    "layout_key",
    "pack_adapter",
    "pack_finite",
    "placements",
    "split_adapter",
    "unpack_adapter",
]

_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
"""A PEFT LoRA tensor: ``base_model.model.<module>.lora_A.weight`` (the prefix and PEFT's
adapter name, ``lora_A.default.weight``, optional)."""
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_revision_ids = itertools.count(1 << 20)
"""vLLM's own dummy LoRAs (its warm-up, CUDA-graph capture) take ids from 1 up: ours start far
above them."""
LAYOUTS_SENT = 8
"""Layouts an engine's port remembers having sent (the most recently used): a push of one of
them names it by its key alone."""
LAYOUTS_KEPT = 32
"""Layouts a worker keeps (the most recently named). More than the port remembers, so that a
layout the port names by key alone is still there, whatever pushes failed in between."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """A LoRA adapter's shape: its rank, its scale (``alpha / rank``), the modules it covers.

    Args:
        rank: Rows of every ``lora_A`` (columns of every ``lora_B``).
        alpha: PEFT's ``lora_alpha``; the update is ``B @ A * alpha / rank``.
    """

    rank: int
    alpha: float

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidRequestError(f"rank must be an int of at least 1, not {self.rank!r}")
        if (
            isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float)
            or not math.isfinite(self.alpha) or self.alpha <= 0
        ):
            raise InvalidRequestError(f"alpha must be a positive number, not {self.alpha!r}")

    def peft_config(self, names: Iterable[str]) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` for the tensors of these (PEFT) names."""
        modules = {_module_leaf(name) for name in names}
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted(modules),
            "bias": "none",
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRevision:
    """One pushed version of one adapter, as every engine serves it."""

    adapter: str
    revision: int
    """vLLM's ``lora_int_id``: unique in this process, so across every engine it feeds."""
    global_steps: int | None
    """The trainer step the revision's tensors come from: it labels every token sampled
    under it."""

    @property
    def lora_name(self) -> str:
        """vLLM's name for it, unique per revision (vLLM keys its prefix cache by it)."""
        return f"{self.adapter}@{self.revision}"

    @property
    def lora_path(self) -> str:
        """Not a path: vLLM wants one; asyncroll's workers serve the revision from memory."""
        return f"asyncroll://{self.adapter}/{self.revision}"

    @classmethod
    def next(cls, adapter: str, global_steps: int | None) -> AdapterRevision:
        return cls(adapter=adapter, revision=next(_revision_ids), global_steps=global_steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterLayout:
    """What an engine's LoRA serves (read once from its workers and its checkpoint)."""

    max_rank: int
    """vLLM's ``max_lora_rank``."""
    slots: int
    """vLLM's ``max_loras``: distinct revisions in one step."""
    resident: int
    """vLLM's ``max_cpu_loras``: revisions an engine holds."""
    modules: frozenset[str]
    """Leaf names of the modules the engine's LoRA covers (``q_proj``, ``down_proj``...)."""
    shapes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Module path (``model.layers.0.self_attn.q_proj``) -> its weight's (out, in)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterReport:
    """One adapter update, pushed to every live engine."""

    revision: AdapterRevision
    engines: int
    seconds: float
    """From the call to the last engine holding the revision (not counting a wait for another
    update to end)."""
    waited_seconds: float
    """Spent waiting for room: every revision that could go was pinned by a live call."""
    push_seconds: float
    check_seconds: float = 0.0
    """Checking the tensors against the engines' LoRA (ranks, modules, shapes; each engine's
    LoRA layout, asked once) and the revisions they hold, before the pack. (The names are
    checked before: ``seconds`` counts them.)"""
    pack_seconds: float = 0.0
    """Checking every value finite and packing them (``pack_adapter``). A layout's later
    pushes write its pack while the takes travel to the engines: this counts that time,
    which the whole (``seconds``) hides."""
    dropped: tuple[int, ...]
    """Revisions dropped to make room (superseded ones no call used any more)."""
    tensors: int
    bytes: int
    push: PushReport | None
    deliveries: Mapping[str, Delivery] = field(default_factory=dict)
    stamps: Mapping[str, float] = field(default_factory=dict)
    """When the update reached each of its points (``time.perf_counter()``, one clock for the
    host's processes; benchmarks line them up with the sender's and the workers'):
    ``checked`` (the checks against the engines), ``packed`` (a layout's first push packed
    and checked finite), ``take left`` (every engine's take on its way), ``filling`` and
    ``filled`` (a later push's pack written and checked finite, meanwhile), ``printed`` (the
    fingerprints taken)."""

    @property
    def pause_seconds(self) -> float:
        """No engine pauses for an adapter (as ``UpdateReport.pause_seconds``)."""
        return 0.0


def adapter_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The tensors under PEFT's names (``base_model.model.<module>.lora_A.weight``): a PEFT
    state dict, or names without the ``base_model.model.`` prefix.

    Raises:
        InvalidRequestError: a name that is no LoRA tensor, one given twice, a tensor that is
            not a floating matrix, or a module with an A and no B (or the reverse).
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, set[str]] = {}
    for name, tensor in items:
        parsed = _parsed(name) if isinstance(name, str) else None
        if parsed is None:
            raise InvalidRequestError(
                f"{name!r} is not a LoRA tensor (want <module>.lora_A.weight or"
                " <module>.lora_B.weight, PEFT's names)"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise InvalidRequestError(f"{name!r}: a LoRA tensor is a 2-d torch.Tensor")
        if not tensor.is_floating_point():
            raise InvalidRequestError(f"{name!r}: dtype {tensor.dtype} is not floating point")
        peft, module, half = parsed
        if peft in out:
            raise InvalidRequestError(f"{name!r}: {module}'s lora_{half} is given twice")
        out[peft] = tensor  # (packed under no_grad: nothing of autograd travels)
        halves.setdefault(module, set()).add(half)
    if not out:
        raise InvalidRequestError("no adapter tensors to push")
    lonely = sorted(m for m, h in halves.items() if h != {"A", "B"})
    if lonely:
        raise InvalidRequestError(f"modules with only one of lora_A, lora_B: {lonely[:4]}")
    return out


Placement = tuple[str, str, int, tuple[int, ...]]
"""Where one tensor of a packed adapter lies: (its name, its chunk, its first element there,
its shape)."""


FILL_ON_LOOP_BYTES: Final = 1 << 20
"""A host pack smaller than this is written on the loop (``PackedAdapter.fills_on_loop``)."""


@dataclass(frozen=True, slots=True)
class PackedAdapter:
    """An adapter as it travels: one flat tensor (a *chunk*) per dtype, and where each of its
    tensors lies in them (``pack_adapter``; ``unpack_adapter`` gives the tensors back)."""

    chunks: dict[str, torch.Tensor]
    """Chunk name (``asyncroll.adapter.<dtype>``) -> a 1-d tensor."""
    layout: tuple[Placement, ...]
    """Each tensor's place, in the order packed (consecutive within a chunk)."""

    @property
    def tensors(self) -> int:
        return len(self.layout)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.chunks.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.chunks.values())).device

    @property
    def fills_on_loop(self) -> bool:
        """Whether a revision is written into this pack on the event loop (a GPU's pack:
        kernel launches and a sync; a host's under ``FILL_ON_LOOP_BYTES``), so that it can
        be written while the takes travel: a larger host copy would hold the loop, or, run
        in a thread, the engines' steps while the takes wait in them."""
        return self.device.type == "cuda" or self.nbytes < FILL_ON_LOOP_BYTES


def pack_adapter(tensors: Mapping[str, torch.Tensor]) -> PackedAdapter:
    """Join ``tensors`` into one flat tensor per dtype (one copy of their bytes, one kernel a
    dtype on a GPU), on their device.

    Raises:
        InvalidRequestError: tensors on more than one device.
    """
    return _plan(tensors).pack(tuple(tensors.values()))


@dataclass(frozen=True, slots=True, eq=False)
class AdapterPlan:
    """What every push of an adapter with the same names, shapes, dtypes and device shares,
    worked out once (``AdapterPlans``): its tensors checked as ``adapter_tensors`` checks them,
    the order they are packed in, the layout and its key, the engines' checks passed."""

    names: tuple[str, ...]
    """PEFT's name of each tensor, in the order given."""
    order: tuple[int, ...]
    """Positions in the order given, in the order packed."""
    chunks: tuple[tuple[str, int], ...]
    """Each chunk's name and how many tensors of ``order`` it takes, in turn."""
    layout: tuple[Placement, ...]
    modules: tuple[str, ...]
    """The leaf names of the modules covered (PEFT's ``target_modules``), sorted."""
    passed: list[tuple[AdapterLayout, int]] = field(default_factory=list)
    """The engine layouts and ranks ``check_adapter`` passed the adapter against."""
    kept: list[PackedAdapter] = field(default_factory=list)
    """The pack ``pack(keep=True)`` writes each revision into (made by the first)."""
    _views: list[torch.Tensor] = field(default_factory=list)
    """Each tensor's place in the kept pack, in ``order``, as a view of its shape."""

    def tensors(self, values: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """PEFT's name -> tensor, from the values in the order given."""
        return dict(zip(self.names, values, strict=True))

    def check(self, values: tuple[torch.Tensor, ...], config: AdapterConfig,
              layout: AdapterLayout, *, engine: str) -> None:
        """``check_adapter``, once per engine layout and rank.

        Raises:
            InvalidRequestError: as ``check_adapter``.
        """
        if any(known is layout and rank == config.rank for known, rank in self.passed):
            return
        check_adapter(self.tensors(values), config, layout, engine=engine)
        self.passed.append((layout, config.rank))

    def pack(self, values: tuple[torch.Tensor, ...], *, keep: bool = False) -> PackedAdapter:
        """``pack_adapter`` of the values (in the order given). ``keep``: into the pack kept
        from the last such call (one batched copy, no allocation), whose tensors this call
        overwrites: for a caller that is done with the last pack (the manager, whose pushes
        run one at a time and are over when they return)."""
        if keep and self.kept:
            with torch.no_grad():
                torch._foreach_copy_(self._views, [values[i] for i in self.order])
            return self.kept[0]
        chunks: dict[str, torch.Tensor] = {}
        at = 0
        with torch.no_grad():
            for chunk, count in self.chunks:
                flats = [values[i].reshape(-1) for i in self.order[at:at + count]]
                chunks[chunk] = torch.cat(flats) if len(flats) > 1 else flats[0].clone()
                at += count
        packed = PackedAdapter(chunks, self.layout)
        if keep and not self.kept:  # the views first: a pack is kept only whole
            self._views[:] = [
                chunks[chunk][first:first + math.prod(shape)].view(shape)
                for _, chunk, first, shape in self.layout
            ]
            self.kept.append(packed)
        return packed

    def pack_finite(
        self, values: tuple[torch.Tensor, ...], *, keep: bool = False
    ) -> PackedAdapter:
        """``pack``, every value checked finite on the way (``pack_finite``).

        Raises:
            InvalidRequestError: names the tensors holding a NaN or an inf.
        """
        packed = self.pack(values, keep=keep)
        if nonfinite(packed.chunks):
            check_finite(self.tensors(values))  # names the tensors at fault
        return packed


def _plan(tensors: Mapping[str, torch.Tensor]) -> AdapterPlan:
    """The plan of an adapter's tensors, by name (``adapter_tensors``).

    Raises:
        InvalidRequestError: tensors on more than one device.
    """
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise InvalidRequestError(
            f"an adapter's tensors are on one device, not on {sorted(map(str, devices))}"
        )
    names = tuple(tensors)  # in the order given
    position = {name: i for i, name in enumerate(names)}
    groups: dict[torch.dtype, list[str]] = {}
    for name in sorted(names):  # one layout whatever order the caller's dict is in
        groups.setdefault(tensors[name].dtype, []).append(name)
    chunks: list[tuple[str, int]] = []
    layout: list[Placement] = []
    for dtype, members in groups.items():
        chunk = f"asyncroll.adapter.{str(dtype).removeprefix('torch.')}"
        offset = 0
        for name in members:
            layout.append((name, chunk, offset, tuple(tensors[name].shape)))
            offset += tensors[name].numel()
        chunks.append((chunk, len(members)))
    return AdapterPlan(
        names=names,
        order=tuple(position[name] for members in groups.values() for name in members),
        chunks=tuple(chunks),
        layout=tuple(layout),
        modules=tuple(sorted({_module_leaf(name) for name in names})),
    )


def _module_leaf(name: str) -> str:
    """``q_proj`` of ``...self_attn.q_proj.lora_A.weight`` (of any name: its last part before
    ``.lora_``)."""
    parsed = _parsed(name)
    module = parsed[1] if parsed is not None else name.rsplit(".lora_", 1)[0]
    return module.rsplit(".", 1)[-1]


class AdapterPlans:
    """The plans of the adapter layouts pushed lately (``LAYOUTS_SENT``, the most recently
    used): a revision of a layout seen before is checked and packed without working out its
    names, order and layout again (a rank-64 adapter of a 7B model is 392 tensors). A plan
    packed with ``keep`` holds its pack (the adapter's size, on its device) until it is
    evicted or ``clear``ed."""

    def __init__(self, kept: int = LAYOUTS_SENT) -> None:
        self._kept = kept
        self._plans: dict[Any, AdapterPlan] = {}

    def clear(self) -> None:
        """Forget every plan (and its kept pack)."""
        self._plans.clear()

    def plan(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> tuple[AdapterPlan, tuple[torch.Tensor, ...]]:
        """The adapter's plan and its tensors, in the order given.

        Raises:
            InvalidRequestError: as ``adapter_tensors``; tensors on more than one device.
        """
        items = tuple(named_tensors.items() if isinstance(named_tensors, Mapping)
                      else named_tensors)
        try:  # what the plan depends on; anything that is not a tensor has no plan
            signature: Any = tuple(
                (name, tensor.dtype, tensor.shape, tensor.device)
                for name, tensor in items if isinstance(tensor, torch.Tensor)
            )
            if len(signature) != len(items):
                signature = None
            hash(signature)
        except (TypeError, ValueError):  # not (name, tensor) pairs, or a name unhashable
            signature = None
        plan = self._plans.pop(signature, None) if signature is not None else None
        if plan is None:
            plan = _plan(adapter_tensors(items))
        if signature is not None:
            self._plans[signature] = plan  # the most recently used last
            while len(self._plans) > self._kept:
                self._plans.pop(next(iter(self._plans)))
        return plan, tuple(tensor for _, tensor in items)


def placements(layout: Iterable[Any]) -> tuple[Placement, ...]:
    """A layout as it arrives over an RPC (lists), as ``Placement`` tuples.

    Raises:
        WeightSyncError: an entry that is no (name, chunk, first element, shape).
    """
    try:
        return tuple(
            (str(name), str(chunk), int(first), tuple(int(d) for d in shape))
            for name, chunk, first, shape in layout
        )
    except (TypeError, ValueError) as exc:
        raise WeightSyncError(f"a malformed adapter layout: {exc}") from exc


def layout_key(layout: tuple[Placement, ...]) -> str:
    """A short name for a layout (the workers keep layouts by it: an adapter's layout
    travels once, not with every push)."""
    return hashlib.blake2b(repr(layout).encode(), digest_size=12).hexdigest()


def pack_finite(tensors: Mapping[str, torch.Tensor]) -> PackedAdapter:
    """``pack_adapter``, every value checked finite on the way (one pass over the chunks).

    Raises:
        InvalidRequestError: names the tensors holding a NaN or an inf; or as
            ``pack_adapter``.
    """
    return _plan(tensors).pack_finite(tuple(tensors.values()))


def split_adapter(
    chunks: Mapping[str, torch.Tensor], layout: tuple[Placement, ...]
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each chunk's tensors, flat (1-d views, in the layout's order: one split a chunk, no
    view a tensor).

    Raises:
        WeightSyncError: a layout that does not tile the chunks exactly (a chunk missing, a
            gap, an overlap, a size that does not add up).
    """
    tiles = _tiles(layout)
    if tiles.keys() != chunks.keys():
        raise WeightSyncError(
            f"the adapter's layout names chunks {sorted(tiles)}, the push delivered"
            f" {sorted(chunks)}"
        )
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for chunk, sizes in tiles.items():
        flat = chunks[chunk]
        if flat.dim() != 1 or sum(sizes) != flat.numel():
            raise WeightSyncError(
                f"{chunk}: {tuple(flat.shape)} delivered, the layout fills {sum(sizes)} elements"
            )
        out[chunk] = torch.split(flat, sizes)
    return out


def unpack_adapter(
    chunks: Mapping[str, torch.Tensor], layout: Iterable[Placement]
) -> dict[str, torch.Tensor]:
    """The tensors of a packed adapter: views of ``chunks`` (no copy), by name.

    Raises:
        WeightSyncError: as ``split_adapter``.
    """
    layout = tuple(layout)
    pieces = split_adapter(chunks, layout)
    at = dict.fromkeys(pieces, 0)
    out: dict[str, torch.Tensor] = {}
    for name, chunk, _, shape in layout:
        out[name] = pieces[chunk][at[chunk]].view(shape)
        at[chunk] += 1
    return out


@functools.lru_cache(maxsize=16)
def _tiles(layout: tuple[Placement, ...]) -> dict[str, list[int]]:
    """Each chunk's tensor sizes, in order, checked to follow one another.

    Raises:
        WeightSyncError: a gap or an overlap.
    """
    tiles: dict[str, list[int]] = {}
    ends: dict[str, int] = {}
    for name, chunk, first, shape in layout:
        if first != ends.get(chunk, 0):
            raise WeightSyncError(
                f"{name}: at element {first} of {chunk}, want {ends.get(chunk, 0)}"
            )
        size = math.prod(shape)
        tiles.setdefault(chunk, []).append(size)
        ends[chunk] = first + size
    return tiles


def check_adapter_name(name: object) -> str:
    """An adapter's name: 1-64 letters, digits and ``_.:-``.

    Raises:
        InvalidRequestError: anything else.
    """
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise InvalidRequestError(
            f"an adapter's name is 1-64 letters, digits and _.:- ; not {name!r}"
        )
    return name


def decoder_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Module path -> (out, in) of every linear layer of a Llama-family decoder (Llama, Qwen2,
    Qwen3, Mistral), from its Hugging Face ``config.json``: for an engine that loaded no
    checkpoint (``load_format="dummy"``). Empty for a config without those fields."""
    try:
        hidden = int(config["hidden_size"])
        inter = int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return {}
    per_layer = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {
        f"model.layers.{i}.{module}": shape
        for i in range(layers) for module, shape in per_layer.items()
    }


@functools.lru_cache(maxsize=1 << 16)
def _parsed(name: str) -> tuple[str, str, str] | None:
    """PEFT's name of a LoRA tensor, its module path and its half (``A`` or ``B``); None if
    ``name`` is no LoRA tensor's. (An adapter's names come back with every push.)"""
    match = _NAME.match(name)
    if match is None:
        return None
    module, half = match["module"], match["ab"]
    return f"base_model.model.{module}.lora_{half}.weight", module, half


def modules_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (lora_A, lora_B), from ``adapter_tensors``'s names."""
    pairs: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = _parsed(name)
        assert parsed is not None, name
        pairs.setdefault(parsed[1], [tensor, tensor])[parsed[2] == "B"] = tensor
    return {module: (a, b) for module, (a, b) in pairs.items()}


def check_adapter(
    tensors: Mapping[str, torch.Tensor], config: AdapterConfig, layout: AdapterLayout,
    *, engine: str,
) -> None:
    """The adapter fits what ``engine`` serves, before anything is sent.

    Raises:
        InvalidRequestError: a rank other than the config's, or above the engine's
            ``max_lora_rank``; a module the engine's LoRA does not cover; a shape that does
            not fit the module's weight. (Values: ``check_finite``.)
    """
    if config.rank > layout.max_rank:
        raise InvalidRequestError(
            f"rank {config.rank} is above {engine}'s max_lora_rank {layout.max_rank}"
        )
    for module, (a, b) in modules_of(tensors).items():
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in layout.modules:
            raise InvalidRequestError(
                f"{module}: {engine}'s LoRA does not cover {leaf!r} (it covers"
                f" {sorted(layout.modules)})"
            )
        if a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise InvalidRequestError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not of"
                f" rank {config.rank} (A is rank x in, B is out x rank)"
            )
        shape = layout.shapes.get(module)
        if shape is None:
            raise InvalidRequestError(f"{module}: no such module in {engine}'s checkpoint")
        out_features, in_features = shape
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise InvalidRequestError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its"
                f" weight ({out_features} x {in_features}): want A {config.rank} x"
                f" {in_features}, B {out_features} x {config.rank}"
            )


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Every value is finite (one host sync a device, not one a tensor).

    Raises:
        InvalidRequestError: names the tensors holding a NaN or an inf.
    """
    bad = nonfinite(tensors)
    if bad:
        raise InvalidRequestError(f"non-finite values in {bad[:4]}")


class Revisions:
    """The manager's table of revisions: which are held, which calls pin which.

    Invariants: every held revision is held by every live engine; a revision some call is
    pinned to stays held until the call ends; an adapter's newest revision is never dropped.
    """

    def __init__(self) -> None:
        self._held: dict[int, AdapterRevision] = {}
        self._newest: dict[str, AdapterRevision] = {}
        self._pins: dict[int, int] = {}
        self._unpinned = asyncio.Event()
        """Set (and replaced) each time a revision's last call ends."""

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held(self) -> tuple[AdapterRevision, ...]:
        return tuple(self._held.values())

    def newest(self, adapter: str) -> AdapterRevision | None:
        return self._newest.get(adapter)

    def pins(self, revision: AdapterRevision) -> int:
        return self._pins.get(revision.revision, 0)

    @contextmanager
    def pinned(self, adapter: str) -> Iterator[AdapterRevision]:
        """Pin a call to ``adapter``'s newest revision until the block ends.

        Raises:
            InvalidRequestError: no revision of ``adapter`` was pushed.
        """
        revision = self._newest.get(adapter)
        if revision is None:
            known = sorted(self._newest) or "none"
            raise InvalidRequestError(
                f"adapter {adapter!r} has no revision (update_adapter pushes one); known: {known}"
            )
        key = revision.revision
        self._pins[key] = self._pins.get(key, 0) + 1
        try:
            yield revision
        finally:
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                self._unpinned.set()
                self._unpinned = asyncio.Event()

    def droppable(self) -> list[AdapterRevision]:
        """Held revisions that may go, oldest first: superseded ones no call is pinned to.
        (An adapter's newest revision stays: new calls start on it until the next arrives.)"""
        newest = {r.revision for r in self._newest.values()}
        return [
            r for key, r in sorted(self._held.items())
            if key not in newest and not self._pins.get(key)
        ]

    def adapters(self) -> set[str]:
        return set(self._newest)

    def retire(self, adapter: str) -> None:
        """No call starts on ``adapter`` from now on; its revisions may go once unpinned."""
        self._newest.pop(adapter, None)

    async def unpinned(self) -> None:
        """Return when some revision's last call ends."""
        await self._unpinned.wait()

    def add(self, revision: AdapterRevision) -> None:
        self._held[revision.revision] = revision
        self._newest[revision.adapter] = revision

    def drop(self, revision: AdapterRevision) -> None:
        self._held.pop(revision.revision, None)
        if self._newest.get(revision.adapter) == revision:
            del self._newest[revision.adapter]
