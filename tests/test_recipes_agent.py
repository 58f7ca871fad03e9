"""Recipes fed by asyncroll's agent loops (a tool-using agent trained fully async on a real vLLM
CPU engine), the trainer's loss mask, failed rollouts, and one-step-off's structured concurrency.

The tiny model is random, so the agent's turns are sampled from a few allowed tokens (vLLM's
``allowed_token_ids``), one of which is the tool's call token: calls happen often, honestly
sampled by the model. vLLM then reports log probs of the restricted distribution, so the
trainer's importance ratios start below 1; these tests check the mechanics (masks, pushes,
staleness, failures), not learning (``examples/tool_agent.py`` learns, unrestricted).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_recipes import CheckingManager, RecordingTrainer

from asyncroll import InvalidRequestError, VLLMEngine
from asyncroll.agent_loop import (
    AgentLoopOutput,
    Sample,
    ServerManager,
    SingleTurnAgentLoop,
    TokenToolCallParser,
)
from asyncroll.recipes import (
    AgentLoopSource,
    BandTask,
    BandTaskSource,
    format_table,
    run_fully_async,
    run_one_step_off,
    run_synchronous,
)
from asyncroll.trainer import ReferenceTrainer, TrainMetrics, TrainSample

CALL = 250
"""The token that calls the tool (a stop token: a turn ends at its call)."""
WORDS = (240, 241, 242)
"""The other tokens the agent may sample."""


def encode(text: str) -> list[int]:
    """Tool results as tokens: ASCII byte b is token 256 + b (inside vocab 512)."""
    return [256 + byte for byte in text.encode("ascii")]


RESULT = encode("ok")
"""What the tool answers: tokens the agent itself never samples."""


async def lookup(token_ids: list[int]) -> str:
    return "ok"


def prompts(rng: random.Random) -> Sample:
    return Sample(prompt_ids=tuple(rng.randrange(2, 230) for _ in range(8)))


def reward(sample: Sample, output: AgentLoopOutput) -> float:
    """Half for using the tool, half for the share of model tokens that are WORDS[0]."""
    sampled = [t for t, bit in zip(output.response_ids, output.response_mask, strict=True) if bit]
    return 0.5 * (output.metrics.num_tool_calls > 0) + 0.5 * sampled.count(WORDS[0]) / len(sampled)


def tool_agent(**loop: Any) -> AgentLoopSource:
    return AgentLoopSource(
        "tool", prompts=prompts, reward=reward,
        loop_kwargs={
            "tools": {"lookup": lookup},
            "parser": TokenToolCallParser({CALL: "lookup"}, encode=encode),
            "max_response_tokens": 16,
            "max_turns": 4,
            "sampling_params": {"allowed_token_ids": [*WORDS, CALL], "ignore_eos": True},
            **loop,
        },
    )


@pytest.fixture
async def setup(
    engine: VLLMEngine, tiny_model_a: Path
) -> AsyncIterator[tuple[CheckingManager, RecordingTrainer]]:
    trainer = RecordingTrainer(tiny_model_a, threads=None)
    async with CheckingManager([engine]) as manager:
        await manager.update_weights(
            trainer.named_parameters(), global_steps=(manager.global_steps or 0) + 1
        )
        yield manager, trainer
        assert manager.statistics().in_flight == 0
    assert engine.statistics().in_flight == 0


def assert_masked_exactly_at_tool_results(sample: TrainSample) -> int:
    """Mask 0 exactly on the tool's answers, each right after a call; returns how many."""
    answers = 0
    for i, (token, bit) in enumerate(zip(sample.response_ids, sample.loss_mask, strict=True)):
        assert bit == (token not in RESULT), (sample.response_ids, sample.loss_mask)
        if token == CALL and i + 1 < len(sample.response_ids):
            assert sample.response_ids[i + 1 : i + 1 + len(RESULT)] == tuple(RESULT)
            answers += 1
    assert sample.loss_mask.count(0) == answers * len(RESULT)
    return answers


