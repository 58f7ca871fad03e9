"""Train an agent written against the OpenAI API, unchanged, through asyncroll's gateway.

The agent below is plain ``openai`` client code: a two-turn chat. It knows nothing of tokens,
versions or weight updates. The gateway renders each request with the model's chat template,
generates it through the manager (resumed across the fully-async recipe's weight updates) and
records the session's exact tokens; the recipe trains on them with loss mask 1 on the model's
own tokens only. The reward pays for the model's tokens in BandTask's band (32 of 512 ids),
read from the session's recorded tokens, so a random policy scores about 0.06.

    .venv/bin/python examples/gateway_agent.py [--steps 40] [--plot gateway_agent.png]

The reward rises from about 0.06 (last run on two cores: 0.07 to 0.97 in 40 steps, a few
minutes; on one H200 0.05 to 0.17 in 10 steps).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import openai
import uvloop
from _common import arguments, run_recipe

from asyncroll import AsyncServerManager
from asyncroll.agent_loop import Sample
from asyncroll.gateway import GatewaySession, GatewaySource, SessionResult, open_gateway
from asyncroll.recipes import BandTask, RolloutSource, run_fully_async

TASK = BandTask()
BAND = range(TASK.band_start, TASK.band_start + TASK.band_size)
QUESTIONS = ["What is the weather in Paris?", "Search the web for a reward function.",
             "What time is it now?", "List the directory and read the file."]


async def agent(session: GatewaySession, sample: Sample) -> None:
    """An ordinary OpenAI-API agent: ask, read the answer, ask a follow-up."""
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key="-", max_retries=0) as llm:
        messages = [{"role": "user", "content": sample.data["question"]}]
        for follow_up in ("Say more.", None):
            reply = await llm.chat.completions.create(
                model="policy", messages=messages, max_tokens=8, temperature=1.0)  # type: ignore[arg-type]
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if follow_up:
                messages.append({"role": "user", "content": follow_up})


def reward(sample: Sample, result: SessionResult) -> float:
    said = [token for t in result.trajectories
            for token, bit in zip(t.response_ids, t.response_mask, strict=True) if bit]
    return sum(token in BAND for token in said) / max(len(said), 1)


async def gateway_source(manager: AsyncServerManager, model: Path,
                         stack: contextlib.AsyncExitStack) -> RolloutSource:
    gateway = await stack.enter_async_context(
        open_gateway(manager, tokenizer=model, model="policy"))
    print(f"OpenAI-compatible gateway at {gateway.url}/v1", flush=True)

    def prompts(rng: random.Random) -> Sample:
        return Sample(prompt_ids=(), data={"question": rng.choice(QUESTIONS)})

    return GatewaySource(gateway, agent, prompts=prompts, reward=reward)


if __name__ == "__main__":
    args = arguments(default_steps=40)
    if args.model is not None and not (args.model / "tokenizer_config.json").is_file():
        raise SystemExit(f"error: --model {args.model}: the gateway needs the checkpoint's "
                         "tokenizer (tokenizer_config.json), and this one has none")
    uvloop.run(run_recipe(run_fully_async, "gateway agent", args, source=gateway_source,
                          max_staleness=2))
