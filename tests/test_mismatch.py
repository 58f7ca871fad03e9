"""The rollout/trainer mismatch helper: its arithmetic, its refusals, and on a real engine.

On the engine: the trainer's own weights are pushed, the engine samples, and the trainer scores
the same tokens. Fresh tokens then have a KL near 0. Once the trainer's weights move and the
engine's do not (a push that never arrived), the KL is far from 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from asyncroll import InvalidRequestError, VLLMEngine, summarize_mismatch
from asyncroll.trainer import ReferenceTrainer
from asyncroll.weights import WeightPusher


def test_equal_log_probs_show_no_mismatch() -> None:
    logp = [-1.0, -2.5, -0.1, -7.0]
    summary = summarize_mismatch(logp, logp)
    s = summary.overall
    assert s.tokens == 4 and s.kl_k3 == 0.0 and s.clipped_share == 0.0
    assert s.ratio_mean == 1.0 and set(s.ratio_quantiles.values()) == {1.0}
    assert summary.by_staleness == {}


def test_a_known_shift_gives_the_k3_value_and_the_clipped_share() -> None:
    rollout = [-2.0] * 8
    trainer = [-2.0] * 4 + [-2.0 + 0.5] * 4  # half the tokens: r = e^0.5, outside 1 +- 0.2
    summary = summarize_mismatch(rollout, trainer, staleness=[0] * 4 + [2] * 4, clip=0.2)
    expected = (math.exp(0.5) - 1 - 0.5) / 2
    assert summary.overall.kl_k3 == pytest.approx(expected)
    assert summary.overall.clipped_share == pytest.approx(0.5)
    assert summary.by_staleness[0].kl_k3 == 0.0 and summary.by_staleness[0].tokens == 4
    assert summary.by_staleness[2].kl_k3 == pytest.approx(math.exp(0.5) - 1.5)
    assert summary.by_staleness[2].ratio_quantiles[0.5] == pytest.approx(math.exp(0.5))
    assert "staleness" in summary.table() and "\n        2 " in summary.table()


def test_unknown_versions_are_their_own_group() -> None:
    summary = summarize_mismatch([-1.0, -1.0], [-1.0, -1.2], staleness=[None, 0])
    assert set(summary.by_staleness) == {None, 0}
    assert summary.by_staleness[None].kl_k3 == 0.0 and summary.by_staleness[0].kl_k3 > 0


@pytest.mark.parametrize(
    ("rollout", "trainer", "kwargs", "match"),
    [
        ([-1.0], [-1.0, -2.0], {}, "1 rollout log probs for 2"),
        ([], [], {}, "no tokens"),
        ([float("nan")], [-1.0], {}, "rollout log probs must be finite"),
        ([-1.0], [0.5], {}, "trainer log probs must be finite and at most 0"),
        ([-1.0], [-1.0], {"clip": 0.0}, "clip must lie in"),
        ([-1.0], [-1.0], {"staleness": [0, 1]}, "2 staleness values for 1 tokens"),
    ],
)
def test_bad_input_is_refused(
    rollout: list[float], trainer: list[float], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        summarize_mismatch(rollout, trainer, **kwargs)  # type: ignore[arg-type]


def scored(trainer: ReferenceTrainer, prompt: list[int], response: tuple[int, ...]) -> list[float]:
    """The trainer's log prob of each response token."""
    ids = torch.tensor([prompt + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(trainer.model(input_ids=ids).logits.float(), dim=-1)[0]
    return [float(logp[len(prompt) + i - 1, token]) for i, token in enumerate(response)]


@pytest.mark.engine
async def test_on_the_engine_fresh_tokens_agree_and_a_lost_push_does_not(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    trainer = ReferenceTrainer(tiny_model_a, threads=None)
    steps = (engine.global_steps or 0) + 1
    pusher = WeightPusher([engine])  # closed at once: no transport of ours outlives the test
    try:
        await pusher.update(dict(trainer.named_parameters()), global_steps=steps)
    finally:
        await pusher.aclose()
    params = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    rollout: list[float] = []
    ours: list[float] = []
    staleness: list[int | None] = []
    samples = []
    for i in range(4):
        prompt = [5, 6, 40 + i]
        segment = await engine.generate(f"mismatch-{i}", prompt_ids=prompt, sampling_params=params)
        samples.append((prompt, segment.token_ids))
        rollout += segment.log_probs
        ours += scored(trainer, prompt, segment.token_ids)
        staleness += [None if g is None else steps - g for g in segment.global_steps]
    fresh = summarize_mismatch(rollout, ours, staleness=staleness)
    assert fresh.overall.tokens == 64 and set(fresh.by_staleness) == {0}
    assert fresh.by_staleness[0].kl_k3 < 0.01  # the engine's numerics against the trainer's
    with torch.no_grad():  # the trainer moves on; the engine never gets it
        trainer.model.lm_head.weight.mul_(50.0)
    lost = summarize_mismatch(
        rollout, [lp for prompt, response in samples for lp in scored(trainer, prompt, response)]
    )
    assert lost.overall.kl_k3 > 0.1 and lost.overall.kl_k3 > 100 * fresh.overall.kl_k3
    assert lost.overall.clipped_share > fresh.overall.clipped_share
