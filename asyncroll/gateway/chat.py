"""OpenAI chat requests in, OpenAI assistant messages out: pure functions, no I/O.

Invariants:
- ``parse_chat_request`` accepts a request only if every key is one it honours or one that
  changes nothing here (``ALLOWED_IGNORED``); anything else is a ``ChatRequestError`` naming the
  parameter, raised before a token is generated. ``stop``, ``response_format`` and a forced
  ``tool_choice`` become vLLM sampling arguments (``asyncroll.gateway.constraints``).
- ``assistant_reply`` never raises on model output: a ``<tool_call>`` it cannot read stays in
  the content as text (as vLLM's Hermes parser leaves it).
- ``message_key`` is equal for two messages exactly when the gateway treats them as the same
  turn: role, content and tool calls (ids, names and arguments compared as parsed JSON).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncroll.gateway.constraints import (
    ToolChoice,
    output_constraint,
    parse_response_format,
    parse_stop,
    parse_tool_choice,
)
from asyncroll.gateway.errors import ChatRequestError

__all__ = [
    "ALLOWED_IGNORED",
    "AssistantReply",
    "ChatRequest",
    "ChatRequestError",
    "assistant_reply",
    "message_key",
    "parse_chat_request",
]


SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "logit_bias": "logit_bias",
}
"""Request key -> vLLM sampling argument; the manager checks the values."""

AUTO = ToolChoice()
"""``tool_choice`` left to the model."""

ALLOWED_IGNORED = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier"})
"""Keys that change nothing about the tokens: accepted and ignored."""

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` body."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling_params: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings: the reply's content ends before the first one (the tokens keep it)."""
    tool_choice: ToolChoice = AUTO

    @property
    def needs_tokenizer(self) -> tuple[str, str] | None:
        """What in this request the engines need a tokenizer for, and its parameter."""
        if self.stop:
            return "stop strings", "stop"
        if "structured_outputs" not in self.sampling_params:
            return None
        if self.tool_choice.mode in ("required", "function"):
            return f"tool_choice {self.tool_choice.name or self.tool_choice.mode!r}", \
                "tool_choice"
        return "a JSON response_format", "response_format"


def parse_chat_request(body: object, *, models: Sequence[str]) -> ChatRequest:
    """Check a decoded JSON body.

    Raises:
        ChatRequestError: not an object, a missing or malformed field, an unknown model (404),
            or a parameter the gateway does not support (``n`` > 1, ``top_logprobs``, ...).
    """
    if not isinstance(body, dict):
        raise ChatRequestError("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}  # null: not given
    known = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "n",
             "logprobs", "top_logprobs", "stop", "response_format", *SAMPLING_KEYS}
    for key in body:
        if key not in known and key not in ALLOWED_IGNORED:
            raise ChatRequestError(
                f"unsupported parameter {key!r}", code="unsupported_parameter", param=key
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ChatRequestError("'model' must be a non-empty string", param="model")
    if model not in models:
        raise ChatRequestError(
            f"the model {model!r} does not exist; this gateway serves {sorted(models)}",
            status=404, code="model_not_found", param="model",
        )
    _check_unsupported(body)
    tools = _tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    if choice.mode == "none":
        tools = None
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ChatRequestError("'stream_options' must be an object", param="stream_options")
    stop = parse_stop(body.get("stop"))
    constraint = output_constraint(tools=tools, choice=choice,
                                   json_format=parse_response_format(body.get("response_format")))
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        tools=tools,
        sampling_params=constrained(_sampling_params(body), stop=stop, constraint=constraint),
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        logprobs=_flag(body, "logprobs"),
        stop=stop,
        tool_choice=choice,
    )


