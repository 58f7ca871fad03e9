"""Seeded requests under load: vLLM's CPU build dies when a seeded request's prefill is split
across steps (its generator cannot rewind), so asyncroll starts CPU engines with whole prefills
and refuses seeds where an engine splits them anyway."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncroll import AsyncServerManager, InvalidRequestError, VLLMEngine
from asyncroll.testing import vllm_client

pytestmark = pytest.mark.engine


def prompt(i: int) -> list[int]:
    """40 to 99 tokens: 200 of them overflow the CPU build's 4096-token step budget."""
    return [5 + (i + j) % 400 for j in range(40 + i % 60)]


async def test_two_hundred_concurrent_seeded_requests_leave_the_engine_alive(
    engine: VLLMEngine,
) -> None:
    """Before whole prefills, this killed the engine: every call then failed with
    ``NoEngineAvailableError``."""
    async with AsyncServerManager([engine]) as manager:
        outputs = await asyncio.gather(*(
            manager.generate(f"seeded-{i}", prompt_ids=prompt(i), sampling_params={
                "max_tokens": 4, "seed": i, "temperature": 1.0, "ignore_eos": True})
            for i in range(200)
        ))
        again = await manager.generate("seeded-again", prompt_ids=prompt(7), sampling_params={
            "max_tokens": 4, "seed": 7, "temperature": 1.0, "ignore_eos": True})
    assert not engine.is_dead
    assert all(len(o.token_ids) == 4 for o in outputs)
    assert again.token_ids == outputs[7].token_ids  # a seed still fixes the sample


async def test_an_engine_that_splits_prefills_refuses_seeds_before_vllm_sees_them(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "_seeds_kill", True)  # as if started with chunked prefill on
    rejected = engine.statistics().num_rejected
    with pytest.raises(InvalidRequestError, match=r"seed: .*enable_chunked_prefill"):
        await engine.generate("seeded-refused", prompt_ids=[5, 6], sampling_params={"seed": 1})
    assert engine.statistics().num_rejected == rejected + 1
    unseeded = await engine.generate("unseeded", prompt_ids=[5, 6],
                                     sampling_params={"max_tokens": 2})
    assert len(unseeded.token_ids) == 2


def test_only_the_cpu_build_with_split_prefills_is_at_risk(engine: VLLMEngine) -> None:
    from vllm.platforms import current_platform

    from asyncroll.vllm import compat

    def llm(chunked: bool) -> SimpleNamespace:
        return SimpleNamespace(vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked)))

    cpu = current_platform.is_cpu()
    assert compat.seeded_split_prefill_kills(llm(True)) is cpu
    assert compat.seeded_split_prefill_kills(llm(False)) is False
    assert compat.seeded_split_prefill_kills(SimpleNamespace()) is False  # unknown: no refusal
    # asyncroll's CPU default
    assert compat.seeded_split_prefill_kills(vllm_client(engine)) is False
