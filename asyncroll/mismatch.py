"""How far the rollout's log probs are from the trainer's, for the same tokens.

The rollout engines sample with their own kernels, their own numerics and, under asynchronous
RL, weights one or more steps behind the trainer. The gap between the log prob the engine gave
a token and the log prob the trainer computes for it is the off-policy error that importance
ratios correct. A silent weight-sync failure shows up here first: fresh tokens (staleness 0)
whose KL to the trainer is far from zero.

``summarize_mismatch`` gives the usual summaries over a batch of tokens, all of them and grouped
by staleness (how many trainer steps behind the weights that produced each token were):

* ``kl_k3``: the k3 estimator of KL(rollout || trainer), ``mean(r - 1 - log r)`` with
  ``r = exp(trainer - rollout)``: unbiased for tokens sampled by the rollout, never negative;
* the importance ratio ``r``'s mean and quantiles (1%, 50%, 99%);
* ``clipped_share``: the share of tokens whose ``r`` lies outside ``[1 - clip, 1 + clip]``
  (PPO's clip range), that is, whose gradient the clipped loss drops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncroll.errors import InvalidRequestError

__all__ = ["MismatchStats", "MismatchSummary", "summarize_mismatch"]

QUANTILES = (0.01, 0.5, 0.99)


@dataclass(frozen=True, slots=True, kw_only=True)
class MismatchStats:
    """Summaries over one set of tokens."""

    tokens: int
    kl_k3: float
    ratio_mean: float
    ratio_quantiles: dict[float, float]
    """Quantile (0.01, 0.5, 0.99) -> importance ratio."""
    clipped_share: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MismatchSummary:
    """Every token of the batch, and by staleness (None: the token's version is unknown)."""

    overall: MismatchStats
    by_staleness: dict[int | None, MismatchStats] = field(default_factory=dict)

    def table(self) -> str:
        """A few lines to print: one row for all tokens, one per staleness."""
        rows = [("all", self.overall)] + [
            (str(k), v)
            for k, v in sorted(self.by_staleness.items(), key=lambda kv: (kv[0] is None, kv[0]))
        ]
        lines = [f"{'staleness':>9} {'tokens':>7} {'k3 KL':>9} {'r p1':>6} {'r p50':>6} "
                 f"{'r p99':>6} {'clipped':>7}"]
        for name, s in rows:
            q = s.ratio_quantiles
            lines.append(
                f"{name:>9} {s.tokens:>7} {s.kl_k3:>9.2e} {q[0.01]:>6.3f} {q[0.5]:>6.3f}"
                f" {q[0.99]:>6.3f} {s.clipped_share:>7.2%}"
            )
        return "\n".join(lines)


def summarize_mismatch(
    rollout_log_probs: Sequence[float] | torch.Tensor,
    trainer_log_probs: Sequence[float] | torch.Tensor,
    *,
    staleness: Sequence[int | None] | None = None,
    clip: float = 0.2,
) -> MismatchSummary:
    """Summaries of the rollout/trainer gap over the same tokens (one entry each).

    Args:
        rollout_log_probs: The log prob the engine gave each sampled token (the manager's
            output: ``log_probs``).
        trainer_log_probs: The trainer's log prob of the same token, same order.
        staleness: Per token, how many steps behind the trainer the weights that produced it
            were (the trainer's step minus the token's ``global_steps``); None where unknown.
            Omitted: no grouping.
        clip: PPO's clip range for ``clipped_share``.

    Raises:
        InvalidRequestError: lengths differ, no token, a log prob that is not finite or is
            positive, or a clip outside (0, 1].
    """
    rollout = torch.as_tensor(rollout_log_probs, dtype=torch.float64).detach().reshape(-1)
    trainer = torch.as_tensor(trainer_log_probs, dtype=torch.float64).detach().reshape(-1)
    if rollout.numel() != trainer.numel():
        raise InvalidRequestError(
            f"{rollout.numel()} rollout log probs for {trainer.numel()} trainer log probs"
        )
    if rollout.numel() == 0:
        raise InvalidRequestError("no tokens to compare")
    for name, values in (("rollout", rollout), ("trainer", trainer)):
        if not bool(torch.isfinite(values).all()) or bool((values > 1e-6).any()):
            raise InvalidRequestError(f"{name} log probs must be finite and at most 0")
    if not 0 < clip <= 1 or not math.isfinite(clip):
        raise InvalidRequestError(f"clip must lie in (0, 1], not {clip!r}")
    groups: dict[int | None, list[int]] = {}
    if staleness is not None:
        if len(staleness) != rollout.numel():
            raise InvalidRequestError(
                f"{len(staleness)} staleness values for {rollout.numel()} tokens"
            )
        for i, s in enumerate(staleness):
            groups.setdefault(s, []).append(i)
    log_ratio = trainer - rollout
    return MismatchSummary(
        overall=_stats(log_ratio, clip),
        by_staleness={k: _stats(log_ratio[torch.tensor(v)], clip) for k, v in groups.items()},
    )


def _stats(log_ratio: torch.Tensor, clip: float) -> MismatchStats:
    ratio = torch.exp(log_ratio)
    k3 = (ratio - 1) - log_ratio
    quantiles = torch.quantile(ratio, torch.tensor(QUANTILES, dtype=ratio.dtype))
    return MismatchStats(
        tokens=int(ratio.numel()),
        kl_k3=float(k3.mean()),
        ratio_mean=float(ratio.mean()),
        ratio_quantiles={q: float(v) for q, v in zip(QUANTILES, quantiles, strict=True)},
        clipped_share=float(((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean()),
    )
