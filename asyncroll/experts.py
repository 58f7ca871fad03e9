"""Mixture-of-experts tensors under the names an engine's checkpoint gives them.

transformers 5 keeps a mixture's experts fused in memory: one ``mlp.experts.gate_up_proj`` of
experts x (gate; up) x hidden and one ``mlp.experts.down_proj`` of experts x hidden x width a
layer, so a trainer's ``state_dict()`` names them so. The published checkpoints (and vLLM 0.24's
loaders) name one tensor per expert and projection: ``mlp.experts.3.gate_proj.weight`` (Qwen3-MoE,
Qwen2-MoE) or ``block_sparse_moe.experts.3.w1.weight`` (Mixtral: ``w1`` gate, ``w3`` up, ``w2``
down). ``unfused_experts`` gives the second from the first, as views (no copy), wherever the
engine's checkpoint holds the per-expert names; the push then checks and loads them as any other
tensor.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncroll.errors import InvalidRequestError

__all__ = ["FUSED_EXPERTS", "Unfusing", "expert_parts", "split_experts", "unfused_experts",
           "unfusing"]

FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
"""How transformers 5's fused expert tensors' names end."""

_FUSED = re.compile(
    r"^(?P<prefix>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<which>gate_up_proj|down_proj)$"
)

_LAYOUTS = (
    ("mlp", "gate_proj", "up_proj", "down_proj"),
    ("block_sparse_moe", "w1", "w3", "w2"),
)
"""(container, gate, up, down) of the checkpoints' per-expert names."""

Projections = tuple[str, str, str]
"""The checkpoint's names of an expert's (gate, up, down) projections."""


@dataclass(frozen=True, slots=True)
class Unfusing:
    """How a trainer's fused expert names become the checkpoint's (``unfusing``): names only,
    so that every rank of a sharded trainer can follow the one that knows the checkpoint."""

    blocks: dict[str, tuple[str, str, Projections]] = field(default_factory=dict)
    """Per fused name: whether it is ``gate_up_proj`` or ``down_proj``, the checkpoint's block
    of experts (``model.layers.0.mlp.experts``) and its projections' names."""
    renames: dict[str, str] = field(default_factory=dict)
    """Other names the checkpoint gives otherwise (a Mixtral router under ``mlp.gate``)."""

    def __bool__(self) -> bool:
        return bool(self.blocks or self.renames)


def unfusing(names: Iterable[str], known: Collection[str]) -> Unfusing:
    """The fused expert names among ``names`` whose per-expert names ``known`` (the
    checkpoint's names) holds, and the routers to rename with them."""
    names = list(names)
    plan = Unfusing()
    for name in names:
        match = _FUSED.match(name)
        layout = _layout(match["prefix"], known) if match is not None else None
        if match is None or layout is None:
            continue
        container, gate, up, down = layout
        block = f"{match['prefix']}.{container}.experts"
        plan.blocks[name] = (match["which"], block, (gate, up, down))
        router = f"{match['prefix']}.mlp.gate.weight"
        checkpoint_router = f"{match['prefix']}.{container}.gate.weight"
        if router != checkpoint_router and router not in known and checkpoint_router in known:
            plan.renames[router] = checkpoint_router
    present = set(names)
    for router in [r for r in plan.renames if r not in present]:
        del plan.renames[router]
    return plan


def unfused_experts(tensors: Mapping[str, Any], known: Collection[str]) -> dict[str, Any]:
    """``tensors`` with every fused expert tensor (a 3-dimensional tensor under a
    transformers-5 name) replaced by one view per expert and projection, named as in ``known``
    (the checkpoint's names); a Mixtral router under transformers 5's ``mlp.gate`` goes under
    the checkpoint's ``block_sparse_moe.gate``. A fused name whose per-expert names ``known``
    lacks, or that is not 3-dimensional, stays as it is (the update's checks then name it).

    Raises:
        InvalidRequestError: a fused tensor that is not a whole local tensor (a lazy one, a
            piece, a DTensor: push those per expert), or a name given twice (fused, and per
            expert too).
    """
    plan = unfusing(tensors, known)
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        fused = plan.blocks.get(name)
        if fused is None or getattr(tensor, "dim", lambda: 3)() != 3:
            _put(out, plan.renames.get(name, name), tensor)
            continue
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise InvalidRequestError(
                f"{name!r}: fused experts are split into the checkpoint's per-expert tensors"
                f" here, which needs a whole local tensor, not a {type(tensor).__name__}: push"
                " them per expert"
            )
        which, block, projections = fused
        for part, view in split_experts(block, which, tensor, projections):
            _put(out, part, view)
    return out


def _put(out: dict[str, Any], name: str, tensor: Any) -> None:
    if name in out:
        raise InvalidRequestError(
            f"{name!r} is given twice (fused experts and the same expert by name?)"
        )
    out[name] = tensor


def expert_parts(
    block: str, which: str, shape: Sequence[int], projections: Projections
) -> list[tuple[str, int, slice]]:
    """The per-expert tensors of one fused expert tensor of ``shape`` (``which``:
    ``gate_up_proj``, experts x (gate; up) x hidden, or ``down_proj``): each one's name
    (``f"{block}.{expert}.{projection}.weight"``), expert and rows of that expert."""
    gate, up, down = projections
    experts, rows = shape[0], shape[1]
    if which != "down_proj" and rows % 2:
        raise InvalidRequestError(
            f"{block}: a fused gate_up_proj of {rows} rows (gate; up: an even count)"
        )
    if which == "down_proj":
        return [(f"{block}.{e}.{down}.weight", e, slice(0, rows)) for e in range(experts)]
    half = rows // 2
    out = []
    for e in range(experts):
        out += [(f"{block}.{e}.{gate}.weight", e, slice(0, half)),
                (f"{block}.{e}.{up}.weight", e, slice(half, rows))]
    return out


def split_experts(
    block: str, which: str, tensor: torch.Tensor, projections: Projections
) -> list[tuple[str, torch.Tensor]]:
    """One fused expert tensor as ``(name, view)`` pairs (``expert_parts``)."""
    return [(name, tensor[e, rows])
            for name, e, rows in expert_parts(block, which, tensor.shape, projections)]


def _layout(prefix: str, known: Collection[str]) -> tuple[str, str, str, str] | None:
    for layout in _LAYOUTS:
        if f"{prefix}.{layout[0]}.experts.0.{layout[1]}.weight" in known:
            return layout
    return None
