"""Checks that run before a request reaches an engine.

Every check here is pure and synchronous. A request that fails one raises
``InvalidRequestError`` and never reaches vLLM: a bad token id, for one, kills a vLLM EngineCore
and every request on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncroll.errors import InvalidRequestError

__all__ = ["check_prompt", "resolve_sampling_params"]

_OWNED_KEYS = frozenset({"logprobs", "n", "detokenize", "output_kind"})
"""Sampling keys the adapter sets itself: one sample, its own log prob, token ids only."""


def check_prompt(prompt_ids: Sequence[int], *, vocab_size: int) -> list[int]:
    """Return the prompt as a list of ints, or raise if an engine could not serve it."""
    if isinstance(prompt_ids, (str, bytes)):
        raise InvalidRequestError("prompt_ids must be a sequence of token ids, not text")
    ids = list(prompt_ids)
    if not ids:
        raise InvalidRequestError("prompt_ids is empty")
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError(
                f"prompt_ids[{position}] is {type(token).__name__}, not int"
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"prompt_ids[{position}] = {token} is outside the vocabulary [0, {vocab_size})"
            )
    return ids


def resolve_sampling_params(
    params: Mapping[str, Any] | None,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
) -> dict[str, Any]:
    """Return a fresh dict of sampling arguments for one request; never mutates ``params``.

    ``max_tokens`` defaults to the rest of the context. The result asks for the sampled token's
    log prob at every position.
    """
    resolved = dict(params or {})
    owned = sorted(_OWNED_KEYS & resolved.keys() - {"n"})
    if owned:
        raise InvalidRequestError(f"sampling_params may not set {owned}: asyncroll sets them")
    if resolved.pop("n", 1) != 1:
        raise InvalidRequestError("sampling_params n must be 1: issue one generate call a sample")
    room = max_model_len - prompt_len
    max_tokens = resolved.get("max_tokens")
    if max_tokens is None:
        max_tokens = room
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"length {max_model_len}"
        )
    for key in ("stop_token_ids", "bad_words_token_ids"):
        for token in resolved.get(key) or ():
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise InvalidRequestError(f"{key} holds {token!r}, outside the vocabulary")
    resolved["max_tokens"] = max_tokens
    resolved["logprobs"] = 0
    return resolved
