"""Fixtures of the gateway compatibility suite: one real vLLM CPU engine with its tokenizer.

The shared engines of ``engine_fixtures.py`` run without a tokenizer; stop strings and
structured outputs (and the grammar that scripts replies here, ``compat_helpers``) need one. The
engine starts on the first test that asks and serves every test of this folder.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asyncroll.testing import make_tiny_model

if TYPE_CHECKING:
    from asyncroll import VLLMEngine

CONTEXT = 8192
"""Room for smolagents' system prompt (about 2,500 tokens of the tiny model's tokenizer)."""


@pytest.fixture(scope="session")
def compat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("compat-model"), seed=0,
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
async def tokenizer_engine(compat_model: Path) -> AsyncIterator[VLLMEngine]:
    """A real engine on the tiny model, with the model's tokenizer loaded (vLLM's default)."""
    from asyncroll import VLLMEngine

    async with VLLMEngine.launch(compat_model, name="with-tokenizer", max_model_len=CONTEXT,
                                 dtype="float32", enforce_eager=True) as engine:
        assert engine.has_tokenizer
        yield engine
