"""The OpenAI gateway against the real vLLM CPU engine, driven by the official ``openai`` client.

The shared engine serves "scripted" weights here (``asyncroll.testing.scripted``): greedily, the
model answers every prompt with a reasoning block and a Hermes call of the ``clock`` tool, so a
real engine produces real tool calls. The module puts model A's weights back when it is done.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_helpers import HANG, hold, load_weights, until_decoding

from asyncroll import AsyncServerManager, TokenOutput, VLLMEngine
from asyncroll.agent_loop import Sample
from asyncroll.gateway import Gateway, GatewaySession, GatewaySource, HFChatRenderer, open_gateway
from asyncroll.testing import REASONING_DROPPING_TEMPLATE
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late
from asyncroll.testing.scripted import scripted_weights

pytestmark = pytest.mark.engine

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {
    "name": "clock", "description": "The time now.",
    "parameters": {"type": "object", "properties": {}}}}]
GREEDY: dict[str, Any] = {"temperature": 0.0}
THINK_TOKENS = 60
"""Tokens of the scripted reasoning block: long enough for an update to land inside a turn."""


class RecordingManager:
    """The manager, recording each generate call; can push an update in the middle of a call."""

    def __init__(self, manager: AsyncServerManager, weights: Mapping[str, Any]) -> None:
        self.manager = manager
        self.weights = weights
        self.calls: list[tuple[list[int], TokenOutput]] = []
        self.update_mid_turn = False

    @property
    def engines(self) -> Sequence[Any]:
        return self.manager.engines

    async def generate(self, request_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: Mapping[str, Any] | None = None,
                       session_key: str | None = None) -> TokenOutput:
        call = asyncio.create_task(self.manager.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
            session_key=session_key))
        if self.update_mid_turn:
            decoding = asyncio.create_task(until_decoding(self.manager, 1))
            await asyncio.wait([call, decoding], return_when=asyncio.FIRST_COMPLETED)
            decoding.cancel()  # a turn that ended first gets no update; the test counts them
            if not call.done():
                await hold(self.manager)  # the turn cannot end before the update's pause
                steps = (self.manager.global_steps or 0) + 1
                await self.manager.update_weights(self.weights, global_steps=steps)
        output = await call
        self.calls.append((list(prompt_ids), output))
        return output


@pytest.fixture(scope="module")
def renderer(tiny_model_a: Path) -> HFChatRenderer:
    return HFChatRenderer(tiny_model_a)


@pytest.fixture(scope="module")
def script(renderer: HFChatRenderer) -> list[int]:
    """Prompt end -> <think> (THINK_TOKENS ASCII tokens) </think> <tool_call>clock</tool_call>."""
    start = renderer.encode(renderer.render([{"role": "user", "content": "hi"}], None))[-1]
    call = renderer.encode('<tool_call>{"name": "clock"}</tool_call>')
    think_open, think_close = renderer.encode("<think></think>")
    used = {start, *call, think_open, think_close}
    printable = [t for t in range(512) if len(renderer.decode([t])) == 1
                 and renderer.decode([t]).isprintable() and renderer.decode([t]) not in "<>"]
    think = [t for t in printable if t not in used][:THINK_TOKENS]
    assert len(think) == THINK_TOKENS
    return [start, think_open, *think, think_close, *call, 1]


@pytest.fixture(scope="module")
async def scripted(engine: VLLMEngine, tiny_model_a: Path, script: list[int]
                   ) -> AsyncIterator[dict[str, Any]]:
    """The shared engine on the scripted weights for this module; model A's again after."""
    weights = scripted_weights(load_weights(tiny_model_a), [script], eos_token_id=1)
    async with AsyncServerManager([engine]) as manager:
        await manager.update_weights(weights, global_steps=(manager.global_steps or 0) + 1)
    yield weights
    async with AsyncServerManager([engine]) as manager:
        await manager.update_weights(load_weights(tiny_model_a),
                                     global_steps=(manager.global_steps or 0) + 1)


@pytest.fixture
async def recording(engine: VLLMEngine, scripted: dict[str, Any]
                    ) -> AsyncIterator[RecordingManager]:
    async with AsyncServerManager([engine], resume_mode="keep") as manager:
        yield RecordingManager(manager, scripted)


@pytest.fixture
async def gateway(recording: RecordingManager, tiny_model_a: Path) -> AsyncIterator[Gateway]:
    async with open_gateway(recording, tokenizer=tiny_model_a, model=MODEL) as started:  # type: ignore[arg-type]
        yield started


