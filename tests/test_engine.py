"""The engine adapter against a real vLLM CPU engine (tiny random model)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_helpers import until_decoding

from asyncroll import (
    EngineDeadError,
    EngineStartError,
    InvalidRequestError,
    Segment,
    VLLMEngine,
)

pytestmark = pytest.mark.engine

PROMPT = [5, 6, 7, 8]


def _params(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, **extra}


def _assert_consistent(segment: Segment) -> None:
    assert len(segment.token_ids) == len(segment.log_probs) == len(segment.global_steps)
    assert all(lp <= 0.0 for lp in segment.log_probs)


async def test_concurrent_generate_all_complete(engine: VLLMEngine) -> None:
    segments = await asyncio.gather(
        *(
            engine.generate(f"c{i}", prompt_ids=[i + 2, 3, 4], sampling_params=_params(24))
            for i in range(32)
        )
    )
    for segment in segments:
        _assert_consistent(segment)
        assert len(segment.token_ids) == 24
        assert segment.finish_reason == "length"
        assert set(segment.global_steps) == {engine.global_steps}
    assert engine.statistics().in_flight == 0


async def test_same_seed_same_tokens(engine: VLLMEngine) -> None:
    greedy = _params(16, temperature=0.0)
    first = await engine.generate("g1", prompt_ids=PROMPT, sampling_params=greedy)
    second = await engine.generate("g2", prompt_ids=PROMPT, sampling_params=greedy)
    assert first.token_ids == second.token_ids
    seeded = _params(16, seed=1234)
    third = await engine.generate("s1", prompt_ids=PROMPT, sampling_params=seeded)
    fourth = await engine.generate("s2", prompt_ids=PROMPT, sampling_params=seeded)
    assert third.token_ids == fourth.token_ids


async def test_abort_returns_partial_output(engine: VLLMEngine) -> None:
    task = asyncio.create_task(
        engine.generate("long", prompt_ids=PROMPT, sampling_params=_params(400))
    )
    await until_decoding(engine, 1)
    await engine.abort("long")
    segment = await task
    assert segment.finish_reason == "abort"
    assert 0 < len(segment.token_ids) < 400
    _assert_consistent(segment)
    assert engine.statistics().in_flight == 0


async def test_pause_abort_ends_requests_with_partial_output(engine: VLLMEngine) -> None:
    tasks = [
        asyncio.create_task(
            engine.generate(f"pa{i}", prompt_ids=PROMPT, sampling_params=_params(400))
        )
        for i in range(3)
    ]
    await until_decoding(engine, 3)
    await engine.pause("abort")
    try:
        late = asyncio.create_task(
            engine.generate("pa-late", prompt_ids=PROMPT, sampling_params=_params(5))
        )
        segments = await asyncio.gather(*tasks)
        for segment in segments:
            assert segment.finish_reason == "abort"
            assert 0 < len(segment.token_ids) < 400
            _assert_consistent(segment)
        assert not late.done()  # admission is gated while paused
    finally:
        await engine.resume()
    assert len((await late).token_ids) == 5


async def test_pause_keep_resumes_to_completion(engine: VLLMEngine) -> None:
    tasks = [
        asyncio.create_task(
            engine.generate(f"pk{i}", prompt_ids=PROMPT, sampling_params=_params(300))
        )
        for i in range(3)
    ]
    await until_decoding(engine, 3)
    await engine.pause("keep")
    try:
        assert engine.statistics().paused
        assert not any(task.done() for task in tasks)
    finally:
        await engine.resume()
    for segment in await asyncio.gather(*tasks):
        assert segment.finish_reason == "length"
        assert len(segment.token_ids) == 300
        _assert_consistent(segment)


BAD_INPUTS: list[tuple[str, Any, Any]] = [
    ("empty prompt", [], _params(4)),
    ("token id past the vocabulary", [5, 512], _params(4)),
    ("negative token id", [-1, 5], _params(4)),
    ("text instead of ids", "hello", _params(4)),
    ("prompt + max_tokens over the context", [5] * 400, _params(200)),
    ("zero max_tokens", PROMPT, _params(0)),
    ("negative max_tokens", PROMPT, _params(-3)),
    ("n > 1", PROMPT, _params(4, n=2)),
    ("unknown sampling key", PROMPT, _params(4, no_such_key=1)),
    ("negative temperature", PROMPT, _params(4, temperature=-1.0)),
    ("stop token past the vocabulary", PROMPT, _params(4, stop_token_ids=[10_000])),
]


@pytest.mark.parametrize(("what", "prompt", "params"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_is_rejected_and_others_complete(
    engine: VLLMEngine, what: str, prompt: Any, params: Any
) -> None:
    good = asyncio.create_task(
        engine.generate(f"good-{what}", prompt_ids=PROMPT, sampling_params=_params(32))
    )
    rejected_before = engine.statistics().num_rejected
    with pytest.raises(InvalidRequestError):
        await engine.generate(f"bad-{what}", prompt_ids=prompt, sampling_params=params)
    assert isinstance(InvalidRequestError("x"), ValueError)
    assert len((await good).token_ids) == 32
    assert engine.statistics().num_rejected == rejected_before + 1
    assert not engine.is_dead


async def test_duplicate_live_request_id_is_rejected(engine: VLLMEngine) -> None:
    first = asyncio.create_task(
        engine.generate("dup", prompt_ids=PROMPT, sampling_params=_params(64))
    )
    await asyncio.sleep(0)  # let the first call register its id
    with pytest.raises(InvalidRequestError, match="already live"):
        await engine.generate("dup", prompt_ids=PROMPT, sampling_params=_params(4))
    assert len((await first).token_ids) == 64


async def test_sampling_params_are_not_mutated(engine: VLLMEngine) -> None:
    params = _params(4)
    snapshot = dict(params)
    await engine.generate("nm", prompt_ids=PROMPT, sampling_params=params)
    assert params == snapshot


async def test_cancel_aborts_the_request_in_the_engine(engine: VLLMEngine) -> None:
    task = asyncio.create_task(
        engine.generate("cancel-me", prompt_ids=PROMPT, sampling_params=_params(400))
    )
    await until_decoding(engine, 1)
    assert engine.statistics().in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.statistics().in_flight == 0
    assert engine.num_unfinished_in_vllm() == 0
    # The id is free again and the engine still serves.
    again = await engine.generate("cancel-me", prompt_ids=PROMPT, sampling_params=_params(4))
    assert len(again.token_ids) == 4


async def test_sleep_gates_admission_until_wake_up(engine: VLLMEngine) -> None:
    await engine.sleep(1)
    try:
        assert engine.statistics().asleep
        waiting = asyncio.create_task(
            engine.generate("sleepy", prompt_ids=PROMPT, sampling_params=_params(4))
        )
        await asyncio.sleep(0.2)
        assert not waiting.done()
    finally:
        await engine.wake_up()
    assert len((await waiting).token_ids) == 4
    assert not engine.statistics().asleep


def _engine_cores() -> set[int]:
    cores = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited while we looked
            if "EngineCore" in " ".join(child.cmdline()):
                cores.add(child.pid)
    return cores


async def test_a_missing_model_folder_fails_before_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that does not exist would otherwise become a Hugging Face hub lookup."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("vLLM was asked to start")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", must_not_run)
    for path in (tmp_path / "no-such-model", "./no-such-model"):
        with pytest.raises(EngineStartError, match=r"no-such-model.*does not exist"):
            await VLLMEngine.start(path)


async def test_bad_engine_arguments_raise_engine_start_error_and_leave_no_process(
    tiny_model_a: Path,
) -> None:
    before = _engine_cores()
    with pytest.raises(EngineStartError, match=r"bad engine arguments.*max_modle_len"):
        await VLLMEngine.start(tiny_model_a, max_modle_len=64)  # a typo
    with pytest.raises(EngineStartError, match=r"could not start.*max_model_len") as refused:
        await VLLMEngine.start(tiny_model_a, max_model_len=10**7)  # beyond the model's context
    assert isinstance(refused.value.__cause__, ValueError)  # vLLM's own error, kept as the cause
    assert _engine_cores() == before


async def test_statistics_and_repr(engine: VLLMEngine) -> None:
    stats = engine.statistics()
    assert stats.in_flight == 0 and not stats.paused and not stats.dead
    assert stats.num_requests > 0
    assert "VLLMEngine shared running" in repr(engine)


async def test_dead_engine_raises_and_aclose_leaves_no_process(tiny_model_a: Path) -> None:
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # shared engines
    engine = await VLLMEngine.start(tiny_model_a, name="doomed", max_model_len=256)
    # multiprocessing's resource tracker is per parent process, not per engine: it stays.
    children = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in others and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert children, "vLLM runs its EngineCore in child processes"
    try:
        first = await engine.generate("x", prompt_ids=PROMPT, sampling_params=_params(4))
        assert len(first.token_ids) == 4
        names = {p.pid: f"{p.name()} {' '.join(p.cmdline())}" for p in children}
        cores = [pid for pid, name in names.items() if "EngineCore" in name]
        assert len(cores) == 1, names
        os.kill(cores[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(60):
                await engine.generate("y", prompt_ids=PROMPT, sampling_params=_params(200))
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.generate("z", prompt_ids=PROMPT, sampling_params=_params(4))
    finally:
        await engine.aclose()
        await engine.aclose()  # idempotent
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {alive}"
    assert engine.statistics().in_flight == 0
