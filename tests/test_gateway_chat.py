"""The gateway's pure parts: request checks, reply parsing, session bookkeeping (no engine).

The session tests feed synthetic outputs to a ``Session`` over the tiny model's real tokenizer;
the engine-backed tests are in test_gateway.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncroll.gateway import ChatRequestError, HFChatRenderer
from asyncroll.gateway.chat import assistant_reply, message_key, parse_chat_request
from asyncroll.gateway.session import Session
from asyncroll.testing import REASONING_DROPPING_TEMPLATE, make_tiny_model
from asyncroll.types import TokenOutput

OK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("chat-model"), seed=0)


def test_a_request_maps_to_sampling_params() -> None:
    request = parse_chat_request(
        {**OK, "max_completion_tokens": 5, "temperature": 0.5, "seed": 3, "user": "u",
         "stream": True, "stream_options": {"include_usage": True}},
        models=["m"],
    )
    assert request.sampling_params == {"max_tokens": 5, "temperature": 0.5, "seed": 3}
    assert request.stream and request.include_usage and request.tools is None


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ([], 400, None),
        ({**OK, "model": "other"}, 404, "model"),
        ({**OK, "n": 3}, 400, "n"),
        ({**OK, "stop": 5}, 400, "stop"),
        ({**OK, "stop": ["s"] * 17 + [str(i) for i in range(17)]}, 400, "stop"),
        ({**OK, "logit_bias_typo": 1}, 400, "logit_bias_typo"),
        ({**OK, "tool_choice": {"type": "function"}}, 400, "tool_choice"),
        ({**OK, "response_format": {"type": "xml"}}, 400, "response_format"),
        ({**OK, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
         "response_format"),
        ({**OK, "tool_choice": "required"}, 400, "tool_choice"),
        ({**OK, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
        ({**OK, "stream": "yes"}, 400, "stream"),
        ({**OK, "messages": "hi"}, 400, "messages"),
        ({**OK, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ({**OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content"),
        ({**OK, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ],
)
def test_bad_requests_name_their_parameter(body: Any, status: int, param: str | None) -> None:
    with pytest.raises(ChatRequestError) as caught:
        parse_chat_request(body, models=["m"])
    assert caught.value.status == status and caught.value.param == param
    assert caught.value.body()["error"]["message"]


def test_tool_choice_none_hides_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_chat_request({**OK, "tools": tools, "tool_choice": "none"},
                              models=["m"]).tools is None


def test_reply_splits_reasoning_content_and_calls() -> None:
    reply = assistant_reply(
        '<think>\nhmm\n</think>\nSure.<tool_call>{"name": "add", "arguments": {"a": 1}}'
        '</tool_call><tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>',
        tools=True,
    )
    assert reply.reasoning == "hmm" and reply.content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in reply.tool_calls] == [("add", {"a": 1}), ("f", {"x": 2})]
    assert len({c["id"] for c in reply.tool_calls}) == 2


def test_unreadable_calls_stay_text_and_no_tools_means_no_calls() -> None:
    text = 'a<tool_call>{"name": </tool_call>b<tool_call>{"name": "ok"}</tool_call>'
    reply = assistant_reply(text, tools=True)
    assert reply.content == 'a<tool_call>{"name": </tool_call>b'
    assert [c["function"]["name"] for c in reply.tool_calls] == ["ok"]
    assert assistant_reply(text, tools=False).content == text


def test_message_key_compares_arguments_as_json() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    spaced = {**call, "function": {"name": "f", "arguments": '{ "a" : 1 }'}}
    one = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert message_key(one) == message_key({**one, "content": "", "tool_calls": [spaced]})
    assert message_key(one) != message_key({**one, "content": "x"})


def _output(tokens: list[int], steps: int = 1) -> TokenOutput:
    return TokenOutput(
        request_id="r", token_ids=tuple(tokens), log_probs=(-0.5,) * len(tokens),
        global_steps=(steps,) * len(tokens), finish_reason="stop", num_preempted=0,
        engines=("e",), num_prompt_tokens=0, num_cached_tokens=0,
    )


def _turn(session: Session, messages: list[dict[str, Any]], generated: str, steps: int = 1
          ) -> dict[str, Any]:
    renderer = session.renderer
    turn = session.prepare(messages, None)
    output = _output([*renderer.encode(generated), 1], steps)
    reply = assistant_reply(session.reply_text(output.token_ids), tools=False)
    session.commit(turn, output, reply, seconds=0.0)
    return reply.message()


def test_turns_append_only_the_new_suffix(model: Path) -> None:
    renderer = HFChatRenderer(model)
    session = Session("s", renderer, budget=1024)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages.append(_turn(session, messages, "hello there"))
    messages.append({"role": "user", "content": "again"})
    prepared = session.prepare(messages, None)
    assert not prepared.fork
    assert renderer.decode(prepared.suffix_ids) == (
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    messages.append(_turn(session, messages, "ok", steps=2))
    (trajectory,) = session.result(0.5).trajectories
    assert renderer.decode(trajectory.response_ids) == (
        "hello there<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        "ok<|im_end|>")
    assert trajectory.global_steps[-1] == 2 and trajectory.reward == 0.5


def test_a_prepared_turn_changes_nothing_until_committed(model: Path) -> None:
    session = Session("s", HFChatRenderer(model), budget=1024)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages.append(_turn(session, messages, "yes"))
    before = session.result(None)
    session.prepare([*messages, {"role": "user", "content": "never sent"}], None)
    assert session.result(None) == before
    stale = session.prepare([*messages, {"role": "user", "content": "a"}], None)
    messages.append({"role": "user", "content": "b"})
    _turn(session, messages, "no")
    with pytest.raises(RuntimeError):
        session.commit(stale, _output([5]), assistant_reply("x", tools=False), seconds=0.0)


def test_drift_forks_and_keeps_both_trajectories_exact(model: Path) -> None:
    renderer = HFChatRenderer(model, chat_template=REASONING_DROPPING_TEMPLATE)
    session = Session("s", renderer, budget=1024)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages.append(_turn(session, messages, "<think>secret</think>answer"))
    messages.append({"role": "user", "content": "next"})
    messages.append(_turn(session, messages, "fine"))
    assert session.num_forks == 1
    first, second = session.result(None).trajectories
    assert renderer.decode(first.response_ids) == "<think>secret</think>answer<|im_end|>"
    assert "secret" not in renderer.decode(second.prompt_ids)
    assert list(second.response_mask) == [1] * len(second.response_ids)


def test_an_edited_assistant_turn_is_rendered_as_sent(model: Path) -> None:
    session = Session("s", HFChatRenderer(model), budget=1024)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages.append({**_turn(session, messages, "original"), "content": "edited"})
    messages.append({"role": "user", "content": "next"})
    prepared = session.prepare(messages, None)
    assert prepared.fork
    assert "edited" in session.renderer.decode(prepared.prompt_ids)


def test_an_empty_turn_round_trips() -> None:
    reply = assistant_reply("", tools=True)
    assert reply.message() == {"role": "assistant", "content": ""}
    echoed = {"role": "assistant"}  # a client dropping the empty content
    request = parse_chat_request({**OK, "messages": [*OK["messages"], echoed]}, models=["m"])
    assert message_key(request.messages[1]) == message_key(reply.message())


def test_null_means_not_given_and_logit_bias_keys_become_ids() -> None:
    request = parse_chat_request(
        {**OK, "n": None, "tool_choice": None, "temperature": None, "logit_bias": {"5": 1.0}},
        models=["m"],
    )
    assert request.sampling_params == {"logit_bias": {5: 1.0}}


def test_two_replies_that_read_the_same_keep_their_own_tokens(model: Path) -> None:
    session = Session("s", HFChatRenderer(model), budget=1024)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = _turn(session, messages, "<think>a</think>OK")
    messages += [{"role": "assistant", "content": first["content"]},  # reasoning dropped
                 {"role": "user", "content": "again"}]
    second = _turn(session, messages, "<think>b</think>OK")
    messages += [{"role": "assistant", "content": second["content"]},
                 {"role": "user", "content": "more"}]
    prepared = session.prepare(messages, None)
    assert not prepared.fork
    text = session.renderer.decode(prepared.prompt_ids)
    assert text.index("<think>a</think>") < text.index("<think>b</think>")


@pytest.mark.parametrize(
    "options",
    [{"model": ""}, {"model": "m", "max_sessions": 0}, {"model": "m", "max_sessions": True},
     {"model": "m", "auto_session_idle_s": -1}],
)
def test_a_gateway_refuses_bad_options(model: Path, options: dict[str, Any]) -> None:
    from asyncroll import AsyncServerManager, InvalidRequestError
    from asyncroll.gateway import Gateway
    from asyncroll.testing import FakeEngine

    manager = AsyncServerManager([FakeEngine()])
    with pytest.raises(InvalidRequestError):
        Gateway(manager, HFChatRenderer(model), **options)
