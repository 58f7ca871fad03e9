"""Cost of the backup an update takes before a direct load (``asyncroll.receive.Rollback``),
against the copy limit.

Before an update whose push may fail (``backup=True``: the default on CPU, and what an
``inflight`` update needs on any device), the worker saves the served parameters. This
measures, on a Qwen2-0.5B-shaped model (the tensors of ``bench/check_cost.py``, bf16 unless
``--dtype``, made as ``nn.Parameter``s of one module):

- ``clone``: one ``clone()`` per tensor, every update (asyncroll before session 29);
- ``kept``: ``Rollback.begin``: one fused copy into tensors kept from the update before;
- ``memcpy``: one copy of the same bytes between two flat buffers, the physical limit.

Each repeat times the three back to back (after one warm-up round); printed are the medians and
the ratios to ``memcpy``. Usage::

    python bench/backup_cost.py                   # CPU
    python bench/backup_cost.py --device cuda     # skipped (exit 0) without CUDA
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from check_cost import make_update, qwen2_shapes, seconds

from asyncroll.receive import Rollback

MS = 1e3


def model_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Module()
    for index, tensor in enumerate(tensors.values()):
        model.register_parameter(f"p{index}", torch.nn.Parameter(tensor, requires_grad=False))
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    dtype = getattr(torch, args.dtype)
    tensors = make_update(qwen2_shapes(args.layers), dtype, args.device)
    model = model_of(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    other = torch.empty_like(flat)
    rollback = Rollback()

    def clone() -> object:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def kept() -> None:
        rollback.begin(model, backup=True, direct=True, checkpoint=lambda: None)
        rollback.commit(lambda pending: False)

    rounds: dict[str, list[float]] = {"clone": [], "kept": [], "memcpy": []}
    for repeat in range(args.repeats + 1):
        for name, fn in (("clone", clone), ("kept", kept), ("memcpy", lambda: other.copy_(flat))):
            took = seconds(fn, args.device)
            if repeat:  # the first round warms up (and makes the kept tensors)
                rounds[name].append(took)
    median = {name: statistics.median(times) for name, times in rounds.items()}
    print(f"{len(tensors)} tensors, {nbytes / 2**30:.2f} GiB of {args.dtype} on {args.device},"
          f" median of {args.repeats}:")
    for name in ("clone", "kept", "memcpy"):
        print(f"  {name:7s} {median[name] * MS:8.2f} ms  {median[name] / median['memcpy']:5.2f}x"
              " the memcpy")
    print(f"kept is {median['clone'] / median['kept']:.2f}x faster than a clone per tensor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
