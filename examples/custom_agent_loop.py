"""A custom agent loop: answer, read fixed feedback, answer again.

The loop is the class below; ``run_agent_loops`` picks it by its registered name. Run the file
to roll it out on a vLLM engine (the GPU where there is one) serving a tiny random model
(`--model PATH` for another):
``python examples/custom_agent_loop.py``.
"""

from __future__ import annotations

import uvloop

from asyncroll import AsyncServerManager
from asyncroll.agent_loop import (
    AgentLoop,
    AgentLoopFailure,
    AgentLoopOutput,
    ResponseBuilder,
    Sample,
    register_agent_loop,
    run_agent_loops,
)

FEEDBACK = (7, 8, 9)
"""Token ids the environment inserts between the two answers (a tokenizer-free "try again")."""


@register_agent_loop("revise")
class ReviseLoop(AgentLoop[Sample]):
    """Two model turns around a feedback block; one budget for the whole response."""

    budget = 48

    async def run(self, sample: Sample) -> AgentLoopOutput:
        response = ResponseBuilder(budget=self.budget)
        first = await self.generate(
            sample.prompt_ids, {"temperature": 1.0, "max_tokens": self.budget // 2}
        )
        response.add_model(first)
        response.add_environment(FEEDBACK)  # mask 0, labelled with the first answer's version
        second = await self.generate(
            [*sample.prompt_ids, *response.token_ids],
            {"temperature": 1.0, "max_tokens": response.remaining},
        )
        response.add_model(second)
        return self.finish(sample.prompt_ids, response, stop_reason=second.finish_reason)


async def main() -> None:
    # The examples' set-up (it quietens vLLM for this process): the loop above needs none of it.
    from _common import engine_arguments, engine_on, parser, policy_folder, prepare

    args = parser(default_steps=1).parse_args()
    setup = prepare(args)
    print(f"custom agent loop: {setup.describe()}", flush=True)
    with policy_folder(setup) as model:
        async with (
            engine_on(setup, model, **engine_arguments(setup, args, prompt_len=64)) as engine,
            AsyncServerManager([engine]) as manager,
        ):
            samples = [Sample(prompt_ids=(2 + i, 3, 4)) for i in range(8)]
            results = await run_agent_loops(manager, samples, loop="revise", max_concurrency=4)
            for index, result in enumerate(results):
                if isinstance(result, AgentLoopFailure):
                    print(index, "failed:", result.error)
                else:  # the mask shows the shape: 1 = sampled, 0 = inserted feedback
                    print(index, "".join(map(str, result.response_mask)), result.stop_reason)


if __name__ == "__main__":
    uvloop.run(main())
