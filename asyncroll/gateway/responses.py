"""OpenAI's Responses API over the chat machinery: pure translations, no I/O.

A ``POST /v1/responses`` body becomes a chat-completions body (``instructions`` a system
message, ``input`` items chat messages, function tools chat tools, ``text.format`` a
``response_format``) and goes through the same checks, sessions and recording as a chat turn;
the reply comes back as output items (``reasoning``, ``message``, ``function_call``).

Invariants:
- ``chat_body`` accepts only keys it honours or that change nothing here
  (``RESPONSES_IGNORED``); anything else, a non-function tool, or an input item it cannot
  carry (images, files, item references) is a ``ChatRequestError`` naming it.
- Input items of one assistant turn (reasoning, then a message, then function calls, as
  ``output_items`` writes them and clients send them back) make one assistant message, so a
  reply the agent sends back matches its recorded turn as in chat (``message_key``).
- ``previous_response_id`` chaining is the gateway's: it keeps each response's conversation
  (without its ``instructions``, which OpenAI does not carry over) in the session.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncroll.gateway.chat import AssistantReply
from asyncroll.gateway.errors import ChatRequestError

__all__ = ["RESPONSES_IGNORED", "ResponsesCall", "chat_body", "input_messages", "output_items",
           "response_body", "response_events", "response_id"]

RESPONSES_IGNORED = frozenset({
    "user", "metadata", "store", "parallel_tool_calls", "service_tier", "include", "reasoning",
    "truncation", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier", "stream_options", "max_tool_calls", "context_management",
})
"""Keys that change nothing about the tokens: accepted and ignored."""

_TO_CHAT = {"model": "model", "temperature": "temperature", "top_p": "top_p",
            "max_output_tokens": "max_tokens", "stream": "stream",
            "top_logprobs": "top_logprobs", "tool_choice": "tool_choice"}
"""Responses key -> chat key, for keys that mean the same."""

_HANDLED = frozenset({"input", "instructions", "tools", "text", "previous_response_id",
                      "background"})


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesCall:
    """A Responses body taken apart: ``chat`` is the chat body without its messages."""

    chat: dict[str, Any]
    instructions: list[dict[str, Any]]
    """The system message of ``instructions`` (empty without)."""
    input: list[dict[str, Any]]
    """The messages of ``input``."""
    previous_response_id: str | None


def chat_body(body: object) -> ResponsesCall:
    """The chat body of a Responses body and the parts its messages are made of.

    Raises:
        ChatRequestError: see the module invariants.
    """
    if not isinstance(body, dict):
        raise ChatRequestError("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key not in _TO_CHAT and key not in _HANDLED and key not in RESPONSES_IGNORED:
            raise ChatRequestError(
                f"unsupported parameter {key!r}" + (
                    ": send the conversation's items, or chain with previous_response_id"
                    if key in ("conversation", "prompt") else ""),
                code="unsupported_parameter", param=key)
    if body.get("background"):
        raise ChatRequestError("background responses are not supported",
                               code="unsupported_parameter", param="background")
    chat = {_TO_CHAT[key]: value for key, value in body.items() if key in _TO_CHAT}
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise ChatRequestError("'text' must be an object", param="text")
        if text.get("format") is not None:
            chat["response_format"] = text["format"]
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ChatRequestError("'previous_response_id' must be a string",
                               param="previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatRequestError("'instructions' must be a string", param="instructions")
    return ResponsesCall(
        chat=chat, instructions=[{"role": "system", "content": instructions}] if instructions
        else [], input=input_messages(body.get("input")), previous_response_id=previous)


def _tools(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ChatRequestError("'tools' must be an array", param="tools")
    tools = []
    for index, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ChatRequestError(
                f"tools[{index}]: only function tools are supported, not {kind!r} (declare "
                "what the agent runs itself as a function tool)",
                code="unsupported_parameter", param=f"tools[{index}]")
        function = {key: tool[key] for key in ("name", "description", "parameters")
                    if key in tool}
        tools.append({"type": "function", "function": function})
    return tools


def input_messages(raw: object) -> list[dict[str, Any]]:
    """Chat messages of an ``input`` (a string, or an array of items)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ChatRequestError("'input' must be a string or an array of items", param="input")
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    for index, item in enumerate(raw):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise ChatRequestError(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "reasoning" or (kind == "message" and role == "assistant") \
                or kind == "function_call":
            if turn is None or kind == "reasoning" or (kind == "message" and _said(turn)):
                _close(messages, turn)
                turn = {"role": "assistant", "content": None}
            if kind == "message":
                turn["content"] = _text(item.get("content"), f"{param}.content")
            elif kind == "function_call":
                turn.setdefault("tool_calls", []).append(_call(item, param))
            continue
        _close(messages, turn)
        turn = None
        messages.append(_other(item, kind, param))
    _close(messages, turn)
    return messages


def _said(turn: Mapping[str, Any]) -> bool:
    return turn["content"] is not None or bool(turn.get("tool_calls"))


def _close(messages: list[dict[str, Any]], turn: dict[str, Any] | None) -> None:
    if turn is not None and _said(turn):
        messages.append(turn)


def _call(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ChatRequestError(f"{param}: a function_call needs a name and arguments (a "
                               "string)", param=param)
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _other(item: Mapping[str, Any], kind: str, param: str) -> dict[str, Any]:
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": _text(item.get("output"), f"{param}.output")}
    if kind != "message":
        raise ChatRequestError(
            f"{param}: input items of type {kind!r} are not supported (messages, "
            "function_call, function_call_output and reasoning are)",
            code="unsupported_parameter", param=param)
    return {"role": item.get("role"), "content": _text(item.get("content"), f"{param}.content")}


_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def _text(raw: object, param: str) -> str:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ChatRequestError(f"{param} must be a string or an array of text parts",
                               param=param)
    texts = []
    for part in raw:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise ChatRequestError(f"{param}: only text parts are supported", param=param)
        text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise ChatRequestError(f"{param}: a text part needs a string 'text'", param=param)
        texts.append(text)
    return "".join(texts)


def output_items(reply: AssistantReply, rid: str) -> list[dict[str, Any]]:
    """The reply as output items, in the order clients send them back."""
    base = rid.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{base}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reply.reasoning}],
                      "status": "completed"})
    if reply.content is not None:
        items.append({"type": "message", "id": f"msg_{base}", "role": "assistant",
                      "status": "completed", "content": [
                          {"type": "output_text", "text": reply.content, "annotations": [],
                           "logprobs": []}]})
    for index, call in enumerate(reply.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{base}_{index}",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def response_body(*, rid: str, model: str, body: Mapping[str, Any], items: list[dict[str, Any]],
                  usage: Mapping[str, int], finish: str, extra: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """The ``response`` object; ``body`` is the request (its settings are echoed)."""
    incomplete = finish in ("length", "abort")
    text = body.get("text") if isinstance(body.get("text"), dict) else None
    now = time.time()
    return {
        "id": rid, "object": "response", "created_at": int(now), "completed_at": int(now),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "model": model, "output": items,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": text or {"format": {"type": "text"}}, "truncation": "disabled",
        "reasoning": body.get("reasoning"), "store": body.get("store", True),
        "usage": {"input_tokens": usage["prompt"],
                  "input_tokens_details": {"cached_tokens": usage["cached"]},
                  "output_tokens": usage["completion"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["prompt"] + usage["completion"]},
        "asyncroll": dict(extra),
    }


def response_events(response: Mapping[str, Any]) -> Iterator[bytes]:
    """A finished response as the Responses API's server-sent events."""
    numbers = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(numbers), **fields}
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    started = {**response, "status": "in_progress", "output": [], "usage": None,
               "incomplete_details": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        yield from _item_events(event, index, item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(final, response=response)


def _item_events(event: Any, index: int, item: Mapping[str, Any]) -> Iterator[bytes]:
    kind, item_id = item["type"], item["id"]
    if kind == "message":
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "content": []})
        part = item["content"][0]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        yield event("response.content_part.added", **where, part={**part, "text": ""})
        yield event("response.output_text.delta", **where, delta=part["text"], logprobs=[])
        yield event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield event("response.content_part.done", **where, part=part)
    elif kind == "function_call":
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""})
        where = {"item_id": item_id, "output_index": index}
        yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **where,
                    arguments=item["arguments"], name=item["name"])
    else:  # reasoning
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "content": []})
        text = item["content"][0]["text"]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        yield event("response.reasoning_text.delta", **where, delta=text)
        yield event("response.reasoning_text.done", **where, text=text)
    yield event("response.output_item.done", output_index=index, item=item)
