"""Seeded random-weight models, built locally (no hub): tiny ones with a real tokenizer for
tests and the CPU demo, and real shapes (``SHAPES``) for GPU runs and benchmarks.

Invariants:
- The same arguments give the same bytes on disk, so two engines started on two builds with one
  seed serve the same model, and two seeds give two models of one architecture (the weight-push
  tests push the weights of one into an engine started on the other).
- The tokenizer (``tokenizer.json``, ``tokenizer_config.json``) is a byte-level BPE trained here
  on a fixed text, with exactly ``vocab_size`` ids (a vocabulary larger than the text fills is
  padded with ``<|extra_N|>`` special tokens): every id the model can sample decodes, every text
  encodes, and ``decode(encode(text)) == text``. Its chat template is ChatML with Hermes
  tool calls (``CHAT_TEMPLATE``); ``<|im_end|>`` (id 1) is the end-of-turn and EOS token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from asyncroll.errors import InvalidRequestError
from asyncroll.experts import split_experts

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "MOE_FAMILIES",
    "REASONING_DROPPING_TEMPLATE",
    "SHAPES",
    "TINY_CONFIG",
    "TINY_MOE",
    "checkpoint_shapes",
    "make_model",
    "make_tiny_model",
    "tiny_module",
    "write_model_config",
]

Family = Literal["qwen2", "qwen3", "llama", "qwen3_moe", "mixtral"]
FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
"""The architectures ``make_tiny_model`` and ``make_model`` write (Hugging Face ``model_type``).
The mixtures of experts write their experts as their published checkpoints do, one tensor per
expert and projection (``mlp.experts.3.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.3.w1.weight``), which is what vLLM's loaders read; transformers 5
fuses them in memory, so its ``state_dict`` names them fused (``asyncroll.experts`` splits
them back)."""

MOE_FAMILIES: frozenset[Family] = frozenset({"qwen3_moe", "mixtral"})

TINY_MOE: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
"""The experts of a tiny mixture (``make_tiny_model(family="qwen3_moe")``): 8 of them, 2 a
token, each 64 wide (a multiple of 32, as the CPU build's grouped GEMM wants)."""

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, tie_word_embeddings=False),
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          norm_topk_prob=True),
    "mixtral-8x7b": dict(family="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         tie_word_embeddings=False),
    "qwen3-1.7b": dict(family="qwen3", hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "llama-3.2-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, tie_word_embeddings=True),
}
"""The published configurations of real models (their shapes, not their weights): ``make_model``
writes random weights at these shapes, for GPU runs and benchmarks."""

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
    family: Family = "qwen2",
) -> Path:
    """Write a seeded random-weight model (bf16 safetensors) that vLLM serves token-in/out.

    Args:
        path: Folder to write; created if missing, files in it overwritten.
        seed: Seed of the weights. Same seed and shape, same bytes.
        init_std: Standard deviation of the random weights (larger makes sampling more peaked).
        family: ``qwen2`` (the default), ``qwen3`` (q/k norms, head size 64 here), ``llama``
            (no biases), or a mixture of experts: ``qwen3_moe`` (``TINY_MOE``: every layer's
            MLP is 8 experts of width 64, 2 a token) or ``mixtral`` (the same experts, each
            ``intermediate_size`` wide as Mixtral's config says: 64 where it is left at its
            default).

    Returns:
        The folder, ready for ``VLLMEngine.launch(path, skip_tokenizer_init=True)``; its
        tokenizer loads with ``transformers.AutoTokenizer.from_pretrained(path)``.
    """
    config = _tiny_config(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
    )
    model = _seeded_module(config, family, seed)
    tensors = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for fused, value in sorted(model.state_dict().items())
        for name, tensor in _checkpoint_tensors(family, fused, value)
    }
    out = _write_checkpoint(path, config, tensors, family)
    _write_tokenizer(out, vocab_size=vocab_size, max_len=max_position_embeddings)
    return out


def tiny_module(*, seed: int = 0, family: Family = "qwen2") -> torch.nn.Module:
    """The transformers model whose weights ``make_tiny_model(path, seed=seed, family=family)``
    writes (its default sizes; float32): what a trainer on transformers holds. Its
    ``state_dict`` names a mixture's experts as transformers 5 does, fused."""
    config = _tiny_config(
        family, vocab_size=TINY_CONFIG["vocab_size"], hidden_size=TINY_CONFIG["hidden_size"],
        intermediate_size=TINY_CONFIG["intermediate_size"],
        num_hidden_layers=TINY_CONFIG["num_hidden_layers"],
        num_attention_heads=TINY_CONFIG["num_attention_heads"],
        num_key_value_heads=TINY_CONFIG["num_key_value_heads"],
        max_position_embeddings=TINY_CONFIG["max_position_embeddings"], initializer_range=0.02,
    )
    return _seeded_module(config, family, seed)