def _client(session: GatewaySession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0)


async def _tool_turns(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], turns: int,
                      **params: Any) -> list[Any]:
    """Ask, run each tool call the model makes, send the results back: ``turns`` times."""
    replies = []
    for _ in range(turns):
        reply = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, **params)  # type: ignore[arg-type]
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "12:00"})
    return replies


def _check_exact(trajectory: Any, calls: list[tuple[list[int], TokenOutput]]) -> None:
    """The trajectory is the first prompt, then per call: what the gateway added (mask 0)
    and exactly what the engine generated (mask 1, its log probs and versions)."""
    first_prompt, _ = calls[0]
    assert list(trajectory.prompt_ids) == first_prompt
    tokens = list(first_prompt)
    mask: list[int] = []
    for prompt, output in calls:
        assert prompt[:len(tokens)] == tokens, "a later prompt re-tokenized earlier tokens"
        mask += [0] * (len(prompt) - len(tokens)) + [1] * len(output.token_ids)
        tokens = prompt + list(output.token_ids)
    assert list(trajectory.prompt_ids) + list(trajectory.response_ids) == tokens
    assert list(trajectory.response_mask) == mask
    sampled = [i for i, bit in enumerate(mask) if bit]
    assert [trajectory.response_log_probs[i] for i in sampled] == [
        p for _, output in calls for p in output.log_probs]
    assert [trajectory.global_steps[i] for i in sampled] == [
        s for _, output in calls for s in output.global_steps]
    steps = [s for s in trajectory.global_steps if s is not None]
    assert steps == sorted(steps), "versions decrease along the trajectory"


@retry_if_late
async def test_tool_conversation_is_token_exact_across_weight_updates(
    gateway: Gateway, recording: RecordingManager, renderer: HFChatRenderer
) -> None:
    recording.calls.clear()  # a run again follows a late one
    before = gateway.statistics()
    session = gateway.open_session()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use tools."},
                                      {"role": "user", "content": "What time is it?"}]
    recording.update_mid_turn = True
    async with _client(session) as client:
        replies = await _tool_turns(client, messages, 3, **GREEDY)
    recording.update_mid_turn = False

    for reply in replies:  # every turn completed, as one reply, with the model's tool call
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls or ()] == ["clock"]
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {}  # type: ignore[index]
        assert len(reply.model_extra["asyncroll"]["session_id"]) == 32  # type: ignore[index]
    interrupted = [r.model_extra["asyncroll"] for r in replies  # type: ignore[index]
                   if r.model_extra["asyncroll"]["num_preempted"]  # type: ignore[index]
                   or r.model_extra["asyncroll"]["min_global_steps"]  # type: ignore[index]
                   != r.model_extra["asyncroll"]["max_global_steps"]]  # type: ignore[index]
    if not interrupted:  # each turn ended before its update's pause
        await gateway.finish_session(session.id)
        raise LateAction("every turn ran out its tokens before its update")

    result = await gateway.finish_session(session.id, reward=1.0)
    assert result.num_forks == 0 and len(result.trajectories) == 1
    trajectory = result.trajectories[0]
    _check_exact(trajectory, recording.calls)
    assert trajectory.reward == 1.0 and trajectory.num_turns == 3
    assert trajectory.metrics.num_tool_calls == 3
    added = [t for t, bit in zip(trajectory.response_ids, trajectory.response_mask, strict=True)
             if not bit]
    assert renderer.decode(added).count("<tool_response>\n12:00\n</tool_response>") == 2
    statistics = gateway.statistics()
    assert (statistics.num_turns - before.num_turns, statistics.num_forks - before.num_forks,
            statistics.open_sessions) == (3, 0, 0)


async def test_streaming_reply_equals_the_recorded_turn(gateway: Gateway) -> None:
    session = gateway.open_session()
    reasoning, calls, finish, usage = "", [], None, None
    async with _client(session) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=TOOLS,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True}, **GREEDY)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
    result = await gateway.finish_session(session.id)
    (trajectory,) = result.trajectories
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["clock"]
    assert usage is not None and usage.completion_tokens == len(trajectory.response_ids)
    assert len(reasoning) == THINK_TOKENS


