"""A small reference trainer: the tiny Qwen2 the engines serve, a GRPO-style policy-gradient step.

Not a training framework: enough to show the rollout layer doing its job on CPU. Invariants:
- The loss uses the rollout's own log probs (behaviour policy) with a clipped importance ratio
  per token, so tokens sampled by stale weights (their ``global_steps`` tell how stale) are
  corrected, not trusted.
- Only tokens the model sampled (``loss_mask`` 1) are trained on; tokens an agent loop inserted
  (tool results, mask 0) are context for the tokens after them, never targets.
- ``named_parameters()`` yields Hugging Face checkpoint names in the engines' dtype, ready for
  ``manager.update_weights``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncroll.errors import InvalidRequestError

__all__ = ["ReferenceTrainer", "TrainMetrics", "TrainSample"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSample:
    """One scored rollout; samples of one prompt share a ``group``.

    ``response_ids``, ``log_probs``, ``global_steps`` and ``loss_mask`` have one entry per
    response token (checked when one is made). ``loss_mask`` defaults to all ones (every token
    sampled by the model); an agent loop's ``response_mask`` puts 0 on the tokens it inserted.
    """

    group: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    global_steps: tuple[int | None, ...]
    reward: float
    loss_mask: tuple[int, ...] = ()
    num_preempted: int = 0
    """Weight updates that cut into this sample's generation (the manager resumed it)."""

    def __post_init__(self) -> None:
        if not self.loss_mask:
            object.__setattr__(self, "loss_mask", (1,) * len(self.response_ids))
        lengths = {len(self.response_ids), len(self.log_probs), len(self.global_steps),
                   len(self.loss_mask)}
        if len(lengths) != 1:
            raise InvalidRequestError(
                "response_ids, log_probs, global_steps and loss_mask must have equal lengths, "
                f"got {sorted(lengths)}"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise InvalidRequestError(f"loss_mask holds 0s and 1s, not {set(self.loss_mask)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainMetrics:
    loss: float
    reward: float
    mean_ratio: float
    clipped_fraction: float
    num_tokens: int = 0
    """Tokens the loss covers (those with ``loss_mask`` 1); 0 where a trainer does not say."""
    log_probs: tuple[float, ...] = ()
    """The trainer's log prob of each token the loss covers, before the step, in batch order
    (sample by sample, mask-1 tokens only): with the rollout's, the mismatch
    (``asyncroll.mismatch``). Empty where a trainer does not say."""


class ReferenceTrainer:
    """GRPO on CPU: group-normalised advantages, PPO-clipped importance ratios."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        lr: float = 3e-3,
        clip: float = 0.2,
        threads: int | None = 1,
        seed: int = 0,
        wrap: Callable[[torch.nn.Module], object] | None = None,
    ) -> None:
        """``wrap`` prepares the model before the optimiser sees its parameters: e.g. FSDP2's
        ``fully_shard`` of each layer and the model (``examples/fsdp_hybrid.py``); then
        ``named_parameters`` yields each rank's ``DTensor`` shards, which
        ``DistributedWeightPusher`` gathers as it pushes."""
        from transformers import Qwen2ForCausalLM

        if threads is not None:
            torch.set_num_threads(threads)  # leave the other cores to the engines
        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        if wrap is not None:
            wrap(self.model)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip = clip
        self.steps = 0

    def __repr__(self) -> str:
        return f"<ReferenceTrainer steps={self.steps} clip={self.clip}>"

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights as the engines hold them (bf16, checkpoint names)."""
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(torch.bfloat16)

    def step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        """One optimiser step on a batch of scored samples (blocking: run it in a thread)."""
        loss, metrics = self.loss(samples)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.steps += 1
        return metrics

    def loss(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, TrainMetrics]:
        """The batch's loss (with its graph) and metrics, without stepping.

        Raises:
            InvalidRequestError: no sample has a token with ``loss_mask`` 1.
        """
        advantages = _group_advantages(samples)
        tokens, positions, targets, old, adv = _flatten(samples, advantages)
        if targets.numel() == 0:
            raise InvalidRequestError("the batch has no token to train on (every mask is 0)")
        logits = self.model(input_ids=tokens).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        new = logp[positions[:, 0], positions[:, 1], targets]
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        loss = -torch.minimum(ratio * adv, clipped * adv).mean()
        return loss, TrainMetrics(
            loss=float(loss.detach()),
            reward=sum(s.reward for s in samples) / len(samples),
            mean_ratio=float(ratio.detach().mean()),
            clipped_fraction=float(((ratio - clipped).detach().abs() > 1e-6).float().mean()),
            num_tokens=len(targets),
            log_probs=tuple(new.detach().tolist()),
        )


def _group_advantages(samples: Sequence[TrainSample]) -> list[float]:
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample.reward)
    stats = {
        g: (sum(r) / len(r), math.sqrt(sum((x - sum(r) / len(r)) ** 2 for x in r) / len(r)))
        for g, r in groups.items()
    }
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + 1e-4) for s in samples]


def _flatten(
    samples: Sequence[TrainSample], advantages: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad sequences; index (row, position) of the logits that predict each trained token.

    Every token goes into the input; only mask-1 response tokens become targets."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    positions, targets, old, adv = [], [], [], []
    for row, (sample, advantage) in enumerate(zip(samples, advantages, strict=True)):
        sequence = list(sample.prompt_ids) + list(sample.response_ids)
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        start = len(sample.prompt_ids)
        for i, (token, log_prob, bit) in enumerate(
            zip(sample.response_ids, sample.log_probs, sample.loss_mask, strict=True)
        ):
            if not bit:
                continue
            positions.append((row, start + i - 1))
            targets.append(token)
            old.append(log_prob)
            adv.append(advantage)
    return (
        tokens,
        torch.tensor(positions, dtype=torch.long).reshape(-1, 2),
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(old, dtype=torch.float32),
        torch.tensor(adv, dtype=torch.float32),
    )
