"""Test helpers shipped with asyncroll: tiny local models and a documented fake engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater
from asyncroll.testing.scripted import scripted_weights
from asyncroll.testing.tiny_model import (
    CHAT_TEMPLATE,
    REASONING_DROPPING_TEMPLATE,
    TINY_CONFIG,
    make_tiny_model,
)

if TYPE_CHECKING:
    from asyncroll.vllm import VLLMEngine


def vllm_client(engine: VLLMEngine) -> Any:
    """The vLLM client (``AsyncLLM``) under a ``VLLMEngine``, for tests and benchmarks that spy
    on it or read its state; imports vLLM only when called."""
    from asyncroll.vllm.engine import vllm_client as client

    return client(engine)

__all__ = [
    "CHAT_TEMPLATE",
    "REASONING_DROPPING_TEMPLATE",
    "TINY_CONFIG",
    "FakeEngine",
    "FakeWeightUpdater",
    "make_tiny_model",
    "scripted_weights",
    "vllm_client",
]
