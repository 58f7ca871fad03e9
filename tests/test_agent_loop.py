"""Agent loops on the manager, against the two real vLLM CPU engines (both serving model A).

The tiny models are random, so the tests make tool calls happen honestly: ``Scripted`` restricts
each turn's sampling to one token with vLLM's ``allowed_token_ids`` (the model really emits it),
and the parser really reads the call out of the turn's tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from engine_helpers import load_weights
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import asyncroll.agent_loop
from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    ResumeMode,
    TokenOutput,
    VLLMEngine,
)
from asyncroll.agent_loop import (
    AgentLoop,
    AgentLoopFailure,
    AgentLoopMetrics,
    AgentLoopOutput,
    HermesToolCallParser,
    MalformedToolCall,
    ResponseBuilder,
    Sample,
    ServerManager,
    SingleTurnAgentLoop,
    TokenToolCallParser,
    ToolAgentLoop,
    ToolCall,
    ToolResult,
    agent_loop_class,
    register_agent_loop,
    registered_agent_loops,
    run_agent_loops,
)

CALL, GATED, PLAIN, FILLER = 250, 251, 240, 241
"""Token ids: two call tokens, one that ends a turn without a call, one that fills the budget."""

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_agent_loop.py"


def encode(text: str) -> list[int]:
    """A tokenizer-free text encoding: ASCII byte b is token 256 + b (inside vocab 512)."""
    return [256 + byte for byte in text.encode("ascii")]


def decode(token_ids: Sequence[int]) -> str:
    return bytes(token - 256 for token in token_ids).decode("ascii")


def prompt(seed: int, length: int = 200) -> tuple[int, ...]:
    """Over 128 tokens by default: the CPU build's KV blocks hold 128."""
    return tuple(10 + (seed * 37 + i) % 220 for i in range(length))


def token_parser(**kwargs: Any) -> TokenToolCallParser:
    return TokenToolCallParser({CALL: "echo", GATED: "gated"}, encode=encode, **kwargs)


class Scripted(ToolAgentLoop):
    """Turn ``t`` may only emit ``script[t]`` (the last entry repeats); every token but FILLER
    also ends the turn, so each turn is one token, or FILLER up to the budget."""

    def __init__(self, manager: ServerManager, *, script: Sequence[int], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.script = list(script)

    async def run(self, sample: Sample) -> AgentLoopOutput:
        self.script = list(sample.data.get("script", self.script))
        return await super().run(sample)

    def turn_sampling_params(self, turn: int) -> dict[str, Any]:
        params = super().turn_sampling_params(turn)
        token = self.script[min(turn, len(self.script) - 1)]
        params["allowed_token_ids"] = [token]
        if token != FILLER:
            params["stop_token_ids"] = [token]
        return params


class Recorder:
    """A ServerManager that records every turn's TokenOutput by session."""

    def __init__(self, manager: AsyncServerManager) -> None:
        self.manager = manager
        self.turns: dict[str, list[TokenOutput]] = defaultdict(list)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        session_key: str | None = None,
    ) -> TokenOutput:
        output = await self.manager.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
            session_key=session_key,
        )
        self.turns[session_key or request_id].append(output)
        return output


async def echo(token_ids: list[int]) -> str:
    return f"echo{len(token_ids)}"


def assert_consistent(output: AgentLoopOutput, *, budget: int) -> None:
    size = len(output.response_ids)
    assert size == len(output.response_mask) == len(output.response_log_probs)
    assert size == len(output.global_steps)
    assert 0 < size <= budget
    for bit, log_prob in zip(output.response_mask, output.response_log_probs, strict=True):
        assert bit in (0, 1)
        assert log_prob == 0.0 if bit == 0 else log_prob <= 0.0
    known = [step for step in output.global_steps if step is not None]
    assert known == sorted(known), output.global_steps
    assert output.response_mask[-1] == 1, "a response never ends with tool tokens"