def _tiny_config(family: Family, *, intermediate_size: int, **fields: Any) -> Any:
    """``make_tiny_model``'s config: ``fields`` and, for a mixture, ``TINY_MOE``'s experts."""
    experts: dict[str, Any] = {}
    if family == "qwen3_moe":
        experts = dict(TINY_MOE)
    elif family == "mixtral":
        experts = {"num_local_experts": TINY_MOE["num_experts"],
                   "num_experts_per_tok": TINY_MOE["num_experts_per_tok"]}
        if intermediate_size == TINY_CONFIG["intermediate_size"]:
            intermediate_size = TINY_MOE["moe_intermediate_size"]
    return _config(family, **experts, **fields, intermediate_size=intermediate_size,
                   tie_word_embeddings=False)


def _seeded_module(config: Any, family: Family, seed: int) -> torch.nn.Module:
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return _model_class(family)(config)  # type: ignore[no-any-return]
    finally:
        torch.random.set_rng_state(generator_state)


def make_model(
    path: str | Path,
    shape: str | dict[str, Any],
    *,
    seed: int = 0,
    init_std: float = 0.02,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write random weights at a real model's shape (``SHAPES``, or a dict of config fields
    with ``family``), without a tokenizer: fast for billions of parameters (no module is
    built: each tensor is drawn in fp32 and cast to bf16, one at a time; norms at 1, biases
    at 0).

    Raises:
        InvalidRequestError: an unknown shape name or family.
    """
    config, family, shapes = _skeleton(shape, max_position_embeddings, init_std)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, size in shapes.items():  # (a tied lm_head drawn too: the same bytes as ever)
        if name.endswith("norm.weight"):
            value = torch.ones(size, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            value = torch.zeros(size, dtype=torch.bfloat16)
        else:
            value = (torch.randn(size, generator=generator) * init_std).to(torch.bfloat16)
        tensors[name] = value
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return _write_checkpoint(path, config, tensors, family)


def write_model_config(
    path: str | Path, shape: str | dict[str, Any], *, max_position_embeddings: int = 4096
) -> Path:
    """The configuration files ``make_model`` writes, without weights: for an engine started
    with ``load_format="dummy"`` that takes its weights from a push (GPU benchmarks)."""
    config, family, _ = _skeleton(shape, max_position_embeddings, 0.02)
    return _write_checkpoint(path, config, None, family)


def checkpoint_shapes(shape: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of ``shape`` holds (``SHAPES`` or a dict of config fields with
    ``family``): name -> size, as ``make_model`` writes them (for drawing weights on a device
    without a file).

    Raises:
        InvalidRequestError: an unknown shape name or family.
    """
    config, _, shapes = _skeleton(shape, 4096, 0.02)
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _skeleton(
    shape: str | dict[str, Any], max_position_embeddings: int, init_std: float
) -> tuple[Any, Family, dict[str, tuple[int, ...]]]:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise InvalidRequestError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    fields = dict(shape)
    family = fields.pop("family", "qwen2")
    if family not in FAMILIES:
        raise InvalidRequestError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    config = _config(family, max_position_embeddings=max_position_embeddings,
                     initializer_range=init_std, **fields)
    with torch.device("meta"):
        skeleton = _model_class(family)(config)
    shapes = {
        name: tuple(tensor.shape)
        for fused, value in sorted(skeleton.state_dict().items())
        for name, tensor in _checkpoint_tensors(family, fused, value)
    }
    return config, family, shapes


def _config(family: Family, **fields: Any) -> Any:
    import transformers

    fields.setdefault("bos_token_id", 0)
    fields.setdefault("eos_token_id", 1)
    if family in ("qwen3", "qwen3_moe"):
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if family == "qwen3_moe":
        fields.setdefault("norm_topk_prob", True)
        fields.setdefault("mlp_only_layers", [])
        fields.setdefault("decoder_sparse_step", 1)
    name = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig",
            "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}[family]
    return getattr(transformers, name)(**fields)


def _model_class(family: Family) -> Any:
    import transformers

    name = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM"}[family]
    return getattr(transformers, name)


