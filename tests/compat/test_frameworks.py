"""Five agent frameworks, each in its default setup, against the gateway over a real engine.

Each agent is pointed at the gateway's plain ``/v1`` base URL (the one-line setup the README
gives) and asked what time it is; the scripted model (``compat_helpers``) calls the ``clock``
tool, gets its result and answers. Each test checks that the framework's call works, that the
conversation was recorded as one session (found by its content), token-exact, masked exactly on
the sampled tokens, with versions that never decrease, and with no fork.
"""

from __future__ import annotations

import asyncio
import json
import os
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
QUESTION = "What time is it?"


def clock() -> str:
    """The time now."""
    return "12:00"


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


async def _one_session(gateway: Gateway, scripted: ScriptedManager, *, forks: int = 0) -> None:
    """The agent's conversation is one auto session, recorded exactly."""
    (session_id,) = gateway.auto_session_ids()
    result = await gateway.finish_session(session_id)
    check_exact(result, scripted.calls, forks=forks)
    assert gateway.statistics().num_failed == 0


async def test_openai_agents(gateway: Gateway, scripted: ScriptedManager) -> None:
    from agents import Agent, Runner, function_tool, set_default_openai_client

    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="-")
    set_default_openai_client(client, use_for_tracing=False)
    scripted.script.extend([CLOCK_CALL, ANSWER])
    agent = Agent(name="timekeeper", instructions="Use tools.", model=MODEL,
                  tools=[function_tool(clock)])
    async with client:
        result = await Runner.run(agent, QUESTION)
    assert result.final_output == ANSWER
    await _one_session(gateway, scripted)


async def test_openai_agents_streamed(gateway: Gateway, scripted: ScriptedManager) -> None:
    from agents import Agent, Runner, function_tool, set_default_openai_client

    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="-")
    set_default_openai_client(client, use_for_tracing=False)
    scripted.script.extend([CLOCK_CALL, ANSWER])
    agent = Agent(name="timekeeper", instructions="Use tools.", model=MODEL,
                  tools=[function_tool(clock)])
    async with client:
        run = Runner.run_streamed(agent, QUESTION)
        kinds = {event.type async for event in run.stream_events()}
    assert run.final_output == ANSWER and "raw_response_event" in kinds
    await _one_session(gateway, scripted)


async def test_pydantic_ai(gateway: Gateway, scripted: ScriptedManager,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai import Agent

    monkeypatch.setenv("OPENAI_BASE_URL", f"{gateway.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "-")
    scripted.script.extend([CLOCK_CALL, ANSWER])
    agent = Agent(f"openai:{MODEL}", instructions="Use tools.", tools=[clock])
    async with agent:  # closes its HTTP client at the end
        result = await agent.run(QUESTION)
    assert result.output == ANSWER
    await _one_session(gateway, scripted)


async def test_langgraph(gateway: Gateway, scripted: ScriptedManager) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    scripted.script.extend([CLOCK_CALL, ANSWER])
    llm = ChatOpenAI(model=MODEL, base_url=f"{gateway.url}/v1", api_key="-")  # type: ignore[arg-type]
    graph = create_react_agent(llm, [tool(clock)])
    try:
        state = await graph.ainvoke({"messages": [("user", QUESTION)]})
    finally:  # langchain-openai keeps one HTTP client for the process; close it with the loop
        await llm.root_async_client.close()  # type: ignore[union-attr]
    assert state["messages"][-1].content == ANSWER
    await _one_session(gateway, scripted)


async def test_smolagents(gateway: Gateway, scripted: ScriptedManager) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    final = json.dumps({"name": "final_answer", "arguments": {"answer": ANSWER}})
    scripted.script.extend([CLOCK_CALL, f"<tool_call>\n{final}\n</tool_call>"])
    model = OpenAIServerModel(model_id=MODEL, api_base=f"{gateway.url}/v1", api_key="-")
    agent = ToolCallingAgent(tools=[tool(clock)], model=model, verbosity_level=0)
    answer = await asyncio.to_thread(agent.run, QUESTION)
    assert answer == ANSWER
    # smolagents forces a tool call and sends stop strings on every turn; the gateway asked the
    # engine for the call grammar (the script stood in for it) and the stop strings.
    assert all(json.loads(asked["structured_outputs"]["structural_tag"])["type"]
               == "structural_tag" and asked["stop"] for asked in scripted.asked)
    # It sends the call back as text ("Calling tools: [{'id': ...}]") and the tool's result as
    # a user turn: the loose match takes the text for the recorded reply, so nothing forks.
    await _one_session(gateway, scripted)


async def test_litellm(gateway: Gateway, scripted: ScriptedManager) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    scripted.script.extend([CLOCK_CALL, ANSWER])
    where: dict[str, Any] = {"api_base": f"{gateway.url}/v1", "api_key": "-"}
    tools = [{"type": "function", "function": {"name": "clock", "description": "The time now.",
                                               "parameters": {"type": "object",
                                                              "properties": {}}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    try:
        first = await litellm.acompletion(model=f"openai/{MODEL}", messages=messages,
                                          tools=tools, **where)
        message = first.choices[0].message
        (call,) = message.tool_calls
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": clock()}]
        second = await litellm.acompletion(model=f"openai/{MODEL}", messages=messages,
                                           tools=tools, **where)
    finally:  # litellm caches its HTTP clients; its own exit hook cannot close them
        await litellm.close_litellm_async_clients()
    assert second.choices[0].message.content == ANSWER
    await _one_session(gateway, scripted)


async def test_litellm_responses(gateway: Gateway, scripted: ScriptedManager) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    scripted.script.extend([ANSWER])
    try:
        reply = await litellm.aresponses(model=f"openai/{MODEL}", input=QUESTION,
                                         api_base=f"{gateway.url}/v1", api_key="-")
    finally:
        await litellm.close_litellm_async_clients()
    assert reply.output[0].content[0].text == ANSWER
    await _one_session(gateway, scripted)
