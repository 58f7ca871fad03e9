"""Two tool-call parsers: one over token ids (tokenizer-free models), one over Hermes text.

Invariants:
- Parsing is pure and synchronous; it never raises on model output: what it cannot read comes
  back as a ``MalformedToolCall`` saying why.
- ``encode_results`` returns token ids only; the loop decides whether they fit the budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from asyncroll.agent_loop.tools import MalformedToolCall, ToolCall, ToolResult
from asyncroll.errors import InvalidRequestError

__all__ = ["HermesToolCallParser", "TextTokenizer", "TokenToolCallParser"]


def _token_arguments(token_ids: Sequence[int]) -> dict[str, Any]:
    return {"token_ids": list(token_ids)}


class TokenToolCallParser:
    """Tool calls as token ids, for models without a tokenizer.

    Each token of ``call_tokens`` closes a call to the tool it names; the call's arguments are
    decoded from the tokens the turn generated since the previous call token (by default
    ``{"token_ids": [...]}``). The call tokens are stop tokens, so a turn ends at its first
    call, as a chat model ends its turn after its calls. Tokens after the last call token are
    plain output. An argument decoder that raises ``ValueError`` makes the call malformed.

    Results go back as ``encode(content)`` of each result, in call order.
    """

    def __init__(
        self,
        call_tokens: Mapping[int, str],
        *,
        encode: Callable[[str], Sequence[int]],
        decode_arguments: Callable[[Sequence[int]], Mapping[str, Any]] = _token_arguments,
    ) -> None:
        """Args:
            call_tokens: Token id -> the name of the tool it calls.
            encode: Text -> token ids, for results (ids must be in the model's vocabulary).
            decode_arguments: Argument tokens -> keyword arguments; ``ValueError`` if invalid.
        """
        if not call_tokens:
            raise InvalidRequestError("TokenToolCallParser needs at least one call token")
        self.call_tokens = dict(call_tokens)
        self._encode = encode
        self._decode_arguments = decode_arguments

    def __repr__(self) -> str:
        return f"<TokenToolCallParser call_tokens={self.call_tokens}>"

    @property
    def stop_token_ids(self) -> Sequence[int]:
        return tuple(sorted(self.call_tokens))

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall | MalformedToolCall]:
        calls: list[ToolCall | MalformedToolCall] = []
        start = 0
        for position, token in enumerate(token_ids):
            if token not in self.call_tokens:
                continue
            arguments = token_ids[start:position]
            start = position + 1
            try:
                decoded = self._decode_arguments(arguments)
            except ValueError as exc:
                calls.append(MalformedToolCall(reason=str(exc), raw=repr(list(arguments))))
                continue
            calls.append(ToolCall(name=self.call_tokens[token], arguments=decoded))
        return calls

    def encode_results(self, results: Sequence[ToolResult]) -> list[int]:
        return [token for result in results for token in self._encode(result.content)]


class TextTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the text parser uses."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolCallParser:
    """Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    The turn's tokens are decoded with special tokens kept; every tagged JSON object is a call.
    Malformed: JSON that does not parse, no string ``name``, ``arguments`` that is not an object
    (a JSON string holding an object is accepted, as OpenAI-style models emit), or a
    ``<tool_call>`` left open. Results go back as one user turn of ``<tool_response>`` blocks,
    framed for a model whose turn ended with its end-of-turn token (vLLM keeps it in the output).
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        result_prefix: str = "\n<|im_start|>user",
        result_template: str = "\n<tool_response>\n{content}\n</tool_response>",
        result_suffix: str = "<|im_end|>\n<|im_start|>assistant\n",
    ) -> None:
        """Args:
            tokenizer: A Hugging Face tokenizer (``PreTrainedTokenizerFast``) or alike.
            result_prefix: Text before the results of one turn.
            result_template: One result; ``{content}`` and ``{name}`` are filled in.
            result_suffix: Text after them (opens the model's next turn).
        """
        self.tokenizer = tokenizer
        self.result_prefix = result_prefix
        self.result_template = result_template
        self.result_suffix = result_suffix

    def __repr__(self) -> str:
        return f"<HermesToolCallParser tokenizer={type(self.tokenizer).__name__}>"

    @property
    def stop_token_ids(self) -> Sequence[int]:
        return ()

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall | MalformedToolCall]:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        calls = [_hermes_call(match.group(1)) for match in _HERMES_CALL.finditer(text)]
        tail = _HERMES_CALL.sub("", text)
        if "<tool_call>" in tail:
            calls.append(MalformedToolCall(reason="<tool_call> is never closed", raw=tail))
        return calls

    def encode_results(self, results: Sequence[ToolResult]) -> list[int]:
        body = "".join(
            self.result_template.format(content=result.content, name=result.name)
            for result in results
        )
        text = f"{self.result_prefix}{body}{self.result_suffix}"
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _hermes_call(raw: str) -> ToolCall | MalformedToolCall:
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        return MalformedToolCall(reason=f"invalid JSON: {exc}", raw=raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return MalformedToolCall(reason="a call must be an object with a string name", raw=raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return MalformedToolCall(reason=f"arguments are invalid JSON: {exc}", raw=raw)
    if not isinstance(arguments, dict):
        return MalformedToolCall(reason="arguments must be a JSON object", raw=raw)
    return ToolCall(name=payload["name"], arguments=arguments)
