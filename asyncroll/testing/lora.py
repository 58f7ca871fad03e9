"""LoRA adapters for tests and benchmarks: random ones at a checkpoint's real shapes, and PEFT's
on-disk format to compare asyncroll's pushed adapters with vLLM's own loading."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from asyncroll.adapters import AdapterConfig, decoder_shapes
from asyncroll.update_check import read_checkpoint_schema

__all__ = ["LINEAR_MODULES", "random_adapter", "write_peft_adapter"]

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama/Qwen decoder block."""


def random_adapter(
    model_path: str | Path,
    config: AdapterConfig,
    *,
    seed: int = 0,
    modules: Iterable[str] = LINEAR_MODULES,
    scale: float = 0.05,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """A seeded random LoRA over ``modules`` of every layer, at the checkpoint's shapes, under
    PEFT's names. Both halves are non-zero (PEFT starts B at zero: that would change nothing).
    Made on the host, then moved to ``device``."""
    schema = read_checkpoint_schema(model_path)
    if schema is not None:
        shapes = {
            name.removesuffix(".weight"): (spec.shape[0], spec.shape[1])
            for name, spec in schema.tensors.items()
            if name.endswith(".weight") and len(spec.shape) == 2
        }
    else:  # a config alone (an engine started with load_format="dummy")
        shapes = decoder_shapes(json.loads((Path(model_path) / "config.json").read_text()))
    wanted = set(modules)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (out_features, in_features) in sorted(shapes.items()):
        if module.rsplit(".", 1)[-1] not in wanted:
            continue
        a = torch.randn(config.rank, in_features, generator=generator) * scale
        b = torch.randn(out_features, config.rank, generator=generator) * scale
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype).to(device)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype).to(device)
    return tensors


def write_peft_adapter(
    path: str | Path, tensors: Mapping[str, torch.Tensor], config: AdapterConfig
) -> Path:
    """Write ``tensors`` as a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``), what vLLM loads from a ``LoRARequest``'s path."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    (out / "adapter_config.json").write_text(json.dumps(config.peft_config(tensors), indent=1))
    return out
