"""Every bad request is an InvalidRequestError before any engine sees it: never a hang or a leak.

Each case goes to a real vLLM engine directly and through an ``AsyncServerManager``; both must
raise ``InvalidRequestError``, the manager without reaching the engine, and the engine must serve
the next request with nothing left behind in vLLM. The same cases run on ``FakeEngine``, which
keeps the adapter's contract.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_helpers import until_decoding

from asyncroll import (
    AsyncrollError,
    AsyncServerManager,
    InvalidRequestError,
    ManagerClosedError,
    VLLMEngine,
)
from asyncroll.interfaces import Engine
from asyncroll.testing.contract import LateAction, retry_if_late
from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater

PROMPT = [5, 6, 7, 8]
GOOD: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True}
NAN, INF = float("nan"), float("inf")

REJECTION_DEADLINE = 60.0
"""Seconds a rejection may take before the test calls it a hang (it takes microseconds; the
bound only turns a regression, like the int request id that hung, into a failure)."""


def _params(**extra: Any) -> dict[str, Any]:
    return {**GOOD, **extra}


BAD_REQUESTS: list[tuple[str, Any, Any, Any]] = [
    # (what, request_id, prompt_ids, sampling_params)
    ("int request id", 7, PROMPT, GOOD),
    ("None request id", None, PROMPT, GOOD),
    ("empty request id", "", PROMPT, GOOD),
    ("unprintable request id", "a\nb", PROMPT, GOOD),
    ("overlong request id", "r" * 300, PROMPT, GOOD),
    ("prompt is an int", "p", 5, GOOD),
    ("float token in the prompt", "p", [5, 1.0], GOOD),
    ("bool token in the prompt", "p", [5, True], GOOD),
    ("params are a str", "s", PROMPT, "abc"),
    ("params are a list of pairs", "s", PROMPT, [("max_tokens", 4)]),
    ("non-str key", "s", PROMPT, {1: 2}),
    ("unknown key", "s", PROMPT, _params(no_such_key=1)),
    ("structured outputs", "s", PROMPT, _params(structured_outputs={"regex": "a+"})),
    ("prompt logprobs", "s", PROMPT, _params(prompt_logprobs=1)),
    ("logprobs is asyncroll's", "s", PROMPT, _params(logprobs=1)),
    ("detokenize is asyncroll's", "s", PROMPT, _params(detokenize=True)),
    ("n > 1", "s", PROMPT, _params(n=2)),
    ("n is a bool", "s", PROMPT, _params(n=True)),
    ("seed past 64 bits", "s", PROMPT, _params(seed=2**70)),
    ("seed just past uint64", "s", PROMPT, _params(seed=2**64)),
    ("seed just below int64", "s", PROMPT, _params(seed=-(2**63) - 1)),
    ("float seed", "s", PROMPT, _params(seed=1.5)),
    ("bool seed", "s", PROMPT, _params(seed=True)),
    ("negative temperature", "s", PROMPT, _params(temperature=-1.0)),
    ("temperature above 2", "s", PROMPT, _params(temperature=2.5)),
    ("NaN temperature", "s", PROMPT, _params(temperature=NAN)),
    ("str temperature", "s", PROMPT, _params(temperature="hot")),
    ("None temperature", "s", PROMPT, _params(temperature=None)),
    ("zero top_p", "s", PROMPT, _params(top_p=0.0)),
    ("top_p above 1", "s", PROMPT, _params(top_p=1.5)),
    ("top_k below -1", "s", PROMPT, _params(top_k=-2)),
    ("float top_k", "s", PROMPT, _params(top_k=1.5)),
    ("min_p above 1", "s", PROMPT, _params(min_p=1.1)),
    ("presence_penalty above 2", "s", PROMPT, _params(presence_penalty=2.5)),
    ("frequency_penalty below -2", "s", PROMPT, _params(frequency_penalty=-3.0)),
    ("zero repetition_penalty", "s", PROMPT, _params(repetition_penalty=0.0)),
    ("infinite repetition_penalty", "s", PROMPT, _params(repetition_penalty=INF)),
    ("float max_tokens", "s", PROMPT, _params(max_tokens=1.5)),
    ("bool max_tokens", "s", PROMPT, _params(max_tokens=True)),
    ("str max_tokens", "s", PROMPT, _params(max_tokens="8")),
    ("negative min_tokens", "s", PROMPT, _params(min_tokens=-1)),
    ("min_tokens over max_tokens", "s", PROMPT, _params(min_tokens=9)),
    ("int ignore_eos", "s", PROMPT, _params(ignore_eos=1)),
    ("str skip_reading_prefix_cache", "s", PROMPT, _params(skip_reading_prefix_cache="no")),
    ("negative stop token", "s", PROMPT, _params(stop_token_ids=[-1])),
    ("stop_token_ids as a str", "s", PROMPT, _params(stop_token_ids="ab")),
    ("float stop token", "s", PROMPT, _params(stop_token_ids=[1.0])),
    ("logit_bias past the vocabulary", "s", PROMPT, _params(logit_bias={512: 1.0})),
    ("logit_bias negative id", "s", PROMPT, _params(logit_bias={-1: 1.0})),
    ("logit_bias str key", "s", PROMPT, _params(logit_bias={"5": 1.0})),
    ("logit_bias NaN", "s", PROMPT, _params(logit_bias={5: NAN})),
    ("logit_bias beyond 100", "s", PROMPT, _params(logit_bias={5: 1000.0})),
    ("logit_bias as a list", "s", PROMPT, _params(logit_bias=[5, 6])),
    ("empty allowed_token_ids", "s", PROMPT, _params(allowed_token_ids=[])),
    ("allowed_token_ids past the vocabulary", "s", PROMPT, _params(allowed_token_ids=[5, 512])),
    ("bad_words without a tokenizer", "s", PROMPT, _params(bad_words=["foo"])),
    ("stop string", "s", PROMPT, _params(stop="x")),
    ("stop strings", "s", PROMPT, _params(stop=["x"])),
    ("include_stop_str_in_output", "s", PROMPT, _params(include_stop_str_in_output=True)),
    ("skip_special_tokens", "s", PROMPT, _params(skip_special_tokens=False)),
]


async def _rejected(target: Engine | AsyncServerManager, request: tuple[Any, Any, Any]) -> None:
    request_id, prompt, params = request
    with pytest.raises(InvalidRequestError):
        async with asyncio.timeout(REJECTION_DEADLINE):
            await target.generate(request_id, prompt_ids=prompt, sampling_params=params)


@pytest.mark.engine
@pytest.mark.parametrize(
    ("what", "request_id", "prompt", "params"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
async def test_bad_request_is_rejected_and_the_engine_serves_on(
    engine: VLLMEngine, what: str, request_id: Any, prompt: Any, params: Any
) -> None:
    rejected = engine.statistics().num_rejected
    await _rejected(engine, (request_id, prompt, params))
    assert engine.statistics().num_rejected == rejected + 1
    async with AsyncServerManager([engine]) as manager:
        await _rejected(manager, (request_id, prompt, params))
        assert manager.statistics().num_requests == 0
    assert engine.statistics().num_rejected == rejected + 1  # the manager sent it nowhere
    good = await engine.generate(f"good {what}", prompt_ids=PROMPT, sampling_params=GOOD)
    assert len(good.token_ids) == 8 and good.finish_reason == "length"
    assert engine.num_unfinished_in_vllm() == 0
    assert engine.statistics().in_flight == 0
    assert not engine.is_dead


@pytest.mark.parametrize(
    ("what", "request_id", "prompt", "params"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
async def test_fake_engine_rejects_what_the_adapter_rejects(
    what: str, request_id: Any, prompt: Any, params: Any
) -> None:
    engine = FakeEngine(name="fake")
    await _rejected(engine, (request_id, prompt, params))
    async with AsyncServerManager([engine], weights=FakeWeightUpdater([engine])) as manager:
        await _rejected(manager, (request_id, prompt, params))
    assert engine.statistics().num_rejected == 1
    assert len((await engine.generate("good", prompt_ids=PROMPT, sampling_params=GOOD)).token_ids)


@pytest.mark.engine
@retry_if_late
async def test_a_caller_id_like_a_segment_id_does_not_clash_across_resumes(
    engine: VLLMEngine,
) -> None:
    params = {"max_tokens": 300, "ignore_eos": True}
    aborted = engine.statistics().num_aborted
    async with AsyncServerManager([engine]) as manager:
        tasks = [
            asyncio.create_task(manager.generate(rid, prompt_ids=PROMPT, sampling_params=params))
            for rid in ("x", "x@1")
        ]
        await until_decoding(manager, tasks)
        # Only x's first segment ends: x resumes as its second segment while the caller's
        # "x@1" still decodes (they were one engine id when attempt 0 kept the bare id).
        await engine.abort("x@0")
        await until_decoding(manager, tasks)
        await engine.pause("abort")  # a weight-update-free abort of both
        await engine.resume()
        outputs = await asyncio.gather(*tasks)
    if engine.statistics().num_aborted - aborted < 3:  # x@0, then both segments in the pause
        raise LateAction("a segment ran out its tokens before the abort meant for it")
    for output, request_id in zip(outputs, ("x", "x@1"), strict=True):
        assert output.request_id == request_id
        assert output.finish_reason == "length" and output.num_preempted >= 1
        assert len(output.token_ids) == len(output.log_probs) == 300
    assert outputs[0].num_preempted == 2
    assert engine.num_unfinished_in_vllm() == 0
    assert engine.statistics().in_flight == 0


async def test_calls_after_aclose_raise_manager_closed_error() -> None:
    engine = FakeEngine(name="closed")
    manager = AsyncServerManager([engine], weights=FakeWeightUpdater([engine]))
    await manager.aclose()
    await manager.aclose()  # idempotent
    with pytest.raises(ManagerClosedError, match="closed"):
        await manager.generate("late", prompt_ids=PROMPT, sampling_params=GOOD)
    with pytest.raises(ManagerClosedError, match="closed"):
        await manager.update_weights([], global_steps=1)
    assert issubclass(ManagerClosedError, AsyncrollError)
    assert issubclass(ManagerClosedError, RuntimeError)  # what it raised before it was typed
    assert engine.statistics().num_requests == 0