async def test_a_template_that_drops_reasoning_forks_and_stays_exact(
    recording: RecordingManager, tiny_model_a: Path
) -> None:
    async with open_gateway(recording, tokenizer=tiny_model_a, model=MODEL,  # type: ignore[arg-type]
                            chat_template=REASONING_DROPPING_TEMPLATE) as gateway:
        session = gateway.open_session()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What time is it?"}]
        async with _client(session) as client:
            await _tool_turns(client, messages, 2, **GREEDY)  # reasoning kept: no user turn after
            messages.append({"role": "user", "content": "And now?"})  # drops earlier reasoning
            third = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, **GREEDY)  # type: ignore[arg-type]
        assert third.model_extra["asyncroll"]["fork"] is True  # type: ignore[index]
        assert gateway.statistics().num_forks == 1
        result = await gateway.finish_session(session.id)
    assert result.num_forks == 1
    before, after = result.trajectories
    _check_exact(before, recording.calls[:2])
    _check_exact(after, recording.calls[2:])
    assert "<think>" not in HFChatRenderer(tiny_model_a).decode(after.prompt_ids)


async def test_64_concurrent_sessions_stay_apart(
    gateway: Gateway, recording: RecordingManager
) -> None:
    sessions = [gateway.open_session() for _ in range(64)]

    async def converse(index: int, session: GatewaySession) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {index}"}]
        async with _client(session) as client:
            await _tool_turns(client, messages, 2, temperature=0.0, max_tokens=6)

    async with asyncio.TaskGroup() as group:
        for index, session in enumerate(sessions):
            group.create_task(converse(index, session))
    for index, session in enumerate(sessions):
        result = await gateway.finish_session(session.id)
        (trajectory,) = result.trajectories
        calls = [c for c in recording.calls if c[0][:len(trajectory.prompt_ids)]
                 == list(trajectory.prompt_ids)]
        assert len(calls) == 2
        _check_exact(trajectory, calls)
        assert f"session {index}<" in gateway.renderer.decode(trajectory.prompt_ids)
    assert gateway.statistics().open_sessions == 0


async def test_bad_requests_are_openai_errors_and_harm_nothing(
    recording: RecordingManager, tiny_model_a: Path, engine: VLLMEngine
) -> None:
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with open_gateway(recording, tokenizer=tiny_model_a, model=MODEL,  # type: ignore[arg-type]
                            api_key="secret") as gateway, httpx.AsyncClient(
            timeout=HANG, base_url=gateway.url, headers={"Authorization": "Bearer secret"}) as http:
        kept = gateway.open_session()
        first = await http.post(f"/s/{kept.id}/v1/chat/completions", json=ok)
        assert first.status_code == 200
        before = len(recording.calls)
        cases: list[tuple[dict[str, Any], int, str | None]] = [
            ({"content": b"{not json"}, 400, None),
            ({"json": {**ok, "model": "gpt-4"}}, 404, "model_not_found"),
            ({"json": {**ok, "n": 2}}, 400, "unsupported_parameter"),
            ({"json": {**ok, "stop": ["x"]}}, 400, "unsupported_parameter"),
            ({"json": {**ok, "frobnicate": 1}}, 400, "unsupported_parameter"),
            ({"json": {**ok, "tool_choice": "required", "tools": TOOLS}}, 400,
             "unsupported_parameter"),
            ({"json": {**ok, "messages": []}}, 400, None),
            ({"json": {**ok, "messages": [{"role": "wizard", "content": "x"}]}}, 400, None),
            ({"json": {**ok, "temperature": -1}}, 400, None),
            ({"json": {**ok, "messages": [{"role": "user", "content": "word " * 600}]}}, 400,
             "context_length_exceeded"),
        ]
        for request, status, code in cases:
            response = await http.post(f"/s/{kept.id}/v1/chat/completions", **request)
            assert response.status_code == status, (request, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error"
            assert code is None or error["code"] == code
        unknown = await http.post("/s/someone-elses-session/v1/chat/completions", json=ok)
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404,
                                                                          "session_not_found")
        no_key = await http.post(f"/s/{kept.id}/v1/chat/completions", json=ok,
                                 headers={"Authorization": "Bearer wrong"})
        assert (no_key.status_code, no_key.json()["error"]["code"]) == (401, "invalid_api_key")
        assert len(recording.calls) == before, "a refused request reached the engine"

        again = await http.post(f"/s/{kept.id}/v1/chat/completions", json={
            **ok, "messages": [*ok["messages"], first.json()["choices"][0]["message"],
                               {"role": "user", "content": "more"}]})
        assert again.status_code == 200 and again.json()["asyncroll"]["fork"] is False
        result = await gateway.finish_session(kept.id)
        _check_exact(result.trajectories[0], recording.calls[-2:])
        assert gateway.statistics().num_refused == 12
    assert not engine.statistics().dead