# -- a tool-using agent, trained fully async -------------------------------------------------


@pytest.mark.engine
async def test_fully_async_trains_a_tool_agent(
    setup: tuple[CheckingManager, RecordingTrainer],
) -> None:
    manager, trainer = setup
    start = manager.global_steps
    assert start is not None
    records = await run_fully_async(
        manager, trainer, tool_agent(), steps=3, batch_groups=2, group_size=4, max_staleness=1
    )
    assert len(records) == 3 and manager.checked == 4
    assert manager.global_steps == start + 3, "every step's weights were pushed"
    assert all(r.staleness_max <= 1 and r.samples == 8 and r.failed == 0 for r in records)
    assert "failed" not in format_table(records)
    samples = [s for batch in trainer.batches for s in batch]
    assert sorted({s.group for s in samples}) == list(range(6))
    answers = sum(assert_masked_exactly_at_tool_results(s) for s in samples)
    assert answers > 0, "the agent called its tool"
    for batch, metrics in zip(trainer.batches, trainer.metrics, strict=True):
        assert metrics.num_tokens == sum(sum(s.loss_mask) for s in batch)
    # Batch 2 (groups 4, 5) may start only once the trainer finished step 1 and pushed it.
    versions = {step for s in trainer.batches[2] for step in s.global_steps}
    assert None not in versions and min(versions) >= start + 1


@pytest.mark.engine
async def test_band_task_and_its_source_are_one_path(
    setup: tuple[CheckingManager, RecordingTrainer],
) -> None:
    manager, trainer = setup
    records = await run_synchronous(
        manager, trainer, BandTaskSource(BandTask()), steps=1, batch_groups=2, group_size=2
    )
    (batch,) = trainer.batches
    assert records[0].samples == 4 and records[0].failed == 0
    assert all(s.loss_mask == (1,) * len(s.response_ids) == (1,) * 8 for s in batch)
    assert [s.group for s in batch] == [0, 0, 1, 1]
    # The prompts come off one seeded Random in group order, as they always did.
    rng = random.Random(0)
    assert [s.prompt_ids for s in batch[::2]] == [tuple(BandTask().prompt(rng)) for _ in range(2)]


# -- failed rollouts -------------------------------------------------------------------------


