"""Cost of checking a weight update (``asyncroll.update_check.check_update``) against a memcpy.

The update is a Qwen2-0.5B-shaped set of random tensors, bf16 unless ``--dtype`` (vocab
151936, hidden 896, intermediate 4864, 24 layers, 14 query / 2 key-value heads of 64 dims, tied
embeddings: 494M parameters, 0.99 GB in bf16). ``check`` is the whole check (names, shapes,
dtypes, finite values); ``memcpy`` one copy of the same bytes between two flat buffers on the
same device, the physical limit of packing a push. Each repeat times a check and a memcpy back
to back (after one warm-up pair); printed are the medians and the median of the per-pair ratios
check / memcpy. Also printed: packing the tensors one by one into a flat buffer, as a push does
(on a loaded machine each tensor's parallel region waits for its threads: check and packing
slow down alike, one flat memcpy does not). ``--compare`` also times the other finite
reductions considered. Usage::

    python bench/check_cost.py                    # CPU
    python bench/check_cost.py --device cuda      # skipped (exit 0) without CUDA
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from asyncroll.update_check import Schema, TensorSpec, check_update

MS = 1e3


def qwen2_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of Qwen2-0.5B (tied: no ``lm_head.weight``)."""
    vocab, hidden, inter, q_dim, kv_dim = 151936, 896, 4864, 14 * 64, 2 * 64
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for name, shape in {
            "self_attn.q_proj.weight": (q_dim, hidden),
            "self_attn.q_proj.bias": (q_dim,),
            "self_attn.k_proj.weight": (kv_dim, hidden),
            "self_attn.k_proj.bias": (kv_dim,),
            "self_attn.v_proj.weight": (kv_dim, hidden),
            "self_attn.v_proj.bias": (kv_dim,),
            "self_attn.o_proj.weight": (hidden, q_dim),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }.items():
            shapes[f"{prefix}.{name}"] = shape
    return shapes


def make_update(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    return {
        name: torch.empty(shape, dtype=dtype, device=device).normal_(std=0.02)
        for name, shape in shapes.items()
    }


def schema_of(shapes: dict[str, tuple[int, ...]]) -> Schema:
    specs = {name: TensorSpec(shape=shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    return Schema(tensors=specs, tied_embeddings=True)


def seconds(fn: Callable[[], object], device: str) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def paired(
    fn: Callable[[], object], copy: Callable[[], object], device: str, repeats: int
) -> tuple[float, float, float]:
    """Median seconds of ``fn`` and ``copy`` and median ratio, each pair timed back to back
    after one warm-up pair (on a shared machine the load moves; a pair sees about the same)."""
    pairs = [(seconds(fn, device), seconds(copy, device)) for _ in range(repeats + 1)][1:]
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reduction(fn: Callable[[torch.Tensor], torch.Tensor], update: dict[str, torch.Tensor]) -> None:
    """One 0-d result per tensor, fetched in one sync, as ``check_update`` fetches its own."""
    torch.stack([fn(tensor) for tensor in update.values()]).tolist()


ALTERNATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum(dtype=float32)": lambda t: torch.sum(t, dtype=torch.float32),
    "sum(native dtype)": lambda t: torch.sum(t),
    "isfinite(t).all()": lambda t: torch.isfinite(t).all(),
}
"""Other finite reductions: the fp32 sum is what the task suggested; the native sum can overflow
(a finite fp16 tensor summing past 65504 then needs a second pass); isfinite allocates."""


def main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped", file=sys.stderr)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = qwen2_shapes(args.layers)
    update = make_update(shapes, getattr(torch, args.dtype), args.device)
    schema = schema_of(shapes)
    nbytes = sum(t.numel() * t.element_size() for t in update.values())
    source = torch.empty(nbytes, dtype=torch.uint8, device=args.device).fill_(1)
    target = torch.empty_like(source)

    def copy() -> None:
        target.copy_(source)

    def pack() -> None:
        offset = 0
        for tensor in update.values():
            size = tensor.numel() * tensor.element_size()
            target[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            offset += size

    def check(finite: bool = True) -> None:
        check_update(update, schema, served_dtype=torch.bfloat16, check_finite=finite)

    check_s, copy_s, ratio = paired(check, copy, args.device, args.repeats)
    names_s = min(seconds(lambda: check(False), args.device) for _ in range(args.repeats))
    print(
        f"{args.device} ({torch.get_num_threads()} threads), {len(update)} tensors, "
        f"{nbytes / 1e9:.2f} GB {args.dtype}, median of {args.repeats}"
    )
    print(f"check {check_s * MS:.1f} ms, memcpy {copy_s * MS:.1f} ms, ratio {ratio:.2f}")
    print(f"  of which names/shapes/dtypes {names_s * MS:.2f} ms (best)")
    pack_s, _, pack_ratio = paired(pack, copy, args.device, args.repeats)
    print(
        f"  packing tensor by tensor (as a push does) {pack_s * MS:.1f} ms, ratio {pack_ratio:.2f}"
    )
    if args.compare:
        for label, fn in ALTERNATIVES.items():
            alt_s, _, alt_ratio = paired(
                partial(reduction, fn, update), copy, args.device, args.repeats
            )
            print(f"  finite via {label}: {alt_s * MS:.1f} ms, ratio {alt_ratio:.2f}")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (0.5B: 24)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--compare", action="store_true", help="also time other reductions")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
