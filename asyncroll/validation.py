"""Checks that run before a request or an update reaches an engine: the one place that says what
is valid.

Every check here is pure and synchronous. A request that fails one raises
``InvalidRequestError`` naming the parameter, the value and what is allowed, and never reaches
vLLM: a bad token id kills a vLLM EngineCore and every request on it; a value vLLM cannot carry
to its EngineCore (an int request id, a seed past 64 bits) fails only after vLLM registered the
request, which then stays unfinished inside vLLM or hangs its caller.

Invariants:
- ``resolve_sampling_params`` never mutates the caller's mapping; it returns a fresh dict that
  ``vllm.SamplingParams`` accepts.
- Only keys in ``SAMPLING_KEYS`` pass; the adapter owns ``logprobs``, ``detokenize``,
  ``output_kind`` and ``n`` (which may only be 1).
- Engines run token-in/token-out (``detokenize=False``): nothing else that needs detokenized
  text is accepted, and nothing that needs a tokenizer unless the engine has one (``stop``
  strings, which the adapter detokenizes for, ``structured_outputs`` and ``bad_words``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncroll.errors import InvalidRequestError
from asyncroll.interfaces import RESUME_MODES, ResumeMode

__all__ = [
    "ENGINE_REQUEST_ID_LEN",
    "MAX_GLOBAL_STEPS",
    "MAX_REQUEST_ID_LEN",
    "SAMPLING_KEYS",
    "SEED_RANGE",
    "check_commit",
    "check_global_steps",
    "check_prompt",
    "check_request_id",
    "check_resume_mode",
    "check_take",
    "claimed",
    "refuse_live",
    "resolve_sampling_params",
]

MAX_REQUEST_ID_LEN = 256
"""The longest request id a caller may pass."""

ENGINE_REQUEST_ID_LEN = MAX_REQUEST_ID_LEN + 32
"""The longest request id an engine accepts: room for the ``@<attempt>`` a manager appends."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds vLLM carries to its EngineCore (msgpack int64/uint64) and torch accepts; -1 means
unseeded. Measured on vLLM 0.32 CPU: a seed outside fails after vLLM registered the request."""

_OWNED_KEYS = frozenset({"logprobs", "detokenize", "output_kind"})
"""Sampling keys the adapter sets itself: its own log prob, token ids only, final output only."""

_TEXT_KEYS = frozenset(
    {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"}
)
"""Keys about detokenized text, which token-in/token-out engines never produce."""

_TOKENIZER_KEYS = frozenset({"bad_words", "stop", "structured_outputs"})
"""Keys vLLM resolves with the engine's tokenizer (ignored or failing without one)."""

STRUCTURED_OUTPUT_KINDS = frozenset(
    {"json", "json_object", "regex", "choice", "grammar", "structural_tag"}
)
"""The constraints of ``structured_outputs`` (vLLM's ``StructuredOutputsParams``): exactly one."""

_STRUCTURED_OPTIONS = frozenset(
    {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
)


@dataclass(frozen=True, slots=True)
class _Limits:
    vocab_size: int
    has_tokenizer: bool


_Check = Callable[[str, Any, _Limits], Any]
"""Checks one sampling argument and returns the value to pass to vLLM."""


MAX_GLOBAL_STEPS = 2**63 - 1
"""Versions travel as signed 64-bit integers (msgpack to the workers)."""


def check_global_steps(global_steps: object) -> int | None:
    """Return ``global_steps`` if it is None or a non-negative int vLLM can carry, else raise."""
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int):
        raise InvalidRequestError(
            f"global_steps must be an int or None, not {type(global_steps).__name__} "
            f"({global_steps!r})"
        )
    if not 0 <= global_steps <= MAX_GLOBAL_STEPS:
        raise InvalidRequestError(
            f"global_steps must be in [0, 2**63 - 1], got {global_steps}"
        )
    return global_steps


def check_resume_mode(mode: object, *, what: str = "mode") -> ResumeMode:
    """Return ``mode`` if it is a ``ResumeMode``, else raise ``InvalidRequestError``."""
    if mode not in RESUME_MODES:
        raise InvalidRequestError(f"{what} must be one of {', '.join(RESUME_MODES)}, not {mode!r}")
    return mode


