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
from collections.abc import Collection, Mapping
from typing import Any

import torch

from asyncroll.errors import InvalidRequestError

__all__ = ["FUSED_EXPERTS", "split_experts", "unfused_experts"]

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
    out: dict[str, Any] = {}
    routers: dict[str, str] = {}
    for name, tensor in tensors.items():
        match = _FUSED.match(name)
        layout = _layout(match["prefix"], known) if match is not None else None
        if layout is None or getattr(tensor, "dim", lambda: 3)() != 3:
            _put(out, name, tensor)
            continue
        assert match is not None
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise InvalidRequestError(
                f"{name!r}: fused experts are split into the checkpoint's per-expert tensors"
                f" here, which needs a whole local tensor, not a {type(tensor).__name__}: push"
                " them per expert"
            )
        container, *projections = layout
        block = f"{match['prefix']}.{container}.experts"
        for part, view in split_experts(block, match["which"], tensor, tuple(projections)):
            _put(out, part, view)
        if container == "block_sparse_moe":
            routers[f"{match['prefix']}.mlp.gate.weight"] = (
                f"{match['prefix']}.block_sparse_moe.gate.weight"
            )
    for fused_name, name in routers.items():
        if fused_name in out and fused_name not in known and name in known:
            _put(out, name, out.pop(fused_name))
    return out


def _put(out: dict[str, Any], name: str, tensor: Any) -> None:
    if name in out:
        raise InvalidRequestError(
            f"{name!r} is given twice (fused experts and the same expert by name?)"
        )
    out[name] = tensor


def split_experts(
    block: str, which: str, tensor: torch.Tensor, projections: tuple[str, ...]
) -> list[tuple[str, torch.Tensor]]:
    """One fused expert tensor (``which``: ``gate_up_proj``, experts x (gate; up) x hidden, or
    ``down_proj``) as ``(f"{block}.{expert}.{projection}.weight", view)`` pairs, ``projections``
    naming (gate, up, down)."""
    gate, up, down = projections
    if which == "down_proj":
        return [(f"{block}.{e}.{down}.weight", tensor[e]) for e in range(tensor.shape[0])]
    out = []
    for e in range(tensor.shape[0]):
        first, second = tensor[e].chunk(2, dim=0)
        out += [(f"{block}.{e}.{gate}.weight", first), (f"{block}.{e}.{up}.weight", second)]
    return out


def _layout(prefix: str, known: Collection[str]) -> tuple[str, str, str, str] | None:
    for layout in _LAYOUTS:
        if f"{prefix}.{layout[0]}.experts.0.{layout[1]}.weight" in known:
            return layout
    return None
