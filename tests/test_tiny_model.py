from __future__ import annotations

import hashlib
from pathlib import Path

from asyncroll.testing import make_tiny_model


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