def check_take(version: object, push: object, mode: object) -> ResumeMode:
    """The arguments of a weight port's ``take``: ``version`` a ``global_steps`` or -1 (the
    label stays), ``push`` a sender's push id (0: the next), ``mode`` a ``ResumeMode``;
    returns the mode, else raises ``InvalidRequestError``."""
    if version != -1:
        check_global_steps(version)
    if isinstance(push, bool) or not isinstance(push, int) or not 0 <= push <= MAX_GLOBAL_STEPS:
        raise InvalidRequestError(f"push must be a push id (an int >= 0), not {push!r}")
    return check_resume_mode(mode)


def check_commit(global_steps: object, current: int | None, *, engine: str) -> int | None:
    """The argument of a weight port's ``commit``: a ``global_steps`` (or None: the label
    stays) no lower than the engine's ``current``; else ``InvalidRequestError``."""
    checked = check_global_steps(global_steps)
    if checked is not None and current is not None and checked < current:
        raise InvalidRequestError(
            f"global_steps {checked} is lower than {engine}'s {current}: versions never go"
            " backwards"
        )
    return checked


def check_request_id(request_id: object, *, max_len: int = MAX_REQUEST_ID_LEN) -> str:
    """Return ``request_id`` if it is a non-empty printable str of at most ``max_len`` chars."""
    if not isinstance(request_id, str):
        raise InvalidRequestError(
            f"request_id must be a str, got {type(request_id).__name__} {_show(request_id)}"
        )
    if not request_id:
        raise InvalidRequestError("request_id must be a non-empty str, got ''")
    if len(request_id) > max_len:
        raise InvalidRequestError(
            f"request_id {_show(request_id)} has {len(request_id)} characters; at most "
            f"{max_len} are allowed"
        )
    if not request_id.isprintable():
        raise InvalidRequestError(
            f"request_id {_show(request_id)} must hold printable characters only"
        )
    return request_id


@contextlib.contextmanager
def claimed(live: set[str], request_id: str) -> Iterator[None]:
    """``request_id`` is live for the duration (``refuse_live`` refuses it meanwhile). Call
    ``refuse_live`` first, in the same step: the exit forgets the id whoever claimed it."""
    live.add(request_id)
    try:
        yield
    finally:
        live.discard(request_id)


def refuse_live(request_id: str, live: Container[str]) -> None:
    """Raise if a call still running holds ``request_id``. An engine or manager checks and
    claims an id at a call's first step, before any await, so that of two calls with one id
    the second is refused however the calls interleave after that (a Ray actor may run its
    calls in any order)."""
    if request_id in live:
        raise InvalidRequestError(f"request id {request_id!r} is already live")


