"""``ChatRenderer`` over a Hugging Face tokenizer: its chat template, its fast tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["HFChatRenderer"]


class HFChatRenderer:
    """Renders with ``apply_chat_template``; encodes and decodes with the fast tokenizer itself
    (no clean-up of spaces, special tokens kept), so ``decode(encode(text)) == text``."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        """Args:
            tokenizer: A ``PreTrainedTokenizerFast`` (or alike), or a folder to load one from.
            chat_template: Overrides the tokenizer's template.
            eos_token_ids: Tokens that end a turn; the tokenizer's EOS by default.
        """
        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._template = chat_template
        ids = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self._eos = frozenset(int(i) for i in ids if i is not None)

    def __repr__(self) -> str:
        return f"<HFChatRenderer {type(self.tokenizer).__name__} eos={sorted(self._eos)}>"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
               ) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=True,
            tokenize=False, chat_template=self._template,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=False))
