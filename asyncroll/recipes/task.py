"""A toy task a tiny random-initialised model learns in minutes on two CPU cores.

Reward: the fraction of response tokens that fall in a "good" band of the vocabulary (32 of
512 token ids). A random policy scores about 32/512 = 0.06; a policy that learned the band
scores near 1. The prompt names the band's first token, so the task reads as "answer in the
neighbourhood of the token you were shown", and prompts differ so samples differ.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BandTask"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BandTask:
    vocab_size: int = 512
    band_start: int = 100
    band_size: int = 32
    prompt_len: int = 8
    response_len: int = 8

    @classmethod
    def for_vocabulary(
        cls, vocab_size: int, *, response_len: int = 8, prompt_len: int = 8
    ) -> BandTask:
        """The task for a model of ``vocab_size`` ids: a band of 1/16 of them, so a random
        policy scores 1/16 on any model (the tiny model's 32 of 512 included)."""
        return cls(vocab_size=vocab_size, band_size=max(1, vocab_size // 16),
                   response_len=response_len, prompt_len=prompt_len)

    def prompt(self, rng: random.Random) -> list[int]:
        noise = [rng.randrange(2, self.vocab_size) for _ in range(self.prompt_len - 1)]
        return [self.band_start, *noise]

    def reward(self, response_ids: Sequence[int]) -> float:
        if not response_ids:
            return 0.0
        hits = sum(self.band_start <= t < self.band_start + self.band_size for t in response_ids)
        return hits / len(response_ids)

    @property
    def random_policy_reward(self) -> float:
        return self.band_size / self.vocab_size

    def sampling_params(self) -> dict[str, object]:
        return {"max_tokens": self.response_len, "temperature": 1.0, "ignore_eos": True}
