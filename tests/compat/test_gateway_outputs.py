"""The Responses API, structured output, forced tool calls and stop strings, on a real engine.

Driven by the official ``openai`` client on the plain ``/v1`` base URL. Replies are scripted
(``compat_helpers``) where a test needs a particular one; where a test checks the gateway's own
constraint (a JSON schema, a forced call) the random model samples freely under it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from compat_helpers import ANSWER, CLOCK_CALL, ScriptedManager, check_exact
from safetensors.torch import load_file

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.gateway import Gateway, open_gateway

pytestmark = pytest.mark.engine

MODEL = "tiny"
CLOCK = {"type": "function", "name": "clock", "description": "The time now.",
         "parameters": {"type": "object", "properties": {}}}
ZONES = {"type": "function", "function": {
    "name": "clock", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                   "required": ["zone"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"],
    "additionalProperties": False}}}
SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 400}
"""Free sampling under a grammar: a random model's greedy choice can be whitespace forever,
which a JSON grammar allows; sampled, it closes the object within a few dozen tokens."""


@pytest.fixture
async def scripted(tokenizer_engine: VLLMEngine, compat_model: Path
                   ) -> AsyncIterator[ScriptedManager]:
    weights = load_file(str(compat_model / "model.safetensors"))
    async with AsyncServerManager([tokenizer_engine]) as manager:
        yield ScriptedManager(manager, weights)


@pytest.fixture
async def gateway(scripted: ScriptedManager, compat_model: Path) -> AsyncIterator[Gateway]:
    async with open_gateway(scripted, tokenizer=compat_model, model=MODEL) as started:  # type: ignore[arg-type]
        yield started


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="-",
                                  max_retries=0) as started:
        yield started


async def _finish_one(gateway: Gateway) -> Any:
    (session_id,) = gateway.auto_session_ids()
    return await gateway.finish_session(session_id)


async def test_responses_chain_reasoning_and_calls_by_previous_response_id(
    gateway: Gateway, scripted: ScriptedManager, client: openai.AsyncOpenAI
) -> None:
    scripted.script.extend([f"<think>\nlet me see\n</think>\n{CLOCK_CALL}", ANSWER])
    first = await client.responses.create(model=MODEL, instructions="Use tools.",
                                          input="What time is it?", tools=[CLOCK])  # type: ignore[list-item]
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.content[0].text == "let me see"  # type: ignore[union-attr,index]
    assert (call.name, json.loads(call.arguments)) == ("clock", {})  # type: ignore[union-attr]
    second = await client.responses.create(
        model=MODEL, instructions="Use tools.", previous_response_id=first.id, tools=[CLOCK],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])  # type: ignore[union-attr]
    assert second.output_text == ANSWER and second.status == "completed"
    assert second.usage is not None and second.usage.output_tokens == len(
        scripted.calls[-1][1].token_ids)
    result = await _finish_one(gateway)
    check_exact(result, scripted.calls)
    added = gateway.renderer.decode([t for t, bit in zip(
        result.trajectories[0].response_ids, result.trajectories[0].response_mask,
        strict=True) if not bit])
    assert "<tool_response>\n12:00\n</tool_response>" in added


async def test_streamed_responses_sent_back_as_items_continue_the_session(
    gateway: Gateway, scripted: ScriptedManager, client: openai.AsyncOpenAI
) -> None:
    scripted.script.extend([CLOCK_CALL, ANSWER])
    items: list[Any] = [{"role": "user", "content": "What time is it?"}]
    finals = []
    for _ in range(2):
        stream = await client.responses.create(model=MODEL, input=items, tools=[CLOCK],  # type: ignore[list-item]
                                               stream=True)
        events = [event async for event in stream]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        final = events[-1].response  # type: ignore[union-attr]
        finals.append(final)
        items += [item.model_dump(exclude_none=True) for item in final.output]
        for item in final.output:
            if item.type == "function_call":
                items.append({"type": "function_call_output", "call_id": item.call_id,
                              "output": "12:00"})
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == finals[1].output_text == ANSWER
    assert finals[0].output[0].type == "function_call"
    check_exact(await _finish_one(gateway), scripted.calls)


async def test_json_schema_output_follows_the_schema(gateway: Gateway, scripted: ScriptedManager,
                                                     client: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is it noon?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        **SAMPLED)
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content or "")["answer"] in ("yes", "no")
    assert "structural_tag" not in scripted.asked[0]["structured_outputs"]
    text = await client.responses.create(
        model=MODEL, input="Is it noon?", max_output_tokens=400, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert json.loads(text.output_text)["answer"] in ("yes", "no")
    result = await gateway.finish_session(gateway.auto_session_ids()[0])
    check_exact(result, scripted.calls[:1])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "clock"}}])
async def test_a_forced_tool_call_is_one_valid_call(
    gateway: Gateway, scripted: ScriptedManager, client: openai.AsyncOpenAI, choice: Any
) -> None:
    messages: list[Any] = [{"role": "user", "content": "The time in Paris?"}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages,
                                                 tools=[ZONES, NOTE], tool_choice=choice,
                                                 **SAMPLED)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls"
    (call,) = choice_.message.tool_calls or ()
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert arguments in ({"zone": "utc"}, {"zone": "cet"}, {"level": 1}, {"level": 2},
                         {"level": 3})
    assert choice != "required" or call.function.name in ("clock", "note")  # type: ignore[union-attr]
    assert choice == "required" or call.function.name == "clock"  # type: ignore[union-attr]
    messages += [choice_.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = await client.chat.completions.create(model=MODEL, messages=messages,
                                                 tools=[ZONES, NOTE], max_tokens=4)
    assert again.model_extra["asyncroll"]["fork"] is False  # type: ignore[index]
    check_exact(await _finish_one(gateway), scripted.calls)


async def test_stop_strings_cut_the_content_and_keep_every_token(
    gateway: Gateway, scripted: ScriptedManager, client: openai.AsyncOpenAI
) -> None:
    params: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "max_tokens": 40}
    free = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Count."}], **params)
    text = free.choices[0].message.content or ""
    await gateway.finish_session(gateway.auto_session_ids()[0])
    assert len(text) > 20, text
    stop = text[10:13]
    messages: list[Any] = [{"role": "user", "content": "Count."}]
    cut = await client.chat.completions.create(messages=messages, stop=[stop, "never seen"],
                                               **params)
    content = cut.choices[0].message.content or ""
    assert content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    _, output = scripted.calls[-1]
    whole = gateway.renderer.decode(output.token_ids)
    assert stop in whole and not whole.endswith("<|im_end|>")  # vLLM stopped on the string
    assert stop not in gateway.renderer.decode(output.token_ids[:-1])  # and at its last token
    messages += [cut.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Go on."}]
    more = await client.chat.completions.create(messages=messages, **params)
    assert more.model_extra["asyncroll"]["fork"] is False  # type: ignore[index]
    check_exact(await _finish_one(gateway), scripted.calls[-2:])
