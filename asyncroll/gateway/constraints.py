"""What a request asks of the output: stop strings, a JSON format, a forced tool call.

Each becomes a vLLM sampling argument the engines enforce while they sample (``stop``,
``structured_outputs``), so what is recorded is exactly what the model produced under the
constraint: the grammar only masks tokens, never adds any. Both need engines with a tokenizer.

Invariants:
- ``output_constraint`` is None where sampling is free (text format, ``tool_choice`` auto or
  none without a JSON format); otherwise one vLLM ``structured_outputs`` mapping.
- A forced call is written in the Hermes format the default reply parser reads
  (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``): exactly one call, of the
  named function (``tool_choice`` naming it) or of any declared one (``"required"``), its
  arguments per the function's JSON schema. The grammar starts at the first token: a reasoning
  block cannot come first.
- A JSON format beside tools the model may call (``tool_choice`` auto) lets the model answer
  either: the JSON, or one call as above.
- ``cut_at_stop`` cuts a reply's text at the first stop string, as OpenAI's content; the recorded
  tokens keep all that vLLM produced (the stop string, and whatever its last token held after it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncroll.gateway.errors import ChatRequestError

__all__ = [
    "MAX_STOP_STRINGS",
    "ToolChoice",
    "cut_at_stop",
    "hermes_call_format",
    "output_constraint",
    "parse_response_format",
    "parse_stop",
    "parse_tool_choice",
]

MAX_STOP_STRINGS = 16
"""Most stop strings a request may give (OpenAI allows 4; vLLM has no limit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolChoice:
    """``tool_choice``: ``auto`` (the model decides), ``none`` (tools hidden), ``required`` (one
    call of any declared tool) or ``function`` (one call of ``name``)."""

    mode: str = "auto"
    name: str | None = None


def parse_stop(raw: object) -> tuple[str, ...]:
    """``stop``: a string or an array of strings (null and empty strings ignored)."""
    if raw is None:
        return ()
    strings = [raw] if isinstance(raw, str) else raw
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ChatRequestError("'stop' must be a string or an array of strings", param="stop")
    kept = tuple(dict.fromkeys(s for s in strings if s))
    if len(kept) > MAX_STOP_STRINGS:
        raise ChatRequestError(f"'stop' holds {len(kept)} strings; at most {MAX_STOP_STRINGS}",
                               param="stop")
    return kept


def parse_tool_choice(raw: object, tools: Sequence[Mapping[str, Any]] | None, *,
                      param: str = "tool_choice") -> ToolChoice:
    """Chat's ``{"type": "function", "function": {"name": ...}}`` or the Responses API's
    ``{"type": "function", "name": ...}``; ``"any"`` (as some clients send) is ``required``."""
    if raw is None or raw == "auto":
        return ToolChoice()
    if raw == "none":
        return ToolChoice(mode="none")
    if raw in ("required", "any"):
        if not tools:
            raise ChatRequestError(f"{param} {raw!r} needs tools", param=param)
        return ToolChoice(mode="required")
    name = _named(raw)
    if name is None:
        raise ChatRequestError(
            f"{param} must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
            f"{{'name': ...}}}}, not {_show(raw)}", code="unsupported_parameter", param=param)
    if name not in {tool["function"]["name"] for tool in tools or ()}:
        raise ChatRequestError(f"{param} names {name!r}, which is not among the tools",
                               param=param)
    return ToolChoice(mode="function", name=name)


def _named(raw: object) -> str | None:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        return None
    function = raw.get("function")
    name = function.get("name") if isinstance(function, dict) else raw.get("name")
    return name if isinstance(name, str) and name else None


def parse_response_format(raw: object, *, param: str = "response_format"
                          ) -> dict[str, Any] | None:
    """``{"type": "text"}`` (None), ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "json_schema": {"schema": ...}}`` (chat) / ``{"type": "json_schema", "schema": ...}``
    (the Responses API's ``text.format``): the JSON part of ``structured_outputs``."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        assert isinstance(raw, dict)
        holder = raw.get("json_schema", raw)
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if not isinstance(schema, dict):
            raise ChatRequestError(f"{param}: a json_schema format needs a 'schema' object",
                                   param=param)
        return {"json": schema}
    raise ChatRequestError(
        f"{param} must be of type 'text', 'json_object' or 'json_schema', not {_show(raw)}",
        code="unsupported_parameter", param=param)


def hermes_call_format(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An xgrammar structural-tag format: one Hermes call of one of ``tools``."""
    schemas = [_call_schema(tool["function"]) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<tool_call>\n"},
        {"type": "json_schema", "json_schema": schema},
        {"type": "const_string", "value": "\n</tool_call>"},
    ]}


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def output_constraint(*, tools: Sequence[Mapping[str, Any]] | None, choice: ToolChoice,
                      json_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``structured_outputs`` of a request (see the module invariants), or None."""
    if choice.mode in ("required", "function"):
        chosen = [t for t in tools or () if choice.mode == "required"
                  or t["function"]["name"] == choice.name]
        return _structural_tag(hermes_call_format(chosen))
    if json_format is None:
        return None
    if not tools or choice.mode == "none":
        return dict(json_format)
    schema = json_format.get("json", {"type": "object"})
    return _structural_tag({"type": "or", "elements": [
        {"type": "json_schema", "json_schema": schema}, hermes_call_format(tools)]})


def _structural_tag(format_: dict[str, Any]) -> dict[str, Any]:
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": format_})}


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stop`` (and whether one was found)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def _show(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"