def scripted_response(*turns: tuple[int, str | None]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(response_ids, response_mask) of one-token turns, each followed by a tool's text."""
    ids: list[int] = []
    mask: list[int] = []
    for token, text in turns:
        tool = encode(text) if text is not None else []
        ids += [token, *tool]
        mask += [1] + [0] * len(tool)
    return tuple(ids), tuple(mask)


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights_a(tiny_model_a: Path) -> dict[str, Any]:
    return load_weights(tiny_model_a)


@pytest.fixture(scope="module")
async def both_on_a(
    engine: VLLMEngine, engine_b: VLLMEngine, weights_a: dict[str, Any]
) -> list[VLLMEngine]:
    """Both shared engines serving model A, so outputs do not depend on routing."""
    async with AsyncServerManager([engine, engine_b]) as manager:
        await manager.update_weights(weights_a, global_steps=(manager.global_steps or 0) + 1)
    return [engine, engine_b]


@pytest.fixture
async def manager(both_on_a: list[VLLMEngine]) -> AsyncIterator[AsyncServerManager]:
    async with AsyncServerManager(both_on_a) as started:
        yield started
        assert started.statistics().in_flight == 0
    for engine in both_on_a:
        assert engine.statistics().in_flight == 0


# -- loops on real engines -------------------------------------------------------------------


async def test_single_turn_output_is_consistent(manager: AsyncServerManager) -> None:
    params = {"ignore_eos": True, "temperature": 1.0}
    loop = SingleTurnAgentLoop(manager, max_response_tokens=24, sampling_params=params)
    output = await loop.run(Sample(prompt_ids=prompt(1, 8)))
    assert_consistent(output, budget=24)
    assert len(output.response_ids) == 24 and output.response_mask == (1,) * 24
    assert output.stop_reason == "length" and output.num_turns == 1
    assert output.global_steps == (manager.global_steps,) * 24
    assert output.metrics == loop.statistics()
    assert params == {"ignore_eos": True, "temperature": 1.0}, "the caller's dict is untouched"


async def test_tool_loop_masks_exactly_the_tool_tokens(manager: AsyncServerManager) -> None:
    calls: list[list[int]] = []

    async def record(token_ids: list[int]) -> str:
        calls.append(token_ids)
        return f"result{len(calls)}"

    loop = Scripted(manager, script=[CALL, CALL, PLAIN], tools={"echo": record},
                    parser=token_parser(), max_response_tokens=64)
    output = await loop.run(Sample(prompt_ids=prompt(2)))
    assert_consistent(output, budget=64)
    ids, mask = scripted_response((CALL, "result1"), (CALL, "result2"), (PLAIN, None))
    assert (output.response_ids, output.response_mask) == (ids, mask)
    assert calls == [[], []]  # a forced turn is the call token alone: no argument tokens
    assert output.stop_reason == "stop" and output.num_turns == 3
    assert output.global_steps == (manager.global_steps,) * len(ids)
    stats = output.metrics
    assert (stats.num_tool_calls, stats.num_tool_errors, stats.num_interrupted) == (2, 0, 0)
    assert output.metrics == loop.statistics()


@pytest.mark.parametrize("max_turns", [1, 2])
async def test_turn_limit_ends_the_trajectory_without_running_the_last_call(
    manager: AsyncServerManager, max_turns: int
) -> None:
    loop = Scripted(manager, script=[CALL], tools={"echo": echo}, parser=token_parser(),
                    max_response_tokens=64, max_turns=max_turns)
    output = await loop.run(Sample(prompt_ids=prompt(3, 10)))
    assert_consistent(output, budget=64)
    assert output.stop_reason == "max_turns" and output.num_turns == max_turns
    assert output.metrics.num_tool_calls == max_turns - 1


async def test_response_budget_is_never_exceeded(manager: AsyncServerManager) -> None:
    """Model and tool tokens share the budget: at every budget the response is a prefix of the
    unbounded one, fits, and ends with a model token."""
    budgets = [1, 5, 6, 7, 8, 12, 13, 14, 30]
    loops = [
        Scripted(manager, script=[CALL, CALL, FILLER], tools={"echo": echo},
                 parser=token_parser(), max_response_tokens=budget)
        for budget in budgets
    ]
    outputs = await asyncio.gather(*(loop.run(Sample(prompt_ids=prompt(4, 10))) for loop in loops))
    unbounded, _ = scripted_response((CALL, "echo0"), (CALL, "echo0"))
    for budget, output in zip(budgets, outputs, strict=True):
        assert_consistent(output, budget=budget)
        assert output.stop_reason == "length"
        size = len(output.response_ids)
        assert output.response_ids[: len(unbounded)] == unbounded[:size]
        if output.response_ids[-1] == FILLER:
            assert size == budget, "a free-running turn takes all that is left"
    by_budget = dict(zip(budgets, (len(out.response_ids) for out in outputs), strict=True))
    # echo0 is 5 tokens: at budget 6 they would leave no room for a model turn, so they drop.
    assert by_budget[5] == by_budget[6] == 1 and by_budget[7] == 7 and by_budget[13] == 13


async def test_turns_stay_on_one_engine_and_hit_the_prefix_cache(
    manager: AsyncServerManager,
) -> None:
    recorder = Recorder(manager)
    loops = [
        Scripted(recorder, session_key=f"cache-{i}", script=[CALL, CALL, PLAIN],
                 tools={"echo": echo}, parser=token_parser(), max_response_tokens=64)
        for i in range(2)
    ]
    outputs = await asyncio.gather(
        *(loop.run(Sample(prompt_ids=prompt(10 + i))) for i, loop in enumerate(loops))
    )
    for i, output in enumerate(outputs):
        turns = recorder.turns[f"cache-{i}"]
        assert len(turns) == output.num_turns == 3
        assert len({engine for turn in turns for engine in turn.engines}) == 1
        assert all(turn.num_cached_tokens > 0 for turn in turns[1:])
        assert output.metrics.num_cached_tokens == sum(t.num_cached_tokens for t in turns)


@pytest.mark.parametrize("resume_mode", ["abort", "keep"])
async def test_weight_update_while_a_tool_runs_relabels_only_later_turns(
    both_on_a: list[VLLMEngine], weights_a: dict[str, Any], resume_mode: ResumeMode
) -> None:
    async with AsyncServerManager(both_on_a, resume_mode=resume_mode) as manager:
        outputs, old = await _roll_out_across_an_update(manager, weights_a)
    ids, mask = scripted_response((GATED, "done"), (PLAIN, None))
    assert (outputs[0].response_ids, outputs[0].response_mask) == (ids, mask)
    # The tool tokens carry the version of the turn that made the call; the next turn the new.
    assert outputs[0].global_steps == (old,) * 5 + (old + 1,)
    assert outputs[0].metrics.num_interrupted == 0, "an update during a tool cuts no turn"
    assert outputs[0].metrics.tool_time_s > 0
    for output in outputs[1:]:
        assert_consistent(output, budget=160)
        assert set(output.global_steps) <= {old, old + 1}
    for engine in both_on_a:
        assert engine.statistics().in_flight == 0


async def _roll_out_across_an_update(
    manager: AsyncServerManager, weights_a: dict[str, Any]
) -> tuple[list[AgentLoopOutput], int]:
    """One trajectory waits in a tool while the update runs; three generate long turns."""
    started, release = asyncio.Event(), asyncio.Event()

    async def gated(token_ids: list[int]) -> str:
        started.set()
        await release.wait()
        return "done"

    tools = {"echo": echo, "gated": gated}
    gated_loop = Scripted(manager, script=[GATED, PLAIN], tools=tools, parser=token_parser(),
                          max_response_tokens=32)
    long_loops = [
        Scripted(manager, script=[CALL, FILLER], tools=tools, parser=token_parser(),
                 max_response_tokens=160)
        for _ in range(3)
    ]
    old = manager.global_steps
    assert old is not None
    tasks = [asyncio.create_task(loop.run(Sample(prompt_ids=prompt(20 + i))))
             for i, loop in enumerate([gated_loop, *long_loops])]
    await started.wait()  # the gated trajectory is in its tool, in no engine
    await manager.update_weights(weights_a, global_steps=old + 1)
    release.set()
    return list(await asyncio.gather(*tasks)), old


@pytest.mark.parametrize("failure", ["raises", "times_out", "malformed", "unknown_tool"])
async def test_a_failed_tool_call_becomes_an_error_turn(
    manager: AsyncServerManager, failure: str
) -> None:
    never = asyncio.Event()

    async def boom(token_ids: list[int]) -> str:
        raise ValueError("boom")

    async def hang(token_ids: list[int]) -> str:
        await never.wait()
        return "unreachable"

    def no_empty_arguments(token_ids: Sequence[int]) -> dict[str, Any]:
        if not token_ids:
            raise ValueError("a call needs argument tokens")
        return {"token_ids": list(token_ids)}

    parser = token_parser(decode_arguments=no_empty_arguments) if failure == "malformed" else (
        TokenToolCallParser({CALL: "nope"}, encode=encode) if failure == "unknown_tool"
        else token_parser()
    )
    tool = {"raises": boom, "times_out": hang}.get(failure, echo)
    loop = Scripted(manager, script=[CALL, PLAIN], tools={"echo": tool}, parser=parser,
                    max_response_tokens=128, tool_timeout=0.05)
    output = await loop.run(Sample(prompt_ids=prompt(5, 10)))
    assert_consistent(output, budget=128)
    message = {
        "raises": "error: tool 'echo' raised ValueError: boom",
        "times_out": "error: tool 'echo' timed out after 0.05 s",
        "malformed": "error: malformed tool call: a call needs argument tokens",
        "unknown_tool": "error: unknown tool 'nope' (tools: echo)",
    }[failure]
    ids, mask = scripted_response((CALL, message), (PLAIN, None))
    assert (output.response_ids, output.response_mask) == (ids, mask)
    assert output.stop_reason == "stop"
    assert (output.metrics.num_tool_calls, output.metrics.num_tool_errors) == (1, 1)


async def test_hermes_parser_in_a_rollout_reports_a_malformed_call(
    manager: AsyncServerManager,
) -> None:
    tokenizer = hermes_tokenizer()
    open_tag, end_of_turn = tokenizer.convert_tokens_to_ids(["<tool_call>", "<|im_end|>"])
    loop = Scripted(manager, script=[open_tag, end_of_turn], tools={"echo": echo},
                    parser=HermesToolCallParser(tokenizer), max_response_tokens=200)
    output = await loop.run(Sample(prompt_ids=prompt(6, 10)))
    assert_consistent(output, budget=200)
    inserted = tokenizer.decode(list(output.response_ids[1:-1]), skip_special_tokens=False)
    assert inserted == (
        "\n<|im_start|>user\n<tool_response>\nerror: malformed tool call: <tool_call> is never "
        "closed\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert output.response_mask == (1,) + (0,) * (len(output.response_ids) - 2) + (1,)
    assert output.stop_reason == "stop" and output.num_turns == 2


async def test_custom_example_loop_runs(manager: AsyncServerManager) -> None:
    example = load_example()
    assert len(inspect.getsource(example.ReviseLoop).splitlines()) < 40
    samples = [Sample(prompt_ids=prompt(7 + i, 8)) for i in range(3)]
    results = await run_agent_loops(manager, samples, loop="revise", progress=False)
    for sample, result in zip(samples, results, strict=True):
        assert isinstance(result, AgentLoopOutput)
        assert_consistent(result, budget=example.ReviseLoop.budget)
        assert result.prompt_ids == sample.prompt_ids and result.num_turns == 2
        zeros = [i for i, bit in enumerate(result.response_mask) if bit == 0]
        assert [result.response_ids[i] for i in zeros] == list(example.FEEDBACK)


# -- the runner ------------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    def __enter__(self) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

    def __exit__(self, *exc: object) -> None:
        self.active -= 1


class Observed(SingleTurnAgentLoop):
    """Single turn; counts concurrent runs; a sample may wait for an event first."""

    def __init__(self, manager: ServerManager, *, counter: Counter,
                 events: Mapping[str, asyncio.Event], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.counter = counter
        self.events = events

    async def run(self, sample: Sample) -> AgentLoopOutput:
        with self.counter:
            if "wait" in sample.data:
                await self.events[sample.data["wait"]].wait()
            output = await super().run(sample)
            if "set" in sample.data:
                self.events[sample.data["set"]].set()
            return output


async def test_runner_keeps_order_and_reports_a_failing_sample_in_place(
    manager: AsyncServerManager,
) -> None:
    """Sample 0 finishes last (it waits for sample 5); sample 2 has a token outside the vocab."""
    counter = Counter()
    samples = [Sample(prompt_ids=(5 + i, 6, 7)) for i in range(6)]
    samples[0] = Sample(prompt_ids=(5, 6, 7), data={"wait": "last"})
    samples[2] = Sample(prompt_ids=(5, 99_999))
    samples[5] = Sample(prompt_ids=(10, 6, 7), data={"set": "last"})
    results = await run_agent_loops(
        manager, samples, loop=Observed, max_concurrency=3, progress=True,
        loop_kwargs={"counter": counter, "events": {"last": asyncio.Event()},
                     "max_response_tokens": 4},
    )
    failure = results[2]
    assert isinstance(failure, AgentLoopFailure) and failure.index == 2
    assert isinstance(failure.error, InvalidRequestError)
    for i, (sample, result) in enumerate(zip(samples, results, strict=True)):
        if i != 2:
            assert isinstance(result, AgentLoopOutput) and result.prompt_ids == sample.prompt_ids
            assert_consistent(result, budget=4)
    assert counter.peak == 3 and counter.active == 0


async def test_runner_respects_max_concurrency(manager: AsyncServerManager) -> None:
    counter = Counter()
    samples = [Sample(prompt_ids=(5 + i, 6)) for i in range(10)]
    results = await run_agent_loops(
        manager, samples, loop=Observed, max_concurrency=4, progress=False,
        loop_kwargs={"counter": counter, "events": {}, "max_response_tokens": 2},
    )
    assert all(isinstance(result, AgentLoopOutput) for result in results)
    assert counter.peak == 4


async def test_runner_by_registered_name(manager: AsyncServerManager) -> None:
    results = await run_agent_loops(
        manager, [Sample(prompt_ids=prompt(8, 20))], loop="tool", progress=False,
        loop_kwargs={"tools": {"echo": echo}, "parser": token_parser(), "max_response_tokens": 8,
                     "sampling_params": {"allowed_token_ids": [PLAIN], "ignore_eos": True}},
    )
    (output,) = results
    assert isinstance(output, AgentLoopOutput)
    assert output.response_ids == (PLAIN,) * 8 and output.stop_reason == "length"


async def test_cancelling_the_runner_leaves_nothing_running(manager: AsyncServerManager) -> None:
    started = asyncio.Event()
    cancelled: list[str] = []

    async def gated(token_ids: list[int]) -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("tool")
            raise
        return "unreachable"

    samples = [Sample(prompt_ids=prompt(40 + i), data={"script": [GATED] if i % 2 else [FILLER]})
               for i in range(4)]
    before = manager.statistics().num_requests
    runner = asyncio.create_task(run_agent_loops(
        manager, samples, loop=Scripted, progress=False,
        loop_kwargs={"script": [], "tools": {"gated": gated}, "parser": token_parser(),
                     "max_response_tokens": 300},
    ))
    await started.wait()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert cancelled and set(cancelled) == {"tool"}
    stats = manager.statistics()
    assert stats.in_flight == 0 and stats.num_requests > before


# -- pure logic ------------------------------------------------------------------------------


def test_public_api_is_sorted_and_complete() -> None:
    module = asyncroll.agent_loop
    assert list(module.__all__) == sorted(module.__all__)
    public = {name for name in vars(module) if not name.startswith("_")}
    public -= {"base", "loops", "output", "parsers", "registry", "runner", "tools"}  # modules
    assert public == set(module.__all__)


def test_registry_names_builtins_and_rejects_clashes() -> None:
    assert {"single_turn", "tool"} <= set(registered_agent_loops())
    assert agent_loop_class("tool") is ToolAgentLoop
    with pytest.raises(InvalidRequestError, match="no agent loop named 'nope'"):
        agent_loop_class("nope")
    with pytest.raises(InvalidRequestError, match="already registered"):
        register_agent_loop("tool")(SingleTurnAgentLoop)
    assert agent_loop_class("tool") is ToolAgentLoop


async def test_bad_configuration_fails_before_any_request(manager: AsyncServerManager) -> None:
    before = manager.statistics().num_requests
    sample = Sample(prompt_ids=(5, 6))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SingleTurnAgentLoop(manager, max_response_tokens=8, sampling_params={"max_tokens": 4})
    with pytest.raises(InvalidRequestError, match="max_turns"):
        ToolAgentLoop(manager, tools={}, parser=token_parser(), max_response_tokens=8,
                      max_turns=0)
    with pytest.raises(InvalidRequestError, match="budget"):
        SingleTurnAgentLoop(manager, max_response_tokens=0)
    with pytest.raises(InvalidRequestError, match="max_concurrency"):
        await run_agent_loops(manager, [sample], loop="single_turn", max_concurrency=0,
                              loop_kwargs={"max_response_tokens": 4})
    with pytest.raises(InvalidRequestError, match="configuration"):
        await run_agent_loops(manager, [sample], loop="single_turn", progress=False,
                              loop_kwargs={"max_response_tokens": 4, "colour": "blue"})
    assert await run_agent_loops(manager, [], loop="single_turn", progress=False,
                                 loop_kwargs={"max_response_tokens": 4}) == []
    assert manager.statistics().num_requests == before


def test_response_builder_refuses_to_overrun_and_keeps_its_state() -> None:
    response = ResponseBuilder(budget=4)
    turn = TokenOutput(request_id="r", token_ids=(1, 2, 3), log_probs=(-0.5,) * 3,
                       global_steps=(3, 3, 4), finish_reason="stop", num_preempted=0,
                       engines=("e",), num_prompt_tokens=2, num_cached_tokens=0)
    response.add_model(turn)
    with pytest.raises(InvalidRequestError, match="budget"):
        response.add_environment([9, 9])
    assert len(response) == 3 and response.remaining == 1
    response.add_environment([9])
    metrics = AgentLoopMetrics(generate_time_s=0.0, tool_time_s=0.0, num_interrupted=0,
                               num_tool_calls=0, num_tool_errors=0, num_cached_tokens=0)
    output = response.build(prompt_ids=[7, 8], num_turns=1, stop_reason="length",
                            metrics=metrics)
    assert output.response_mask == (1, 1, 1, 0) and output.global_steps == (3, 3, 4, 4)
    assert output.response_log_probs[-1] == 0.0
    assert output.with_reward(1.0).reward == 1.0 and output.reward is None
    assert (output.min_global_steps, output.max_global_steps) == (3, 4)


def test_output_rejects_inconsistent_lengths_and_masks() -> None:
    metrics = AgentLoopMetrics(generate_time_s=0.0, tool_time_s=0.0, num_interrupted=0,
                               num_tool_calls=0, num_tool_errors=0, num_cached_tokens=0)
    good: dict[str, Any] = dict(prompt_ids=(1,), response_ids=(2, 3), response_mask=(1, 0),
                                response_log_probs=(-1.0, 0.0), global_steps=(1, 1),
                                num_turns=1, stop_reason="stop", metrics=metrics)
    AgentLoopOutput(**good)
    for bad in [{"response_mask": (1,)}, {"response_log_probs": (-1.0, -2.0)},
                {"response_mask": (1, 2)}]:
        with pytest.raises(InvalidRequestError):
            AgentLoopOutput(**{**good, **bad})


def test_token_parser_reads_calls_and_arguments() -> None:
    parser = token_parser()
    assert parser.stop_token_ids == (CALL, GATED)
    assert parser.parse([7, 8]) == []
    assert parser.parse([7, 8, CALL, 9, GATED, 10]) == [
        ToolCall(name="echo", arguments={"token_ids": [7, 8]}),
        ToolCall(name="gated", arguments={"token_ids": [9]}),
    ]
    results = [ToolResult(name="echo", content="ab"), ToolResult(name="x", content="c")]
    assert parser.encode_results(results) == encode("abc")


def hermes_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges (one token a byte) plus the Hermes/Qwen special tokens:
    262 ids, inside the tiny models' vocabulary of 512."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>",
                                  "<tool_response>", "</tool_response>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_hermes_parser_reads_calls_and_reports_malformed_ones() -> None:
    tokenizer = hermes_tokenizer()
    parser = HermesToolCallParser(tokenizer)

    def parse(text: str) -> list[ToolCall | MalformedToolCall]:
        return parser.parse(tokenizer.encode(text, add_special_tokens=False))

    assert parse("no call here<|im_end|>") == []
    assert parse(
        'think <tool_call>{"name": "search", "arguments": {"q": "vllm"}}</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 1}"}</tool_call><|im_end|>'
    ) == [ToolCall(name="search", arguments={"q": "vllm"}),
          ToolCall(name="calc", arguments={"x": 1})]
    for text, reason in [
        ("<tool_call>{not json}</tool_call>", "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "string name"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "a", "arguments": "{x"}</tool_call>', "arguments are invalid"),
        ('<tool_call>{"name": "a"', "never closed"),
    ]:
        (call,) = parse(text)
        assert isinstance(call, MalformedToolCall) and reason in call.reason, (text, call)
    encoded = parser.encode_results([ToolResult(name="search", content="42"),
                                     ToolResult(name="calc", content="x", is_error=True)])
    assert tokenizer.decode(encoded, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nx\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


async def test_concurrent_calls_of_one_turn_keep_their_order() -> None:
    release = asyncio.Event()

    async def slow(token_ids: list[int]) -> str:
        await release.wait()
        return "slow"

    async def fast(token_ids: list[int]) -> str:
        release.set()
        return "fast"

    class Offline(AgentLoop[Sample]):
        async def run(self, sample: Sample) -> AgentLoopOutput:
            raise NotImplementedError

    loop = Offline(None, session_key="s")  # type: ignore[arg-type]  # no turn is generated
    calls = [ToolCall(name="slow", arguments={"token_ids": []}),
             ToolCall(name="fast", arguments={"token_ids": []}),
             MalformedToolCall(reason="bad")]
    results = await loop.call_tools(calls, tools={"slow": slow, "fast": fast}, call_timeout=None)
    assert [r.content for r in results] == ["slow", "fast", "error: malformed tool call: bad"]
    assert loop.statistics().num_tool_calls == 3 and loop.statistics().num_tool_errors == 1
    assert repr(loop) == "<Offline session=s turns=0 tool_calls=3>"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_agent_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect finds a class's source through its module
    spec.loader.exec_module(module)
    return module


class Replay:
    """A ServerManager that answers with prepared outputs, for loop logic without engines."""

    def __init__(self, *outputs: TokenOutput) -> None:
        self.outputs = list(outputs)
        self.calls: list[tuple[str, str | None, dict[str, Any]]] = []

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        session_key: str | None = None,
    ) -> TokenOutput:
        self.calls.append((request_id, session_key, dict(sampling_params or {})))
        return self.outputs.pop(0)


def replayed(steps: tuple[int, ...], *, preempted: int = 0, finish: Any = "stop") -> TokenOutput:
    return TokenOutput(request_id="r", token_ids=(PLAIN,) * len(steps),
                       log_probs=(-1.0,) * len(steps), global_steps=steps, finish_reason=finish,
                       num_preempted=preempted, engines=("e",), num_prompt_tokens=1,
                       num_cached_tokens=0)


async def test_interruptions_count_resumes_and_keep_mode_version_changes() -> None:
    class TwoTurns(AgentLoop[Sample]):
        async def run(self, sample: Sample) -> AgentLoopOutput:
            response = ResponseBuilder(budget=16)
            for _ in range(2):
                response.add_model(await self.generate(sample.prompt_ids, {"max_tokens": 8}))
            return self.finish(sample.prompt_ids, response, stop_reason="stop")

    keep_mode = replayed((1, 1, 2, 2))  # frozen across an update: no resume, a version change
    abort_mode = replayed((2, 3, 3), preempted=2)  # resumed twice, once with the same version
    manager = Replay(keep_mode, abort_mode)
    output = await TwoTurns(manager, session_key="s").run(Sample(prompt_ids=(5,)))
    assert output.metrics.num_interrupted == 1 + 2
    assert [(rid, key) for rid, key, _ in manager.calls] == [("s/0", "s"), ("s/1", "s")]
    assert output.global_steps == (1, 1, 2, 2, 2, 3, 3) and output.num_turns == 2


async def test_an_aborted_turn_ends_the_trajectory_flagged() -> None:
    """With partial_rollout=False the manager returns interrupted turns as "abort"."""
    manager = Replay(replayed((1, 1), finish="abort"))
    loop = ToolAgentLoop(manager, tools={}, parser=token_parser(), max_response_tokens=8)
    output = await loop.run(Sample(prompt_ids=(5,)))
    assert output.stop_reason == "abort" and output.num_turns == 1
    ((_, _, params),) = manager.calls
    assert params == {"max_tokens": 8, "stop_token_ids": [CALL, GATED]}
