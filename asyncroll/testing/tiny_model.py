"""Seeded random-weight Qwen2-style models, built locally (no hub).

Invariant: the same arguments give the same bytes on disk, so two engines started on two builds
with one seed serve the same model, and two seeds give two models of one architecture (the
weight-push tests push the weights of one into an engine started on the other).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["TINY_CONFIG", "make_tiny_model"]

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
}
"""Small enough to start fast on two CPU cores; head size 64 is one the CPU attention supports."""


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = TINY_CONFIG["vocab_size"],
    hidden_size: int = TINY_CONFIG["hidden_size"],
    intermediate_size: int = TINY_CONFIG["intermediate_size"],
    num_hidden_layers: int = TINY_CONFIG["num_hidden_layers"],
    num_attention_heads: int = TINY_CONFIG["num_attention_heads"],
    num_key_value_heads: int = TINY_CONFIG["num_key_value_heads"],
    max_position_embeddings: int = TINY_CONFIG["max_position_embeddings"],
    init_std: float = 0.02,
) -> Path:
    """Write a seeded random-weight Qwen2 model (bf16 safetensors) that vLLM serves token-in/out.

    Args:
        path: Folder to write; created if missing, files in it overwritten.
        seed: Seed of the weights. Same seed and shape, same bytes.
        init_std: Standard deviation of the random weights (larger makes sampling more peaked).

    Returns:
        The folder, ready for ``VLLMEngine.launch(path, skip_tokenizer_init=True)``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=1,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    finally:
        torch.random.set_rng_state(generator_state)
    tensors = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in sorted(model.state_dict().items())
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["architectures"] = ["Qwen2ForCausalLM"]
    config_dict["torch_dtype"] = config_dict["dtype"] = "bfloat16"
    config_dict.pop("transformers_version", None)
    _write_json(out / "config.json", config_dict)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True},
    )
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
