"""The recipes end to end on a real vLLM CPU engine, with the reference trainer."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import ENGINE_ARGS, greedy
from safetensors.torch import save_file

from asyncroll import AsyncServerManager, UpdateReport, VLLMEngine
from asyncroll.recipes import BandTask, run_fully_async, run_one_step_off, run_synchronous
from asyncroll.testing import vllm_client
from asyncroll.trainer import ReferenceTrainer, TrainMetrics, TrainSample

pytestmark = pytest.mark.engine


async def served_sums(engine: VLLMEngine) -> dict[str, float]:
    """Per-parameter sums as the engine serves them. On CPU vLLM repacks linear layers into
    kernel formats, so only the parameters it keeps in checkpoint form (embeddings, lm_head,
    norms) are comparable by name; the end-to-end check is token-exact against a fresh engine."""
    (digest,) = await vllm_client(engine).collective_rpc("asyncroll_weight_digest")
    return dict(digest)


class CheckingManager(AsyncServerManager):
    """After every push, checks that the engines serve exactly the tensors pushed."""

    checked = 0

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, global_steps: int | None
    ) -> UpdateReport:
        tensors = dict(named_tensors)
        report = await super().update_weights(tensors.items(), global_steps=global_steps)
        for engine in self.engines:
            assert isinstance(engine, VLLMEngine)
            served = await served_sums(engine)
            comparable = [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in served]
            assert comparable
            for name in comparable:
                expected = math.fsum(tensors[name].double().flatten().tolist())
                assert served[name] == pytest.approx(expected, rel=1e-9, abs=1e-9), name
        self.checked += 1
        return report


class RecordingTrainer(ReferenceTrainer):
    """Remembers what each step trained on (no sample lost or counted twice) and its metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[list[int]] = []
        self.batches: list[list[TrainSample]] = []
        self.metrics: list[TrainMetrics] = []

    def step(self, samples: Any) -> TrainMetrics:
        self.groups.append([s.group for s in samples])
        self.batches.append(list(samples))
        self.metrics.append(super().step(samples))
        return self.metrics[-1]


@pytest.fixture
async def setup(
    engine: VLLMEngine, tiny_model_a: Path
) -> tuple[CheckingManager, RecordingTrainer]:
    trainer = RecordingTrainer(tiny_model_a, threads=None)
    manager = CheckingManager([engine])
    await manager.update_weights(
        trainer.named_parameters(), global_steps=(manager.global_steps or 0) + 1
    )
    return manager, trainer


def _assert_each_group_once(trainer: RecordingTrainer, groups: int, size: int) -> None:
    seen = Counter(g for step in trainer.groups for g in step)
    assert sorted(seen) == list(range(groups))
    assert set(seen.values()) == {size}


async def test_fully_async_bounds_staleness_and_loses_nothing(
    setup: tuple[CheckingManager, RecordingTrainer],
) -> None:
    manager, trainer = setup
    records = await run_fully_async(
        manager, trainer, BandTask(), steps=4, batch_groups=2, group_size=4, max_staleness=1
    )
    await manager.aclose()
    assert len(records) == 4 and manager.checked == 5
    assert all(r.staleness_max <= 1 for r in records)
    assert any(r.staleness_max == 1 for r in records), "rollout must run ahead of training"
    assert all(0 <= r.kl_k3_fresh < 1e-4 for r in records if not math.isnan(r.kl_k3_fresh))
    assert all(r.kl_k3 >= 0 for r in records)
    _assert_each_group_once(trainer, groups=8, size=4)


async def test_one_step_off_overlaps_by_one_step(
    setup: tuple[CheckingManager, RecordingTrainer],
) -> None:
    manager, trainer = setup
    records = await run_one_step_off(
        manager, trainer, BandTask(), steps=3, batch_groups=2, group_size=4
    )
    await manager.aclose()
    assert manager.checked == 4
    assert records[0].staleness_max == 0
    assert all(r.staleness_max <= 1 for r in records)
    _assert_each_group_once(trainer, groups=6, size=4)


@pytest.mark.parametrize("hybrid", [False, True], ids=["standalone", "hybrid"])
async def test_synchronous_is_on_policy(
    setup: tuple[CheckingManager, RecordingTrainer], hybrid: bool
) -> None:
    manager, trainer = setup
    records = await run_synchronous(
        manager, trainer, BandTask(), steps=2, batch_groups=2, group_size=4, hybrid=hybrid
    )
    await manager.aclose()
    assert manager.checked == 3
    assert all(r.staleness_max == 0 for r in records)
    assert all(r.ratio == pytest.approx(1.0, abs=0.05) for r in records)
    # The mismatch helper on the trainer's own log probs: every token is fresh, and the
    # engine serves the trainer's weights (bf16-rounded), so the KL is near 0.
    assert all(r.kl_k3 == r.kl_k3_fresh and 0 <= r.kl_k3 < 1e-4 for r in records)


async def test_fully_async_raises_the_reward(
    setup: tuple[CheckingManager, RecordingTrainer], tmp_path: Path, tiny_model_a: Path
) -> None:
    manager, trainer = setup
    task = BandTask()
    records = await run_fully_async(manager, trainer, task, steps=20, max_staleness=2)
    await manager.aclose()
    first = sum(r.reward for r in records[:3]) / 3
    last = sum(r.reward for r in records[-3:]) / 3
    assert first < 3 * task.random_policy_reward
    assert last > first + 0.15, [round(r.reward, 3) for r in records]
    assert all(r.staleness_max <= 2 for r in records)
    # Token-exact: a fresh engine started on the trainer's final weights serves what the
    # pushed-into engine serves.
    (engine,) = manager.engines
    assert isinstance(engine, VLLMEngine)
    folder = tmp_path / "trained"
    shutil.copytree(tiny_model_a, folder)
    save_file(dict(trainer.named_parameters()), str(folder / "model.safetensors"))
    async with VLLMEngine.launch(folder, name="fresh-trained", **ENGINE_ARGS) as fresh:
        assert await greedy(fresh, "fresh-trained") == await greedy(engine, "pushed-trained")