def constrained(params: dict[str, Any], *, stop: Sequence[str],
                constraint: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` with the stop strings and the output constraint (where given) added."""
    if stop:
        params["stop"] = list(stop)
    if constraint is not None:
        params["structured_outputs"] = dict(constraint)
    return params


def _sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = {SAMPLING_KEYS[k]: v for k, v in body.items() if k in SAMPLING_KEYS}
    bias = params.get("logit_bias")
    if isinstance(bias, dict):  # OpenAI's keys are token ids as strings
        try:
            params["logit_bias"] = {int(token): value for token, value in bias.items()}
        except ValueError as exc:
            raise ChatRequestError("logit_bias keys must be token ids", param="logit_bias"
                                   ) from exc
    return params


def _check_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise ChatRequestError(
            "only n=1 is supported: open one session per sample (GRPO groups are sessions)",
            code="unsupported_parameter", param="n",
        )
    if body.get("top_logprobs"):
        raise ChatRequestError(
            "top_logprobs is not supported (the engines return the sampled token's log prob: "
            "ask for logprobs=true)", code="unsupported_parameter", param="top_logprobs"
        )


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ChatRequestError(f"{key!r} must be true or false", param=key)
    return value


def _messages(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ChatRequestError("'messages' must be a non-empty array", param="messages")
    return [_message(message, index) for index, message in enumerate(raw)]


def _message(raw: object, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise ChatRequestError(f"{param} must be an object", param=param)
    role = raw.get("role")
    if role not in _ROLES:
        raise ChatRequestError(
            f"{param}.role must be one of {sorted(_ROLES)}, not {role!r}", param=f"{param}.role"
        )
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    message["content"] = _content(raw.get("content"), f"{param}.content")
    if role == "assistant" and raw.get("tool_calls"):
        message["tool_calls"] = _tool_calls(raw["tool_calls"], f"{param}.tool_calls")
    elif role == "assistant" and message["content"] is None:
        message["content"] = ""  # an empty turn, as some clients send it back
    elif message["content"] is None:
        raise ChatRequestError(f"{param} has no content", param=f"{param}.content")
    if role == "tool":
        message["tool_call_id"] = raw.get("tool_call_id")
    return message


def _content(raw: object, param: str) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # content parts: only text ones
        texts = []
        for part in raw:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatRequestError(f"{param}: only text content parts are supported",
                                       param=param)
            if not isinstance(part.get("text"), str):
                raise ChatRequestError(f"{param}: a text part needs a string 'text'", param=param)
            texts.append(part["text"])
        return "".join(texts)
    raise ChatRequestError(f"{param} must be a string or an array of text parts", param=param)


def _tool_calls(raw: object, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ChatRequestError(f"{param} must be an array", param=param)
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatRequestError(f"{param}: each call needs function.name", param=param)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _tools(raw: object) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ChatRequestError("'tools' must be an array", param="tools")
    for index, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatRequestError(
                f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{index}]",
            )
    return list(raw) or None


def message_key(message: Mapping[str, Any]) -> str:
    """A canonical string of what makes a message the same turn (see the module invariants)."""
    calls = [
        (call.get("id"), call["function"]["name"], _json_or_text(call["function"]["arguments"]))
        for call in message.get("tool_calls") or ()
    ]
    return json.dumps([message.get("role"), message.get("content") or "", calls], sort_keys=True)


def _json_or_text(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # text, or nested past Python's stack
        return arguments


@dataclass(frozen=True, slots=True, kw_only=True)
class AssistantReply:
    """One generated turn as OpenAI's API returns it."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def assistant_reply(text: str, *, tools: bool) -> AssistantReply:
    """Split a generated turn's text (end-of-turn token removed) into reasoning, content and
    Hermes tool calls (only where the request declared tools)."""
    reasoning = None
    if "</think>" in text:
        thought, _, text = text.partition("</think>")
        reasoning = thought.removeprefix("<think>").strip("\n")
    calls: list[dict[str, Any]] = []
    if tools:

        def take(match: re.Match[str]) -> str:
            call = _hermes(match.group(1))
            if call is None:
                return match.group(0)  # unreadable: stays in the content
            calls.append(call)
            return ""

        text = _CALL.sub(take, text)
    content = text.strip("\n") or (None if calls else "")  # as OpenAI: null only beside calls
    return AssistantReply(content=content, reasoning=reasoning, tool_calls=calls)


def _hermes(raw: str) -> dict[str, Any] | None:
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": payload["name"], "arguments": json.dumps(arguments)},
    }