def check_prompt(prompt_ids: Sequence[int], *, vocab_size: int) -> list[int]:
    """Return the prompt as a list of ints, or raise if an engine could not serve it."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise InvalidRequestError(
            f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}"
        )
    ids = list(prompt_ids)
    if not ids:
        raise InvalidRequestError("prompt_ids is empty")
    # One pass in C each for the types, the least and the greatest id: a resumed request's
    # prompt (its partial output appended) is checked again at every resume, 256 of them at
    # once after an ``abort`` update (68 us against 180 us for the loop below on 1500 ids; the
    # loop is what names the culprit).
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return ids
    for position, token in enumerate(ids):
        if not _is_int(token):
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
    has_tokenizer: bool,
) -> dict[str, Any]:
    """Return a fresh dict of sampling arguments for one request; never mutates ``params``.

    Args:
        params: The caller's sampling arguments: keys from ``SAMPLING_KEYS``; None is {}.
        prompt_len: Tokens in the prompt (``max_tokens`` defaults to the rest of the context).
        max_model_len: The engine's context length.
        vocab_size: Token ids must be in ``[0, vocab_size)``.
        has_tokenizer: Whether the engine loaded a tokenizer (``bad_words`` needs one).

    Returns:
        The arguments with ``max_tokens`` set and ``logprobs=0`` (the sampled token's).

    Raises:
        InvalidRequestError: a key or value vLLM would reject, ignore or fail on.
    """
    limits = _Limits(vocab_size=vocab_size, has_tokenizer=has_tokenizer)
    resolved = {
        key: _FIELDS[key](key, value, limits)
        for key, value in _checked_keys(params, limits).items()
        if value is not None or key not in _OPTIONAL
    }
    resolved.pop("n", None)
    resolved["max_tokens"] = _max_tokens(resolved.get("max_tokens"), prompt_len, max_model_len)
    min_tokens = resolved.get("min_tokens", 0)
    if min_tokens > resolved["max_tokens"]:
        raise _bad("min_tokens", min_tokens, f"at most max_tokens ({resolved['max_tokens']})")
    resolved["logprobs"] = 0
    return resolved


def _checked_keys(params: object, limits: _Limits) -> Mapping[str, Any]:
    """The caller's mapping, once every key in it is one a caller may set on this engine."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidRequestError(
            f"sampling_params must be a mapping of vLLM sampling arguments or None, got "
            f"{type(params).__name__} {_show(params)}"
        )
    for key in params:
        if not isinstance(key, str):
            raise InvalidRequestError(f"sampling_params keys must be str, got {_show(key)}")
        _check_key(key, limits)
    return params


def _check_key(key: str, limits: _Limits) -> None:
    if key in _OWNED_KEYS:
        raise InvalidRequestError(f"sampling_params may not set {key!r}: asyncroll sets it")
    if key in _TEXT_KEYS:
        raise InvalidRequestError(
            f"sampling_params may not set {key!r}: it needs detokenized text and asyncroll "
            "engines run token-in/token-out (stop on tokens with 'stop_token_ids')"
        )
    if key not in _FIELDS:
        raise InvalidRequestError(
            f"unknown sampling_params key {key!r}; accepted: {sorted(SAMPLING_KEYS)}"
        )
    if key in _TOKENIZER_KEYS and not limits.has_tokenizer:
        raise InvalidRequestError(
            f"sampling_params {key!r} needs a tokenizer and this engine has none "
            "(skip_tokenizer_init, or a model folder without tokenizer files): start the engine "
            "with its tokenizer, or pass token ids instead ('stop_token_ids', 'logit_bias')"
        )


def _max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) leaves no room in the context length {max_model_len}"
        )
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"length {max_model_len}"
        )
    return room if max_tokens is None else max_tokens


# -- one check per sampling argument ---------------------------------------------------------


def _real(low: float, high: float, *, open_low: bool = False) -> _Check:
    """A finite number in [low, high] (or (low, high] with ``open_low``)."""
    if high == math.inf:
        allowed = f"a finite number {'>' if open_low else '>='} {low:g}"
    else:
        allowed = f"a finite number in {'(' if open_low else '['}{low:g}, {high:g}]"

    def check(key: str, value: Any, limits: _Limits) -> float:
        number = _finite(key, value, allowed)
        if not (low < number if open_low else low <= number) or number > high:
            raise _bad(key, value, allowed)
        return number

    return check


def _integer(low: int, high: float = math.inf, *, allowed: str = "") -> _Check:
    """An int (not a bool) in [low, high]."""
    if not allowed:
        allowed = f"an int >= {low}" if high == math.inf else f"an int in [{low}, {high}]"

    def check(key: str, value: Any, limits: _Limits) -> int:
        if not (_is_int(value) and low <= value <= high):
            raise _bad(key, value, allowed)
        return int(value)

    return check


def _flag(key: str, value: Any, limits: _Limits) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "a bool")
    return value


def _token_ids(*, non_empty: bool = False) -> _Check:
    """A list of token ids in the vocabulary."""

    def check(key: str, value: Any, limits: _Limits) -> list[int]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise _bad(key, value, "a list of token ids")
        if non_empty and not value:
            raise _bad(key, value, "a non-empty list of token ids (None allows every token)")
        for token in value:
            _check_token(key, token, limits.vocab_size)
        return list(value)

    return check


