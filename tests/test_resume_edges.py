"""Resume edge cases peers got wrong, on a scripted engine (pure resume logic, no vLLM).

What each segment of a request returns is scripted, so the awkward cases happen every time:
an abort with no tokens at all, an abort that lands exactly on the budget, a duplicate live id.
The same paths on real engines are in tests/test_manager.py; these pin the arithmetic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from asyncroll import AsyncServerManager, InvalidRequestError
from asyncroll.types import EngineStatistics, FinishReason, PauseMode, Segment
from asyncroll.vllm.engine import _segment


class ScriptedEngine:
    """Answers each ``generate`` with the next scripted (finish reason, number of tokens)."""

    vocab_size = 100
    max_model_len = 1000
    has_tokenizer = False

    def __init__(self, script: Iterable[tuple[FinishReason, int]], name: str = "s") -> None:
        self.name = name
        self._script = list(script)
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []
        self.release = asyncio.Event()
        self.release.set()

    @property
    def is_dead(self) -> bool:
        return False

    @property
    def global_steps(self) -> int | None:
        return 0

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
    ) -> Segment:
        params = dict(sampling_params or {})
        self.calls.append((request_id, list(prompt_ids), params))
        await self.release.wait()
        reason, count = self._script.pop(0)
        count = min(count, params["max_tokens"])
        tokens = tuple(10 + len(prompt_ids) + i for i in range(count))
        return Segment(
            request_id=request_id,
            token_ids=tokens,
            log_probs=(-1.0,) * count,
            global_steps=(0,) * count,
            finish_reason=reason,
            num_prompt_tokens=len(prompt_ids),
        )

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        pass

    async def pause(
        self, mode: PauseMode = "abort", *, clear_cache: bool | None = None
    ) -> None:
        pass

    async def resume(self) -> None:
        pass

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            in_flight=0, paused=False, asleep=False, dead=False, global_steps=0,
            num_requests=len(self.calls), num_aborted=0, num_rejected=0,
        )


async def test_an_abort_with_no_tokens_is_resumed_with_the_whole_budget() -> None:
    engine = ScriptedEngine([("abort", 0), ("abort", 0), ("length", 10)])
    async with AsyncServerManager([engine]) as manager:
        out = await manager.generate("z", prompt_ids=[1, 2], sampling_params={"max_tokens": 10})
    assert len(out.token_ids) == len(out.log_probs) == len(out.global_steps) == 10
    assert out.finish_reason == "length" and out.num_preempted == 2
    assert [params["max_tokens"] for _, _, params in engine.calls] == [10, 10, 10]
    assert [prompt for _, prompt, _ in engine.calls] == [[1, 2]] * 3


async def test_continuations_are_charged_against_the_original_budget() -> None:
    engine = ScriptedEngine([("abort", 4), ("abort", 3), ("length", 100)])
    params = {"max_tokens": 10, "min_tokens": 8}
    async with AsyncServerManager([engine]) as manager:
        out = await manager.generate("b", prompt_ids=[1], sampling_params=params)
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    sent = [(p["max_tokens"], p["min_tokens"]) for _, _, p in engine.calls]
    assert sent == [(10, 8), (6, 4), (3, 1)]
    prompts = [prompt for _, prompt, _ in engine.calls]
    assert prompts[1] == [1, *out.token_ids[:4]] and prompts[2] == [1, *out.token_ids[:7]]
    assert params == {"max_tokens": 10, "min_tokens": 8}  # the caller's dict is untouched


async def test_an_abort_landing_exactly_on_the_budget_is_complete() -> None:
    engine = ScriptedEngine([("abort", 5), ("abort", 5)])
    async with AsyncServerManager([engine]) as manager:
        out = await manager.generate("e", prompt_ids=[1], sampling_params={"max_tokens": 10})
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert len(engine.calls) == 2  # never resubmitted with a budget of zero


async def test_resuming_switched_off_flags_the_output_instead() -> None:
    engine = ScriptedEngine([("abort", 3)])
    async with AsyncServerManager([engine], partial_rollout=False) as manager:
        out = await manager.generate("f", prompt_ids=[1], sampling_params={"max_tokens": 10})
    assert out.finish_reason == "abort" and len(out.token_ids) == 3 and len(engine.calls) == 1


async def test_a_duplicate_live_request_id_is_rejected_before_any_engine() -> None:
    engine = ScriptedEngine([("length", 4)])
    engine.release.clear()
    async with AsyncServerManager([engine]) as manager:
        first = asyncio.create_task(
            manager.generate("same", prompt_ids=[1], sampling_params={"max_tokens": 4})
        )
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="already live"):
            await manager.generate("same", prompt_ids=[1], sampling_params={"max_tokens": 4})
        engine.release.set()
        assert len((await first).token_ids) == 4
        assert len(engine.calls) == 1
        # once finished, the id may be used again
        engine._script.append(("length", 2))
        again = await manager.generate("same", prompt_ids=[1], sampling_params={"max_tokens": 2})
        assert len(again.token_ids) == 2


@pytest.mark.parametrize("output", [None, SimpleNamespace(outputs=[])])
def test_an_abort_with_no_output_at_all_is_an_empty_segment(output: Any) -> None:
    segment = _segment("x", output, 3, [(5, 0)], True)
    assert segment.token_ids == segment.log_probs == segment.global_steps == ()
    assert segment.finish_reason == "abort" and segment.num_prompt_tokens == 3
