"""Weights that make a tiny Qwen2 model say a chosen text: a bigram lookup table in model form.

For tests that need a real engine to produce a particular output (a tool call, a reasoning
block) from a random-weight model: push these weights and the model greedily continues each
scripted token with the token that follows it in the script, and ends its turn (EOS) after any
other token.

How: every layer's output projections (``o_proj``, ``down_proj``) are zero, so the residual
stream is the token's embedding; a scripted token's embedding is a one-hot slot, the final norm
scales it to ``sqrt(hidden_size)``, and ``lm_head`` maps each slot to the token that follows.
Every other token shares one slot that maps to EOS.

Invariant: a script is accepted only if each token has one successor (the table is a function);
otherwise ``InvalidRequestError`` says which token is ambiguous.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from asyncroll.errors import InvalidRequestError

__all__ = ["scripted_weights"]


def scripted_weights(
    weights: Mapping[str, torch.Tensor],
    scripts: Sequence[Sequence[int]],
    *,
    eos_token_id: int,
    strength: float = 2.0,
) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` (a tiny Qwen2's, Hugging Face names) that follows ``scripts``.

    Args:
        weights: The model's tensors (e.g. its ``model.safetensors``).
        scripts: Token sequences; in each, token ``i`` is followed by token ``i + 1``. Start a
            script with the last token of the prompts it should answer.
        eos_token_id: What every unscripted token is followed by.
        strength: ``lm_head`` entry of a slot; the chosen token's logit is
            ``strength * sqrt(hidden_size)``, every other token's 0.

    Raises:
        InvalidRequestError: a token with two successors, or more scripted tokens than slots.
    """
    successor = _successors(scripts)
    embed = weights["model.embed_tokens.weight"]
    vocab_size, hidden_size = embed.shape
    if len(successor) >= hidden_size:
        raise InvalidRequestError(
            f"{len(successor)} scripted tokens need more than the {hidden_size - 1} slots"
        )
    out = {name: tensor.clone() for name, tensor in weights.items()}
    for name, tensor in out.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    other = hidden_size - 1
    new_embed = torch.zeros(vocab_size, hidden_size, dtype=embed.dtype)
    new_embed[:, other] = 1.0
    head = torch.zeros(vocab_size, hidden_size, dtype=embed.dtype)
    head[eos_token_id, other] = strength
    for slot, (token, following) in enumerate(sorted(successor.items())):
        new_embed[token] = 0.0
        new_embed[token, slot] = 1.0
        head[following, slot] = strength
    out["model.embed_tokens.weight"] = new_embed
    out["lm_head.weight"] = head
    out["model.norm.weight"] = torch.ones_like(out["model.norm.weight"])
    return out


def _successors(scripts: Sequence[Sequence[int]]) -> dict[int, int]:
    successor: dict[int, int] = {}
    for script in scripts:
        for token, following in itertools.pairwise(script):
            if successor.setdefault(token, following) != following:
                raise InvalidRequestError(
                    f"token {token} is followed by both {successor[token]} and {following}: "
                    "a script may use a token only with one successor"
                )
    return successor