async def test_shutdown_leaves_no_socket_or_task(recording: RecordingManager, tiny_model_a: Path
                                                 ) -> None:
    async with open_gateway(recording, tokenizer=tiny_model_a, model=MODEL) as gateway:  # type: ignore[arg-type]
        async with httpx.AsyncClient(timeout=HANG, base_url=gateway.url) as http:
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == MODEL
        port = int(gateway.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "asyncroll-gateway"]


async def test_gateway_source_scores_sessions_as_train_samples(gateway: Gateway) -> None:
    async def agent(session: GatewaySession, sample: Sample) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": sample.data["question"]}]
        if sample.data.get("fail"):
            raise RuntimeError("this agent breaks")
        async with _client(session) as client:
            replies = await _tool_turns(client, messages, 2, temperature=0.0, max_tokens=8)
        return float(len(replies))

    source = GatewaySource(gateway, agent, prompts=lambda rng: Sample(
        prompt_ids=(), data={"question": f"q{rng.random()}"}))
    prompt = Sample(prompt_ids=(), data={"question": "what?"})
    samples = await source.rollout(gateway.manager, prompt, group=7, size=3)  # type: ignore[arg-type]
    assert [s.group for s in samples] == [7, 7, 7] and {s.reward for s in samples} == {2.0}
    for sample in samples:
        assert sum(sample.loss_mask) == 16 and 0 in sample.loss_mask
    broken = Sample(prompt_ids=(), data={"question": "x", "fail": True})
    with pytest.raises(ExceptionGroup):
        await source.rollout(gateway.manager, broken, group=8, size=2)  # type: ignore[arg-type]
    assert gateway.statistics().open_sessions == 0


async def test_a_request_without_session_gets_one_and_a_custom_reply_parser(
    recording: RecordingManager, tiny_model_a: Path
) -> None:
    from asyncroll.gateway.chat import AssistantReply

    def shouting(text: str, *, tools: bool) -> AssistantReply:
        return AssistantReply(content=text.upper(), reasoning=None, tool_calls=[])

    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
          "temperature": 0.0}
    async with open_gateway(recording, tokenizer=tiny_model_a, model=MODEL,  # type: ignore[arg-type]
                            reply_parser=shouting) as gateway, httpx.AsyncClient(
            timeout=HANG, base_url=gateway.url) as http:
        refused = await http.post("/v1/chat/completions", json={**ok, "temperature": -1})
        assert refused.status_code == 400
        assert gateway.statistics().open_sessions == 0, "a failed first turn keeps no session"
        first = await http.post("/v1/chat/completions", json=ok)
        session_id = first.headers["x-session-id"]
        message = first.json()["choices"][0]["message"]
        assert message["content"] == message["content"].upper()
        second = await http.post("/v1/chat/completions", headers={"X-Session-Id": session_id},
                                 json={**ok, "messages": [*ok["messages"], message,
                                                          {"role": "user", "content": "again"}]})
        assert second.json()["asyncroll"]["fork"] is False
        result = await gateway.finish_session(session_id)
    assert result.trajectories[0].num_turns == 2


@retry_if_late
async def test_a_client_that_leaves_mid_turn_aborts_it_and_nothing_is_recorded(
    gateway: Gateway, recording: RecordingManager
) -> None:
    recording.calls.clear()  # a run again follows a late one
    session = gateway.open_session()
    long_turn = {"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                 "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=HANG, base_url=gateway.url) as http:
        post = asyncio.create_task(http.post(f"/s/{session.id}/v1/chat/completions",
                                             json=long_turn))
        await until_decoding(recording.manager, [post])
        await hold(recording.manager)  # the turn cannot finish before the client leaves
        try:
            if post.cancel():  # the client gives up: its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await post
            result = await gateway.finish_session(session.id)  # waits for the turn to end
        finally:
            for engine in recording.manager.engines:
                await engine.resume()
        if any(ran_to_budget(output, 400) for _, output in recording.calls):
            raise LateAction("the turn ran out its 400 tokens before the hold")
        assert result.trajectories == () and recording.calls == []
        assert recording.manager.statistics().in_flight == 0
        missing = await http.get("/v1/no-such-route")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