def _logit_bias(key: str, value: Any, limits: _Limits) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise _bad(key, value, "a mapping of token id to a bias in [-100, 100]")
    for token in value:
        _check_token(key, token, limits.vocab_size)
    return {token: _bias(f"{key}[{token}]", amount, limits) for token, amount in value.items()}


def _words(key: str, value: Any, limits: _Limits) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _bad(key, value, "a list of non-empty str")
    if not all(isinstance(word, str) and word for word in value):
        raise _bad(key, value, "a list of non-empty str")
    return list(value)


def _structured(key: str, value: Any, limits: _Limits) -> dict[str, Any]:
    """One constraint (``STRUCTURED_OUTPUT_KINDS``) and vLLM's options; the engine checks the
    constraint itself (a schema or grammar it cannot compile is its ``InvalidRequestError``)."""
    allowed = f"a mapping of one of {sorted(STRUCTURED_OUTPUT_KINDS)} (and options)"
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise _bad(key, value, allowed)
    kinds = [name for name in value if name in STRUCTURED_OUTPUT_KINDS and value[name] is not None]
    unknown = set(value) - STRUCTURED_OUTPUT_KINDS - _STRUCTURED_OPTIONS
    if len(kinds) != 1 or unknown:
        raise _bad(key, value, allowed)
    if value.get("json_object") not in (None, True):
        raise _bad(key, value, "json_object=True where given")
    return dict(value)


def _check_token(key: str, token: Any, vocab_size: int) -> None:
    if not (_is_int(token) and 0 <= token < vocab_size):
        raise InvalidRequestError(
            f"sampling_params {key} holds {_show(token)}: its token ids must be ints in the "
            f"vocabulary [0, {vocab_size})"
        )


_MAX_BIAS = 100.0
"""The largest logit bias magnitude (vLLM's OpenAI API clamps to it; more only overflows)."""

_bias = _real(-_MAX_BIAS, _MAX_BIAS)

_FIELDS: dict[str, _Check] = {
    "n": _integer(1, 1, allowed="1: issue one generate call per sample"),
    "temperature": _real(0.0, 2.0),
    "top_p": _real(0.0, 1.0, open_low=True),
    "top_k": _integer(-1, allowed="an int >= -1 (0 or -1: every token)"),
    "min_p": _real(0.0, 1.0),
    "presence_penalty": _real(-2.0, 2.0),
    "frequency_penalty": _real(-2.0, 2.0),
    "repetition_penalty": _real(0.0, math.inf, open_low=True),
    "seed": _integer(*SEED_RANGE, allowed="an int in [-2**63, 2**64 - 1] (-1: unseeded)"),
    "max_tokens": _integer(1, allowed="a positive int"),
    "min_tokens": _integer(0),
    "ignore_eos": _flag,
    "skip_reading_prefix_cache": _flag,
    "stop_token_ids": _token_ids(),
    "allowed_token_ids": _token_ids(non_empty=True),
    "logit_bias": _logit_bias,
    "bad_words": _words,
    "stop": _words,
    "structured_outputs": _structured,
}
"""The ``vllm.SamplingParams`` arguments a caller may set, each with its check. Ranges are
vLLM's own (``SamplingParams._verify_args``, which caps temperature at 2 in 0.32, and the input
processor's vocabulary checks); the rest need text, a tokenizer, engine features asyncroll does not
start, or return what a ``Segment`` does not carry."""

_OPTIONAL = frozenset(
    {"seed", "max_tokens", "stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words",
     "skip_reading_prefix_cache", "stop", "structured_outputs"}
)
"""Keys where None means vLLM's default (the key is then dropped)."""

SAMPLING_KEYS = frozenset(_FIELDS)
"""The sampling arguments a caller may pass (``bad_words``, ``stop`` and ``structured_outputs``
only to an engine with a tokenizer)."""


def _finite(key: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, value, allowed)
    return float(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(key: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"sampling_params {key}={_show(value)} is not allowed: {key} must be {allowed}"
    )


def _show(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters, so a huge value cannot flood a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"
