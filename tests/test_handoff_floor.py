"""The bucket plan of ``bench/_handoff_floor.py``, the two-process floor that
``bench/weight_push.py`` sets beside our pipeline: it must copy what a staged push copies, where
a push copies it (asyncroll's own planner, as byte ranges), or the floor would time other copies
than ours. (The floor itself needs CUDA: it checks each push's loads against the sources'
checksums and raises if a device wait did not hold.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

MiB = 1 << 20


def _floor() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "_handoff_floor.py"
    spec = importlib.util.spec_from_file_location("bench_handoff_floor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(layers: int, hidden: int = 4096, inter: int = 11008) -> dict[str, torch.Tensor]:
    """weight_push.py's names and shapes, as meta tensors (no memory)."""
    shapes = {"model.embed_tokens.weight": (32000, hidden), "lm_head.weight": (32000, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (hidden // 4, hidden),
            f"{p}.self_attn.v_proj.weight": (hidden // 4, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (1, hidden),
            f"{p}.post_attention_layernorm.weight": (1, hidden),
        }
    return {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}


def _check_layout(plan: list[list[tuple[int, int, int, int]]], sizes: list[int], bucket: int):
    """Every byte of every tensor copied once, in order; pieces aligned, inside the bucket and
    apart from each other. Returns the bucket of each tensor's first piece."""
    covered = [0] * len(sizes)
    first: dict[int, int] = {}
    for k, slots in enumerate(plan):
        assert slots  # no empty bucket
        ends = 0
        for index, offset, start, nbytes in sorted(slots, key=lambda s: s[1]):
            assert offset % 256 == 0 and offset >= ends and nbytes > 0
            ends = offset + nbytes
            assert start == covered[index]  # the tensor's next bytes, in order
            covered[index] += nbytes
            first.setdefault(index, k)
        assert ends <= bucket
    assert covered == sizes
    return first


def test_the_floor_copies_what_a_staged_push_copies_where_it_copies_it() -> None:
    tensors = _model(layers=23)  # weight_push.py's 8 GiB model: 209 tensors
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    plan = _floor().plan_buckets(tensors, 512 * MiB)
    first = _check_layout(plan, sizes, 512 * MiB)
    assert len(tensors) == 209 and len(plan) == 17  # as the H100 and H200 runs counted
    names = list(tensors)
    for i in range(23):  # q, k and v travel together (vLLM's fused qkv_proj), as in a push
        p = f"model.layers.{i}.self_attn"
        qkv = {first[names.index(f"{p}.{x}_proj.weight")] for x in "qkv"}
        assert len(qkv) == 1


def test_a_tensor_larger_than_a_bucket_travels_in_pieces() -> None:
    tensors = _model(layers=1)  # the embedding is 250 MiB
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    plan = _floor().plan_buckets(tensors, 64 * MiB)
    _check_layout(plan, sizes, 64 * MiB)
    pieces = [s for slots in plan for s in slots if s[0] == 0]
    assert len(pieces) >= 4 and pieces[0][2] == 0 and pieces[1][2] > 0
