"""The shared request checks as pure functions: no engine, no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from asyncroll import InvalidRequestError
from asyncroll.validation import (
    ENGINE_REQUEST_ID_LEN,
    MAX_REQUEST_ID_LEN,
    SAMPLING_KEYS,
    SEED_RANGE,
    check_prompt,
    check_request_id,
    resolve_sampling_params,
)

LIMITS: dict[str, Any] = {
    "prompt_len": 4, "max_model_len": 512, "vocab_size": 512, "has_tokenizer": False
}


def _resolve(params: Any, **limits: Any) -> dict[str, Any]:
    return resolve_sampling_params(params, **{**LIMITS, **limits})


@pytest.mark.parametrize("request_id", ["x", "x@1", "a/b-3", "é ü", "r" * MAX_REQUEST_ID_LEN])
def test_good_request_ids_pass(request_id: str) -> None:
    assert check_request_id(request_id) == request_id


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        (7, "must be a str, got int 7"),
        (None, "must be a str, got NoneType None"),
        (b"x", "must be a str, got bytes"),
        ("", "non-empty"),
        ("a\tb", "printable"),
        ("r" * (MAX_REQUEST_ID_LEN + 1), f"at most {MAX_REQUEST_ID_LEN}"),
    ],
)
def test_bad_request_ids_are_named_with_what_is_allowed(request_id: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_request_id(request_id)


def test_engines_leave_room_for_the_managers_suffix() -> None:
    segment_id = "r" * MAX_REQUEST_ID_LEN + "@123456"
    assert check_request_id(segment_id, max_len=ENGINE_REQUEST_ID_LEN) == segment_id


@pytest.mark.parametrize("prompt", [5, "hello", b"\x05", [], [5, 1.0], [5, True], [5, 512]])
def test_bad_prompts_are_rejected(prompt: Any) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        check_prompt(prompt, vocab_size=512)


def test_defaults_fill_the_context_and_ask_for_the_sampled_log_prob() -> None:
    assert _resolve(None) == {"max_tokens": 508, "logprobs": 0}
    assert _resolve({"max_tokens": None}) == {"max_tokens": 508, "logprobs": 0}


GOOD_EDGES: list[dict[str, Any]] = [
    {"seed": SEED_RANGE[0]},
    {"seed": SEED_RANGE[1]},
    {"seed": -1},
    {"seed": None},
    {"n": 1},
    {"temperature": 0},
    {"temperature": 2.0},
    {"top_p": 1},
    {"top_k": -1},
    {"top_k": 0},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2},
    {"repetition_penalty": 1e-3},
    {"max_tokens": 508, "min_tokens": 508},
    {"ignore_eos": True, "skip_reading_prefix_cache": False},
    {"stop_token_ids": (0, 511)},
    {"allowed_token_ids": [0, 511]},
    {"allowed_token_ids": None},
    {"logit_bias": {0: -100, 511: 100.0}},
]


@pytest.mark.parametrize("params", GOOD_EDGES, ids=repr)
def test_edges_of_every_range_pass_and_vllm_takes_them(params: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    snapshot = dict(params)
    resolved = _resolve(params)
    assert params == snapshot  # the caller's dict is never mutated
    assert "n" not in resolved and resolved["logprobs"] == 0
    assert all(value is not None for value in resolved.values())
    SamplingParams(**resolved, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def test_token_lists_and_biases_come_back_as_vllm_types() -> None:
    resolved = _resolve({"stop_token_ids": (3, 4), "logit_bias": {5: -1}})
    assert resolved["stop_token_ids"] == [3, 4]
    assert resolved["logit_bias"] == {5: -1.0} and isinstance(resolved["logit_bias"][5], float)


def test_every_accepted_key_is_a_vllm_sampling_argument() -> None:
    from vllm import SamplingParams

    assert set(SAMPLING_KEYS) <= set(SamplingParams.__struct_fields__)


@pytest.mark.parametrize(
    "value",
    [{}, {"json": {}, "regex": "a"}, {"json_object": False}, {"jsn": {}}, "json", {"regex": None}],
    ids=repr,
)
def test_structured_outputs_take_exactly_one_constraint(value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"structured_outputs=.* is not allowed"):
        _resolve({"structured_outputs": value}, has_tokenizer=True)


def test_stop_strings_and_structured_outputs_reach_vllm_with_a_tokenizer() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    resolved = _resolve({"stop": ("a", "bc"), "structured_outputs": {
        "json": {"type": "object"}, "disable_any_whitespace": True}}, has_tokenizer=True)
    assert resolved["stop"] == ["a", "bc"]
    structured = StructuredOutputsParams(**resolved.pop("structured_outputs"))
    SamplingParams(**resolved, structured_outputs=structured, detokenize=True)
    with pytest.raises(InvalidRequestError, match="non-empty str"):
        _resolve({"stop": "abc"}, has_tokenizer=True)


def test_words_need_a_tokenizer() -> None:
    with pytest.raises(InvalidRequestError, match="'bad_words' needs a tokenizer"):
        _resolve({"bad_words": ["foo"]})
    assert _resolve({"bad_words": ("foo",)}, has_tokenizer=True)["bad_words"] == ["foo"]
    with pytest.raises(InvalidRequestError, match="non-empty str"):
        _resolve({"bad_words": [""]}, has_tokenizer=True)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("abc", "must be a mapping .* got str 'abc'"),
        ({1: 2}, "keys must be str, got 1"),
        ({"foo": 1}, r"unknown sampling_params key 'foo'; accepted: \['allowed_token_ids'"),
        ({"logprobs": 1}, "may not set 'logprobs': asyncroll sets it"),
        ({"output_kind": 0}, "may not set 'output_kind'"),
        ({"stop": ["x"]}, "'stop' needs a tokenizer .*'stop_token_ids'"),
        ({"include_stop_str_in_output": True}, "needs detokenized text .* 'stop_token_ids'"),
        ({"structured_outputs": {"json_object": True}}, "'structured_outputs' needs a tokenizer"),
        ({"n": 2}, "n=2 is not allowed: n must be 1"),
        ({"n": True}, "n=True is not allowed"),
        ({"seed": 2**70}, r"seed=1180591620717411303424 .* in \[-2\*\*63, 2\*\*64 - 1\]"),
        ({"seed": 2.0}, "seed=2.0 is not allowed"),
        ({"temperature": float("nan")}, r"temperature=nan .* a finite number in \[0, 2\]"),
        ({"temperature": -0.5}, r"temperature=-0.5"),
        ({"top_p": 0}, r"top_p=0 .* \(0, 1\]"),
        ({"top_k": -2}, "top_k=-2 .* an int >= -1"),
        ({"min_p": float("inf")}, "min_p=inf"),
        ({"repetition_penalty": -1}, "repetition_penalty=-1 .* a finite number > 0"),
        ({"presence_penalty": "high"}, "presence_penalty='high'"),
        ({"max_tokens": 0}, "max_tokens=0 .* a positive int"),
        ({"max_tokens": 509}, r"prompt \(4 tokens\) \+ max_tokens \(509\) exceeds"),
        ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens=9 .* at most max_tokens \(8\)"),
        ({"min_tokens": None}, "min_tokens=None"),
        ({"ignore_eos": "yes"}, "ignore_eos='yes' .* a bool"),
        ({"stop_token_ids": [512]}, r"stop_token_ids holds 512: .* vocabulary \[0, 512\)"),
        ({"stop_token_ids": 5}, "stop_token_ids=5 .* a list of token ids"),
        ({"allowed_token_ids": []}, r"allowed_token_ids=\[\] .* non-empty"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids holds True"),
        ({"logit_bias": {600: 1.0}}, "logit_bias holds 600: .* vocabulary"),
        ({"logit_bias": {5: float("-inf")}}, r"logit_bias\[5\]=-inf .* \[-100, 100\]"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\]=101"),
    ],
)
def test_bad_sampling_params_name_the_key_the_value_and_what_is_allowed(
    params: Any, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        _resolve(params)


def test_a_prompt_that_fills_the_context_leaves_no_room() -> None:
    with pytest.raises(InvalidRequestError, match="leaves no room"):
        _resolve({}, prompt_len=512)


def test_huge_values_are_cut_in_messages() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _resolve({"stop_token_ids": "x" * 10_000})
    assert len(str(caught.value)) < 300
