"""Sessions found by content, history sent back rewritten, the Responses API's translations and
features the engines cannot serve: the gateway's pure logic over a ``FakeEngine``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncroll import AsyncServerManager
from asyncroll.gateway import ChatRequestError, Gateway, HFChatRenderer
from asyncroll.gateway.chat import assistant_reply, message_key
from asyncroll.gateway.matching import Recorded, matches
from asyncroll.gateway.responses import chat_body, input_messages
from asyncroll.gateway.session import Session
from asyncroll.testing import make_tiny_model
from asyncroll.testing.fake_engine import FakeEngine
from asyncroll.types import TokenOutput

PARAMS: dict[str, Any] = {"model": "m", "max_tokens": 6, "temperature": 1.0}
CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
        "function": {"name": "clock", "arguments": "{}"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sessions-model"), seed=0)


@pytest.fixture
async def gateway(model: Path) -> AsyncIterator[Gateway]:
    engine = FakeEngine(vocab_size=512, max_model_len=4096)
    async with AsyncServerManager([engine]) as manager:
        yield Gateway(manager, HFChatRenderer(model), model="m")


async def _turn(gateway: Gateway, messages: list[dict[str, Any]], **kwargs: Any
                ) -> tuple[str, dict[str, Any], bool]:
    _, session, _, reply, fork = await gateway.chat({**PARAMS, "messages": messages}, **kwargs)
    return session.id, reply.message(), fork


async def test_conversations_on_the_plain_url_find_their_own_sessions(gateway: Gateway) -> None:
    a: list[dict[str, Any]] = [{"role": "system", "content": "S"},
                               {"role": "user", "content": "task A"}]
    b: list[dict[str, Any]] = [{"role": "system", "content": "S"},
                               {"role": "user", "content": "task B"}]
    ids = {}
    for turn in range(3):  # interleaved: A, B, A, B, A, B
        for name, messages in (("a", a), ("b", b)):
            session_id, reply, fork = await _turn(gateway, messages)
            assert not fork
            assert ids.setdefault(name, session_id) == session_id, (name, turn)
            messages += [reply, {"role": "user", "content": f"more {turn}"}]
    assert ids["a"] != ids["b"] and sorted(gateway.auto_session_ids()) == sorted(ids.values())
    for session_id in ids.values():
        result = await gateway.finish_session(session_id)
        assert result.num_forks == 0 and result.trajectories[0].num_turns == 3
    assert gateway.statistics().num_forks == 0


async def test_a_named_session_wins_and_a_shorter_history_is_a_new_conversation(
    gateway: Gateway
) -> None:
    first: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    owner, reply, _ = await _turn(gateway, first)
    other = gateway.open_session().id
    longer = [*first, reply, {"role": "user", "content": "next"}]
    named, _, _ = await _turn(gateway, longer, session_id=other)
    assert named == other
    again, _, _ = await _turn(gateway, first)  # extends no record: a conversation of its own
    assert again not in (owner, other)
    continued, _, fork = await _turn(gateway, longer)
    assert (continued, fork) == (owner, False)


async def test_sessions_with_the_same_record_are_continued_one_each(gateway: Gateway) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "same task"}]
    one, reply_one, _ = await _turn(gateway, messages)
    two, reply_two, _ = await _turn(gateway, messages)
    assert one != two and reply_one == reply_two  # the fake engine's tokens follow the prompt
    follow = [*messages, reply_one, {"role": "user", "content": "then"}]
    first, _, _ = await _turn(gateway, follow)
    second, _, _ = await _turn(gateway, follow)
    assert (first, second) == (one, two)  # the one idle longest first


async def test_no_auto_sessions_means_no_search(model: Path) -> None:
    async with AsyncServerManager([FakeEngine()]) as manager:
        gateway = Gateway(manager, HFChatRenderer(model), model="m", auto_sessions=False)
        with pytest.raises(ChatRequestError, match="name a session"):
            await gateway.chat({**PARAMS, "messages": [{"role": "user", "content": "x"}]})


def _recorded_reply(content: str | None, raw: str, calls: list[dict[str, Any]]) -> Recorded:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return Recorded.of(message, raw)


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ({"role": "assistant", "content": "Looking.\nCalling tools:\n[{'id': "
          "'call_0123456789abcdef01234567', 'type': 'function', 'function': {'name': 'clock', "
          "'arguments': {}}}]"}, True),
        ({"role": "assistant",
          "content": "Looking.   Calling tools: call_0123456789abcdef01234567"}, True),
        ({"role": "assistant", "content": "Calling tools: call_0123456789abcdef01234567"}, False),
        ({"role": "assistant", "content": "Looking. Calling tools: call_other"}, False),
        ({"role": "user", "content": "Looking. call_0123456789abcdef01234567"}, False),
        ({"role": "assistant", "content": "Looking.", "tool_calls": [
            {**CALL, "function": {"name": "clock", "arguments": '{ }'}}]}, True),
    ],
)
def test_a_reply_with_calls_matches_its_copies_as_text(sent: dict[str, Any],
                                                       expected: bool) -> None:
    recorded = _recorded_reply("Looking.", "Looking.<tool_call>{}</tool_call>", [CALL])
    assert matches(sent, message_key(sent), recorded) is expected


def test_a_reply_without_calls_matches_whitespace_and_its_stop_string() -> None:
    recorded = _recorded_reply("x = 1\nprint(x)", "x = 1\nprint(x)\n</code>", [])
    for text, expected in [("x = 1\nprint(x)", True), ("  x = 1 print(x) ", True),
                           ("x = 1\nprint(x)</code>", True), ("x = 1\nprint(x) </code>", True),
                           ("x = 2\nprint(x)", False), ("x = 1", False)]:
        sent = {"role": "assistant", "content": text}
        assert matches(sent, message_key(sent), recorded) is expected, text
    user = {"role": "user", "content": "a  b\n"}
    assert matches(user, message_key(user), Recorded.of({"role": "user", "content": "a b"}))


def _output(renderer: HFChatRenderer, text: str) -> TokenOutput:
    tokens = (*renderer.encode(text), 1)
    return TokenOutput(request_id="r", token_ids=tokens, log_probs=(-0.5,) * len(tokens),
                       global_steps=(1,) * len(tokens), finish_reason="stop", num_preempted=0,
                       engines=("e",), num_prompt_tokens=0, num_cached_tokens=0)


def test_history_sent_back_rewritten_does_not_fork(model: Path) -> None:
    """As smolagents sends it: the call as text after the content, the result as a user turn."""
    renderer = HFChatRenderer(model)
    session = Session("s", renderer, budget=4096)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "time?"}]
    turn = session.prepare(messages, None)
    output = _output(renderer, 'Looking.<tool_call>{"name": "clock"}</tool_call>')
    reply = assistant_reply(session.reply_text(output.token_ids), tools=True)
    session.commit(turn, output, reply, seconds=0.0)
    (call,) = reply.tool_calls
    rewritten = f"Looking.\nCalling tools:\n[{{'id': '{call['id']}', 'function': 'clock'}}]"
    messages += [{"role": "assistant", "content": rewritten},
                 {"role": "user", "content": "Observation:\n12:00"}]
    assert not session.prepare(messages, None).fork
    messages[1]["content"] = rewritten.replace(call["id"], "call_someone_else")
    assert session.prepare(messages, None).fork  # a mutant matching without the id fails here


def test_responses_items_become_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": "{}",
            "id": "fc_1"}
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "time?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        {"type": "message", "role": "assistant", "content": "A"},
        {"type": "message", "role": "assistant", "content": "B"},
    ])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant",
                                             "assistant"]
    assert messages[1]["content"] == "Looking."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    call_ = chat_body({"model": "m", "instructions": "Be brief.", "input": "hi",
                       "max_output_tokens": 5, "text": {"format": {"type": "json_object"}},
                       "reasoning": {"effort": "low"}, "store": False})
    assert call_.instructions == [{"role": "system", "content": "Be brief."}]
    assert call_.chat == {"model": "m", "max_tokens": 5,
                          "response_format": {"type": "json_object"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content"),
        ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": 5}, "input"),
    ],
)
def test_responses_refuse_what_they_cannot_carry(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatRequestError) as caught:
        chat_body(body)
    assert caught.value.param == param and caught.value.status == 400


async def test_an_unknown_previous_response_is_404(gateway: Gateway) -> None:
    with pytest.raises(ChatRequestError) as caught:
        await gateway.respond({"model": "m", "input": "x", "previous_response_id": "resp_x"})
    assert (caught.value.status, caught.value.code) == (404, "previous_response_not_found")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["x"]}, "stop"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "tools": [{"type": "function",
                                                 "function": {"name": "f"}}]}, "tool_choice"),
    ],
)
async def test_features_engines_without_a_tokenizer_cannot_serve_are_refused_first(
    model: Path, extra: dict[str, Any], param: str
) -> None:
    engine = FakeEngine(max_model_len=4096)
    async with AsyncServerManager([engine]) as manager:
        gateway = Gateway(manager, HFChatRenderer(model), model="m")
        body = {**PARAMS, "messages": [{"role": "user", "content": "x"}], **extra}
        with pytest.raises(ChatRequestError, match="need engines with a tokenizer") as caught:
            await gateway.chat(body)
        assert caught.value.param == param
        assert engine.statistics().num_requests == 0 and gateway.statistics().open_sessions == 0


async def test_a_conversation_longer_than_the_context_is_refused_before_rendering(
    model: Path
) -> None:
    class Counting(HFChatRenderer):
        renders = 0

        def render(self, messages: Any, tools: Any) -> str:
            Counting.renders += 1
            return super().render(messages, tools)

    async with AsyncServerManager([FakeEngine(max_model_len=4096)]) as manager:
        gateway = Gateway(manager, Counting(model), model="m")
        long = "word " * 200_000  # 1 MB: about 6 s of the event loop to render and tokenize
        with pytest.raises(ChatRequestError, match="at least") as caught:
            await gateway.chat({**PARAMS, "messages": [{"role": "user", "content": long}]})
        assert caught.value.code == "context_length_exceeded" and Counting.renders == 0
        await gateway.chat({**PARAMS, "messages": [{"role": "user", "content": "short"}]})
        assert Counting.renders == 1