def _checkpoint_tensors(
    family: Family, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """``name`` of transformers' in-memory model as the family's checkpoints name it: the fused
    experts (``mlp.experts.gate_up_proj``, experts x (gate; up) x hidden, and
    ``mlp.experts.down_proj``) one tensor per expert and projection; Mixtral's MoE under
    ``block_sparse_moe`` with ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""
    if family not in MOE_FAMILIES:
        return [(name, tensor)]
    if family == "mixtral":
        name = name.replace(".mlp.", ".block_sparse_moe.")
    prefix, _, leaf = name.rpartition(".experts.")
    if not prefix or leaf not in ("gate_up_proj", "down_proj"):
        return [(name, tensor)]
    projections = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj",
                                                                     "down_proj")
    return split_experts(f"{prefix}.experts", leaf, tensor, projections)


def _write_checkpoint(
    path: str | Path, config: Any, tensors: dict[str, torch.Tensor] | None, family: Family
) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["architectures"] = [_model_class(family).__name__]
    config_dict["torch_dtype"] = config_dict["dtype"] = "bfloat16"
    config_dict.pop("transformers_version", None)
    _write_json(out / "config.json", config_dict)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True},
    )
    return out


SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<think>",
    "</think>", "<tool_response>", "</tool_response>",
)
"""Ids 0 to 8, in this order: id 0 is BOS and padding, id 1 is EOS (as in the config)."""

_CORPUS = """\
You are a helpful assistant. Answer the question, call a tool when it helps, and think first.
The user asks what two plus three is; the assistant calls the add tool with a equal to two and b
equal to three. The tool returns five, and the assistant says that the answer is five.
Reinforcement learning trains a policy from rewards: the policy samples a response, a reward
function scores it, and the trainer raises the probability of responses that scored well.
Rollout engines generate the responses; the trainer pushes new weights into them after a step.
Weather in Paris is sunny with a light breeze; in London it rains. What time is it now?
Search the web, read the file, run the code, list the directory, write the answer, check again.
{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "clock"}
system user assistant tool function arguments name content role reasoning
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 256 512 1024
"""
"""What the BPE merges are learnt from: chat, tool calls and numbers, so such text encodes in
few tokens. Long enough to fill a 512-id vocabulary."""

_NL = "{{ '\\n' }}"


def _chat_template(*, drop_reasoning: bool) -> str:
    drop = (
        "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    )
    return "".join([
        "{%- if messages and messages[0].role == 'system' %}",
        "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}",
        "{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}",
        "{%- set ns = namespace(last_user=-1) %}{%- for message in rest %}",
        "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}",
        "{%- endfor %}",
        "{%- if system is not none or tools %}<|im_start|>system", _NL,
        "{%- if system is not none %}{{ system }}{%- if tools %}", _NL, _NL,
        "{%- endif %}{%- endif %}",
        "{%- if tools %}<tools>{%- for tool in tools %}", _NL,
        "{{ tool | tojson }}{%- endfor %}", _NL, "</tools>{%- endif %}<|im_end|>", _NL,
        "{%- endif %}",
        "{%- for message in rest %}",
        "{%- if message.role == 'tool' %}<|im_start|>user", _NL, "<tool_response>", _NL,
        "{{ message.content }}", _NL, "</tool_response><|im_end|>", _NL,
        "{%- elif message.role == 'assistant' %}<|im_start|>assistant", _NL,
        "{%- set content = message.content or '' %}",
        drop if drop_reasoning else "",
        "{{ content }}",
        "{%- for call in message.tool_calls or [] %}",
        '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": ',
        "{% if call.function.arguments is string %}{{ call.function.arguments }}",
        "{%- else %}{{ call.function.arguments | tojson }}{%- endif %}}</tool_call>",
        "{%- endfor %}<|im_end|>", _NL,
        "{%- else %}<|im_start|>{{ message.role }}", _NL,
        "{{ message.content }}<|im_end|>", _NL,
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}<|im_start|>assistant", _NL, "{%- endif %}",
    ])


CHAT_TEMPLATE = _chat_template(drop_reasoning=False)
"""ChatML with a ``<tools>`` system block, Hermes ``<tool_call>`` JSON in assistant turns and
tool results as ``<tool_response>`` user turns. Earlier turns render exactly as given."""

REASONING_DROPPING_TEMPLATE = _chat_template(drop_reasoning=True)
"""The same, but like Qwen3's it drops ``<think>...</think>`` from assistant turns before the
last user turn: it rewrites history, so a trajectory re-rendered with it drifts."""


def _write_tokenizer(out: Path, *, vocab_size: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    learnt = tokenizer.get_vocab_size()  # a large vocabulary outgrows the corpus: pad it
    tokenizer.add_special_tokens([f"<|extra_{i}|>" for i in range(vocab_size - learnt)])
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
