from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from asyncroll.testing import make_tiny_model
from asyncroll.testing.tiny_model import MOE_FAMILIES, TINY_MOE, checkpoint_shapes


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a1 = _digest(make_tiny_model(tmp_path / "a1", seed=3))
    a2 = _digest(make_tiny_model(tmp_path / "a2", seed=3))
    b = _digest(make_tiny_model(tmp_path / "b", seed=4))
    assert a1 == a2
    assert set(a1) == {"config.json", "generation_config.json", "model.safetensors",
                       "tokenizer.json", "tokenizer_config.json"}
    assert a1["tokenizer.json"] == b["tokenizer.json"]
    assert a1["model.safetensors"] != b["model.safetensors"]
    assert a1["config.json"] == b["config.json"]


def test_the_tokenizer_covers_the_vocabulary_and_round_trips_text(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path / "m", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")] == [0, 1]
    text = 'Héllo <tool_call>{"name": "clock"}</tool_call> 42 ✓\n'
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    every_id = tokenizer.decode(list(range(512)), skip_special_tokens=False)
    assert "<|im_start|>" in every_id


def test_the_chat_template_renders_tools_and_calls(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path / "m", seed=0)))
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c", "content": "r"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == (
        '<|im_start|>system\n<tools>\n{"type": "function", "function": {"name": "f"}}\n'
        "</tools><|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_real_shapes_have_their_published_sizes_and_checkpoint_names() -> None:
    """The shapes' parameter counts are the published ones (7.6B, 30.5B of which 128 experts a
    layer, Mixtral's 46.7B), and mixtures name one tensor per expert as their checkpoints do."""
    sizes = {name: checkpoint_shapes(name) for name in ("qwen2.5-7b", "qwen3-30b-a3b",
                                                         "mixtral-8x7b")}
    billions = {name: round(sum(math.prod(s) for s in shapes.values()) / 1e9, 1)
                for name, shapes in sizes.items()}
    assert billions == {"qwen2.5-7b": 7.6, "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7}
    assert sizes["qwen3-30b-a3b"]["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048,
                                                                                         768)
    assert sizes["mixtral-8x7b"]["model.layers.0.block_sparse_moe.experts.7.w3.weight"] == (
        14336, 4096)
    assert not any(".experts.gate_up_proj" in name for shapes in sizes.values() for name in shapes)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_tiny_mixture_is_written_one_tensor_per_expert(tmp_path: Path, family: str) -> None:
    path = make_tiny_model(tmp_path, seed=3, family=family)
    names = set(load_file(str(path / "model.safetensors")))
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    projections = ("w1", "w2", "w3") if family == "mixtral" else ("gate_proj", "up_proj",
                                                                   "down_proj")
    assert {f"model.layers.1.{moe}.experts.{e}.{p}.weight" for e in range(TINY_MOE["num_experts"])
            for p in projections} <= names
    assert f"model.layers.0.{moe}.gate.weight" in names
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)
