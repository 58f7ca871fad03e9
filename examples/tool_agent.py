"""Train a tool-using agent fully async: the built-in ``"tool"`` loop feeds the recipe.

One token of BandTask's band calls a tool (``TokenToolCallParser``, so no tokenizer is needed);
the loop inserts the tool's answer into the conversation with loss mask 0, so the trainer learns
only from the tokens the model sampled. The reward pays for answering in the band and for
calling the tool exactly once; the random policy does neither.

    .venv/bin/python examples/tool_agent.py [--steps 40] [--plot tool_agent.png]

The reward rises from about 0.05 to about 0.6 in 40 steps (about 3 minutes on two busy cores).
"""

from __future__ import annotations

import uvloop
from _common import arguments, run_recipe

from asyncroll.agent_loop import AgentLoopOutput, Sample, TokenToolCallParser
from asyncroll.recipes import AgentLoopSource, BandTask, run_fully_async

TASK = BandTask()
BAND = range(TASK.band_start, TASK.band_start + TASK.band_size)
CALL = TASK.band_start
"""The token that calls the tool: one of the band's, so a policy that learns the band finds it."""


async def hint(token_ids: list[int]) -> str:
    return "band"


def encode(text: str) -> list[int]:
    return [256 + byte for byte in text.encode("ascii")]  # a tokenizer-free encoding


def reward(sample: Sample, output: AgentLoopOutput) -> float:
    said = [t for t, bit in zip(output.response_ids, output.response_mask, strict=True) if bit]
    in_band = sum(t in BAND for t in said) / len(said)
    return 0.5 * in_band + 0.5 * (output.metrics.num_tool_calls == 1)


SOURCE = AgentLoopSource(
    "tool",
    prompts=lambda rng: Sample(prompt_ids=tuple(TASK.prompt(rng))),
    reward=reward,
    loop_kwargs={
        "tools": {"hint": hint},
        "parser": TokenToolCallParser({CALL: "hint"}, encode=encode),
        "max_response_tokens": 16,
        "max_turns": 3,
        "sampling_params": {"temperature": 1.0, "ignore_eos": True},
    },
)

if __name__ == "__main__":
    args = arguments(default_steps=40)
    uvloop.run(run_recipe(run_fully_async, "tool agent", args, source=SOURCE, max_staleness=2))
