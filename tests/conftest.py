"""Shared fixtures: tiny models built once, real vLLM CPU engines started once per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine_helpers import ENGINE_ARGS, FRESH_GREEDY, greedy

from asyncroll import VLLMEngine
from asyncroll.testing import make_tiny_model

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

@pytest.fixture(scope="session")
def tiny_model_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model-b"), seed=1)


@pytest.fixture(scope="session")
async def engine(tiny_model_a: Path) -> AsyncIterator[VLLMEngine]:
    """One real vLLM CPU engine on tiny model A, shared by every test that leaves it clean."""
    async with VLLMEngine.launch(
        tiny_model_a, name="shared", **ENGINE_ARGS
    ) as started:
        FRESH_GREEDY["a"] = await greedy(started, "fresh-a")
        yield started


@pytest.fixture(scope="session")
async def engine_b(tiny_model_b: Path) -> AsyncIterator[VLLMEngine]:
    """A second real engine, started on tiny model B (same architecture, other seed)."""
    async with VLLMEngine.launch(
        tiny_model_b, name="second", **ENGINE_ARGS
    ) as started:
        FRESH_GREEDY["b"] = await greedy(started, "fresh-b")
        yield started

