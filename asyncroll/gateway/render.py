"""``ChatRenderer`` over a Hugging Face tokenizer: its chat template, its fast tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["HFChatRenderer"]

logger = logging.getLogger(__name__)


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
        folder = None
        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            folder = Path(tokenizer)
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._template = chat_template
        ids = eos_token_ids if eos_token_ids is not None else _eos_ids(tokenizer, folder)
        self._eos = frozenset(int(i) for i in ids if i is not None)
        self.max_token_chars = max(
            (len(piece) for piece in self._backend.get_vocab(with_added_tokens=True)), default=1)
        """The longest token's text (byte-level: at least its characters), so a text of ``n``
        characters is at least ``n / max_token_chars`` tokens: what the gateway checks against
        the context before it renders or tokenizes a conversation."""
        if not self._pieces_round_trip():
            logger.warning(
                "%r: text encoded piece by piece does not decode back to itself; sessions "
                "will fork where a turn's suffix is tokenized apart from the turn", self)

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

    def _pieces_round_trip(self) -> bool:
        """Whether tokens of separately encoded texts decode to the texts joined, as the
        session's suffix-only tokenization needs (byte-level BPE does; a tokenizer that adds a
        prefix space to every encode does not)."""
        pieces = ["Hello", " world", "\n<tool_call>{}</tool_call>", "done."]
        tokens = [token for piece in pieces for token in self.encode(piece)]
        return self.decode(tokens) == "".join(pieces)


def _eos_ids(tokenizer: Any, folder: Path | None) -> list[int]:
    """The tokenizer's EOS and the model's generation-config EOS tokens (vLLM stops on both)."""
    ids = [tokenizer.eos_token_id]
    config = folder / "generation_config.json" if folder is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int)]
