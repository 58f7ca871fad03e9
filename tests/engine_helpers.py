"""Helpers shared by the engine tests (a module, so every test sees the same state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from asyncroll import VLLMEngine

PROBE_PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 12, [7, 1, 7, 1, 7]]
"""Prompts whose greedy continuations identify the weights an engine serves."""

PROMPT_PARAMS: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True}

ENGINE_ARGS: dict[str, Any] = {"max_model_len": 512, "dtype": "float32"}
"""How every test engine starts. float32, not the adapter's bf16 default: tests compare greedy
outputs token for token across batches, resumes (a re-prefill computes the KV with other kernels
than decoding did) and engines, and a random tiny model's logits have near-ties that bf16 rounding
flips; float32 keeps the comparisons about our code, not about rounding."""

FRESH_GREEDY: dict[str, list[tuple[int, ...]]] = {}
"""Greedy outputs of each model, recorded on its engine before any push reached it."""


async def greedy(engine: VLLMEngine, tag: str, max_tokens: int = 24) -> list[tuple[int, ...]]:
    """Greedy continuations of the probe prompts."""
    outputs = []
    for i, prompt in enumerate(PROBE_PROMPTS):
        segment = await engine.generate(
            f"greedy-{tag}-{i}",
            prompt_ids=prompt,
            sampling_params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        outputs.append(segment.token_ids)
    return outputs


def load_weights(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