class Flaky(SingleTurnAgentLoop):
    """Fails in ``run`` where ``failing`` says so (one value per loop, in construction order)."""

    def __init__(self, manager: ServerManager, *, failing: Iterator[bool], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.fails = next(failing)

    async def run(self, sample: Sample) -> AgentLoopOutput:
        if self.fails:
            raise RuntimeError("the sandbox is down")
        return await super().run(sample)


def flaky(pattern: Sequence[bool]) -> AgentLoopSource:
    return AgentLoopSource(
        Flaky, prompts=prompts, reward=lambda sample, output: float(len(output.response_ids)),
        loop_kwargs={"failing": itertools.cycle(pattern), "max_response_tokens": 4,
                     "sampling_params": {"ignore_eos": True}},
    )


@pytest.mark.engine
async def test_failed_rollouts_are_dropped_counted_and_logged(
    setup: tuple[CheckingManager, RecordingTrainer], caplog: pytest.LogCaptureFixture
) -> None:
    manager, trainer = setup
    with caplog.at_level(logging.WARNING, logger="asyncroll.recipes.sources"):
        records = await run_fully_async(
            manager, trainer, flaky([True, False, False, False]), steps=2, batch_groups=2,
            group_size=4,
        )
    assert [(r.samples, r.failed) for r in records] == [(6, 2), (6, 2)]
    assert [len(batch) for batch in trainer.batches] == [6, 6]
    assert format_table(records).splitlines()[0].endswith("failed")
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncroll.recipes.sources"]
    for group in range(4):  # later groups may have finished too before the run ended
        assert any(m.startswith(f"group {group}: 1 of 4 rollouts failed") for m in warnings)
    assert all("1 of 4" in m and "the sandbox is down" in m for m in warnings)


@pytest.mark.engine
async def test_a_group_whose_every_rollout_failed_stops_the_run(
    setup: tuple[CheckingManager, RecordingTrainer],
) -> None:
    manager, trainer = setup
    with pytest.raises(ExceptionGroup) as raised:
        await run_fully_async(
            manager, trainer, flaky([True]), steps=2, batch_groups=2, group_size=2
        )
    assert raised.group_contains(RuntimeError, match="the sandbox is down", depth=None)
    assert trainer.steps == 0 and manager.checked == 1


def test_an_unknown_loop_name_fails_when_the_source_is_made() -> None:
    with pytest.raises(InvalidRequestError, match="no agent loop named 'nope'"):
        AgentLoopSource("nope", prompts=prompts, reward=reward)


# -- the loss mask ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_model_a: Path) -> ReferenceTrainer:
    return ReferenceTrainer(tiny_model_a, threads=None)


def masked_batch() -> list[TrainSample]:
    """Two samples of one group; positions 2 and 4 are tool tokens (mask 0)."""
    return [
        TrainSample(group=0, prompt_ids=(5, 6, 7), response_ids=(240, 241, 367, 242, 363),
                    log_probs=(-6.1, -6.3, 0.0, -6.2, 0.0), global_steps=(1,) * 5,
                    reward=reward_, loss_mask=(1, 1, 0, 1, 0))
        for reward_ in (0.0, 1.0)
    ]


def loss_of(trainer: ReferenceTrainer, samples: Sequence[TrainSample]) -> tuple[float, int]:
    with torch.no_grad():
        loss, metrics = trainer.loss(samples)
    return float(loss), metrics.num_tokens


def test_the_loss_covers_only_mask_1_tokens(reference: ReferenceTrainer) -> None:
    batch = masked_batch()
    loss, tokens = loss_of(reference, batch)
    assert tokens == 6
    # What sits under mask 0 is no target: its log probs, and a masked last token's id, are
    # never read (a masked token inside the response is still context for the ones after it).
    changed = [replace(s, log_probs=(-6.1, -6.3, -9.0, -6.2, -1.0), response_ids=(240, 241, 367,
                                                                                  242, 7))
               for s in batch]
    assert loss_of(reference, changed) == (loss, 6)
    # Trailing masked tokens add nothing: the loss equals that of the response cut before them.
    cut = [replace(s, response_ids=s.response_ids[:4], log_probs=s.log_probs[:4],
                   global_steps=s.global_steps[:4], loss_mask=s.loss_mask[:4]) for s in batch]
    assert loss_of(reference, cut) == pytest.approx((loss, 6), rel=1e-6)
    # A model token's log prob does count.
    moved = [replace(s, log_probs=(-6.1, -5.0, 0.0, -6.2, 0.0)) for s in batch]
    assert loss_of(reference, moved)[0] != loss


def test_train_samples_check_their_mask(reference: ReferenceTrainer) -> None:
    (sample, _) = masked_batch()
    assert replace(sample, loss_mask=()).loss_mask == (1,) * 5, "no mask: every token trains"
    with pytest.raises(InvalidRequestError, match="equal lengths"):
        replace(sample, loss_mask=(1, 0))
    with pytest.raises(InvalidRequestError, match="0s and 1s"):
        replace(sample, loss_mask=(1, 1, 2, 1, 0))
    with pytest.raises(InvalidRequestError, match="no token to train on"):
        reference.loss([replace(sample, loss_mask=(0,) * 5)])


# -- one-step-off: structured concurrency ----------------------------------------------------


class GatedSource:
    """A BandTask source whose groups from ``gate_from`` on generate, then wait forever."""

    def __init__(self, gate_from: int) -> None:
        self.inner = BandTaskSource(BandTask())
        self.gate_from = gate_from
        self.started = asyncio.Event()
        self.cancelled: list[int] = []

    def prompt(self, rng: random.Random) -> Sample:
        return self.inner.prompt(rng)

    async def rollout(
        self, manager: ServerManager, prompt: Sample, *, group: int, size: int
    ) -> list[TrainSample]:
        if group < self.gate_from:
            return await self.inner.rollout(manager, prompt, group=group, size=size)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(manager.generate(
                    f"gated-{group}", prompt_ids=prompt.prompt_ids,
                    sampling_params={"max_tokens": 400, "ignore_eos": True},
                ))
                self.started.set()
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(group)
            raise
        raise AssertionError("unreachable")


class BlockingTrainer:
    """A ``Trainer`` whose step blocks its thread until released (then fails if told to)."""

    def __init__(self, *, fail: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.fail = fail

    def step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        self.loop.call_soon_threadsafe(self.entered.set)
        self.release.wait()
        self.finished.set()
        if self.fail:
            raise RuntimeError("the trainer broke")
        return TrainMetrics(loss=0.0, reward=0.0, mean_ratio=1.0, clipped_fraction=0.0)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("no step finishes in these tests")


@pytest.mark.engine
@pytest.mark.parametrize("how", ["cancelled", "trainer_fails"])
async def test_one_step_off_leaves_nothing_running(
    setup: tuple[CheckingManager, RecordingTrainer], how: str
) -> None:
    manager, _ = setup
    source = GatedSource(gate_from=2)
    trainer = BlockingTrainer(fail=how == "trainer_fails")
    run = asyncio.create_task(
        run_one_step_off(manager, trainer, source, steps=3, batch_groups=2, group_size=2)
    )
    await trainer.entered.wait()  # training on batch 0 ...
    await source.started.wait()  # ... while batch 1 (groups 2, 3) rolls out
    if how == "cancelled":
        run.cancel()
    trainer.release.set()
    if how == "cancelled":
        with pytest.raises(asyncio.CancelledError):
            await run
    else:
        with pytest.raises(ExceptionGroup) as raised:
            await run
        assert raised.group_contains(RuntimeError, match="the trainer broke")
    assert trainer.finished.is_set(), "the recipe returned only after the step's thread"
    assert sorted(source.cancelled) == [2, 3], "the overlapping rollout was cancelled"
    assert manager.statistics().in_flight == 0


# -- an OpenAI-API agent through the gateway, trained fully async ------------------------------


@pytest.mark.engine
async def test_fully_async_trains_an_openai_agent_through_the_gateway(
    setup: tuple[CheckingManager, RecordingTrainer], tiny_model_a: Path
) -> None:
    import openai

    from asyncroll.gateway import GatewaySession, GatewaySource, open_gateway

    manager, trainer = setup

    async def agent(session: GatewaySession, sample: Sample) -> float:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-",
                                      max_retries=0) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": sample.data["q"]}]
            for _ in range(2):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=6,  # type: ignore[arg-type]
                    extra_body={"ignore_eos": True})
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "more"}]
        return 1.0

    async with open_gateway(manager, tokenizer=tiny_model_a, model="policy") as gateway:
        source = GatewaySource(gateway, agent, prompts=lambda rng: Sample(
            prompt_ids=(), data={"q": f"question {rng.randrange(100)}"}))
        records = await run_fully_async(manager, trainer, source, steps=3, batch_groups=2,
                                        group_size=2, max_staleness=1)
        statistics = gateway.statistics()
    assert statistics.open_sessions == 0 and statistics.num_forks == 0
    assert statistics.num_turns >= 2 * 12  # rollouts still running at the end were cancelled
    assert len(records) == 3 and all(r.samples == 4 and r.failed == 0 for r in records)
    assert all(r.staleness_max <= 1 for r in records)
    for sample in (s for batch in trainer.batches for s in batch):
        assert sum(sample.loss_mask) == 12 and 0 in sample.loss_mask
        assert sample.reward == 1.0
        versions = [v for v in sample.global_steps if v is not None]
        assert versions == sorted(versions)
