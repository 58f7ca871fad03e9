"""The engine contract, as checks any engine must pass (as trio ships ``check_one_way_stream``).

``check_engine(engine)`` runs the generation contract (``asyncroll.interfaces.Engine``);
``check_updatable_engine(engine, updater, weights)`` the update contract (``UpdatableEngine``
under a ``WeightUpdater``). ``VLLMEngine`` and ``FakeEngine`` pass both (tests/test_contract.py);
so must any new engine (a Ray engine, an HTTP engine). Each check is also in ``ENGINE_CHECKS`` /
``UPDATE_CHECKS`` by name, for a test suite that wants one test per check.

The checks leave the engine as they found it (idle, running, same weights) except for its
version label, which only rises. They wait on events (requests inside the engine, a clock
request finishing after them), never on time: a slow machine makes them slower, not flaky.
One race no event closes: between a request's first tokens and the check's action on it (an
abort, a pause, an update), the engine decodes on while the checking process may be stalled
(a full garbage collection, a busy core). A check that finds a request ran to its token budget
first raises ``LateAction``, and ``retry_if_late`` runs it again (``ATTEMPTS`` runs at most):
an engine whose action never lands fails, a stalled machine does not.
``weights`` must be the weights the engine serves, so outputs stay unchanged across updates.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from asyncroll.errors import EngineSleepingError, InvalidRequestError
from asyncroll.interfaces import Engine, ReceivingEngine, UpdatableEngine, WeightUpdater
from asyncroll.types import Segment, TokenOutput

__all__ = [
    "ATTEMPTS",
    "ENGINE_CHECKS",
    "LateAction",
    "UPDATE_CHECKS",
    "bad_inputs",
    "check_engine",
    "check_updatable_engine",
    "ran_to_budget",
    "requests_inside",
    "retry_if_late",
    "until_decoding",
    "until_waiting",
]

PROMPT = [5, 6, 7, 8]
_ids = itertools.count()
logger = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")

ATTEMPTS = 3
"""Runs of a scenario whose action came late (``LateAction``) before it counts as a failure."""


class LateAction(Exception):
    """A request ran to its token budget before the scenario's action (an abort, a pause, an
    update) reached its engine: the process that acts was stalled that long. A scheduling
    accident, not a breach of the contract: ``retry_if_late`` runs the scenario again. Raise it
    only once the scenario has cleaned up (its requests ended, its engines resumed)."""


def ran_to_budget(
    result: Segment | TokenOutput, budget: int, *, update: int | None = None
) -> bool:
    """Whether ``result`` ran out its ``budget`` of tokens before the action meant to catch it
    mid-decode: it ended by length, and (with ``update``) no token of it is from that update's
    weights or later ones. An engine that never lands the action looks the same, every run."""
    if result.finish_reason != "length" or len(result.token_ids) != budget:
        return False
    return update is None or all(v is None or v < update for v in result.global_steps)


def retry_if_late(scenario: Callable[_P, Awaitable[_T]]) -> Callable[_P, Awaitable[_T]]:
    """Run ``scenario`` again when it raises ``LateAction``, ``ATTEMPTS`` runs in all; the last
    one's ``LateAction`` becomes an ``AssertionError``. The arguments are the same each run (a
    test's fixtures): the scenario makes its own request ids and reads the engine's state."""

    @functools.wraps(scenario)
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return await scenario(*args, **kwargs)
            except LateAction as late:
                if attempt == ATTEMPTS:
                    raise AssertionError(
                        f"{scenario.__name__}: the action came late in all {ATTEMPTS} runs: "
                        f"{late}"
                    ) from late
                logger.warning("%s: run %d of %d came late (%s); running it again",
                               scenario.__name__, attempt, ATTEMPTS, late)
        raise AssertionError("unreachable")

    return run


def _params(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, **extra}


def _rid(what: str) -> str:
    return f"contract-{what}-{next(_ids)}"


async def until_decoding(
    engine: Engine, num_requests: int | Sequence[asyncio.Future[Any]]
) -> None:
    """Return once ``num_requests`` requests are inside ``engine`` and have each decoded.
    Given the requests' tasks instead of a number, it waits for those not done: one that ran
    out its tokens meanwhile is not waited for (the caller's ``LateAction`` then).

    A clock request sent once they are inside finishes only after they were all scheduled (an
    engine schedules running requests first, in arrival order), so each has tokens by then.
    "Inside" is what vLLM itself tracks, in our process or in a Ray actor's (whose calls may
    run out of order: the adapter's own count goes up before the call is even sent).
    """
    def needed() -> int:
        if isinstance(num_requests, int):
            return num_requests
        return sum(not task.done() for task in num_requests)

    while await requests_inside(engine) < needed():  # noqa: ASYNC110
        await asyncio.sleep(0.005)  # vLLM offers no event for it: the time only spaces polls
    await engine.generate(_rid("clock"), prompt_ids=[9], sampling_params=_params(8))


async def requests_inside(engine: Engine) -> int:
    """Requests inside ``engine``'s vLLM, in our process or a Ray actor's (a fake engine: those
    it admitted): what a test waits on before it acts on running requests."""
    local = getattr(engine, "num_unfinished_in_vllm", None)
    if local is not None:
        return int(local())
    remote = getattr(engine, "remote_unfinished", None)
    if remote is not None:
        return int(await remote())
    return engine.statistics().in_flight


def bad_inputs(engine: Engine) -> list[tuple[str, Any, Any]]:
    """(what, prompt_ids, sampling_params) every engine refuses with ``InvalidRequestError``."""
    vocab, context = engine.vocab_size, engine.max_model_len
    return [
        ("empty prompt", [], _params(4)),
        ("token id past the vocabulary", [5, vocab], _params(4)),
        ("negative token id", [-1, 5], _params(4)),
        ("text instead of ids", "hello", _params(4)),
        ("prompt + max_tokens over the context", [5] * (context - 100), _params(200)),
        ("zero max_tokens", PROMPT, _params(0)),
        ("negative max_tokens", PROMPT, _params(-3)),
        ("n > 1", PROMPT, _params(4, n=2)),
        ("unknown sampling key", PROMPT, _params(4, no_such_key=1)),
        ("negative temperature", PROMPT, _params(4, temperature=-1.0)),
        ("stop token past the vocabulary", PROMPT, _params(4, stop_token_ids=[vocab + 10])),
        ("request id not a str", PROMPT, _params(4)),
    ]


def _assert_consistent(segment: Segment) -> None:
    assert len(segment.token_ids) == len(segment.log_probs) == len(segment.global_steps), segment
    assert all(lp <= 0.0 for lp in segment.log_probs), segment.log_probs


def _assert_idle(engine: Engine) -> None:
    stats = engine.statistics()
    assert stats.in_flight == 0, stats
    assert not stats.paused and not stats.holding, stats


# -- the generation contract ------------------------------------------------------------------


async def concurrent_requests_all_complete(engine: Engine) -> None:
    segments = await asyncio.gather(
        *(
            engine.generate(_rid("c"), prompt_ids=[i + 2, 3, 4], sampling_params=_params(24))
            for i in range(32)
        )
    )
    for segment in segments:
        _assert_consistent(segment)
        assert len(segment.token_ids) == 24 and segment.finish_reason == "length"
        assert set(segment.global_steps) == {engine.global_steps}
    _assert_idle(engine)


async def same_seed_same_tokens(engine: Engine) -> None:
    for params in (_params(16, temperature=0.0), _params(16, seed=1234)):
        first = await engine.generate(_rid("s"), prompt_ids=PROMPT, sampling_params=params)
        second = await engine.generate(_rid("s"), prompt_ids=PROMPT, sampling_params=params)
        assert first.token_ids == second.token_ids


@retry_if_late
async def abort_returns_partial_output(engine: Engine) -> None:
    rid = _rid("abort")
    task = asyncio.ensure_future(
        engine.generate(rid, prompt_ids=PROMPT, sampling_params=_params(400))
    )
    await until_decoding(engine, [task])
    await engine.abort(rid)
    segment = await task
    if ran_to_budget(segment, 400):
        raise LateAction("the request ran out its 400 tokens before the abort")
    assert segment.finish_reason == "abort" and 0 < len(segment.token_ids) < 400, segment
    _assert_consistent(segment)
    _assert_idle(engine)


@retry_if_late
async def pause_abort_ends_requests_and_gates_admission(engine: Engine) -> None:
    tasks = [
        asyncio.ensure_future(
            engine.generate(_rid("pa"), prompt_ids=PROMPT, sampling_params=_params(400))
        )
        for _ in range(3)
    ]
    await until_decoding(engine, tasks)
    await engine.pause("abort")
    try:
        late = asyncio.ensure_future(
            engine.generate(_rid("late"), prompt_ids=PROMPT, sampling_params=_params(5))
        )
        segments = await asyncio.gather(*tasks)
        assert not late.done()  # admission is gated while paused
    finally:
        await engine.resume()
    assert len((await late).token_ids) == 5
    _assert_idle(engine)
    if any(ran_to_budget(segment, 400) for segment in segments):
        raise LateAction("a request ran out its 400 tokens before the pause")
    for segment in segments:
        assert segment.finish_reason == "abort" and 0 < len(segment.token_ids) < 400
        _assert_consistent(segment)


async def until_waiting(engine: Engine, num_requests: int) -> None:
    """Return once ``num_requests`` requests wait to be admitted to ``engine`` (each registers
    at the gate in its task's first steps: a bounded number of loop turns)."""
    for _ in range(10_000):
        if engine.statistics().waiting >= num_requests:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{num_requests} requests never waited at {engine.name}'s gate")


async def abort_ends_a_request_waiting_to_be_admitted(engine: Engine) -> None:
    """A request aborted while it waits at the gate (the engine paused) ends at once, with no
    tokens, and never runs; the request beside it runs once the engine resumes."""
    await engine.pause("abort")
    try:
        gated = _rid("gated")
        task = asyncio.ensure_future(
            engine.generate(gated, prompt_ids=PROMPT, sampling_params=_params(5))
        )
        other = asyncio.ensure_future(
            engine.generate(_rid("gated"), prompt_ids=PROMPT, sampling_params=_params(5))
        )
        await until_waiting(engine, 2)
        await engine.abort(gated)
        # Ends while the engine is still paused; the bound only turns a hang into a failure.
        segment = await asyncio.wait_for(task, 60)
        assert segment.finish_reason == "abort" and segment.token_ids == (), segment
        _assert_consistent(segment)
        stats = engine.statistics()
        assert not other.done() and stats.waiting == 1, stats
        assert stats.num_aborted <= stats.num_requests, stats  # counted as a request too
    finally:
        await engine.resume()
    assert len((await other).token_ids) == 5
    _assert_idle(engine)


@retry_if_late
async def pause_keep_freezes_and_resumes_to_completion(engine: Engine) -> None:
    tasks = [
        asyncio.ensure_future(
            engine.generate(_rid("pk"), prompt_ids=PROMPT, sampling_params=_params(300))
        )
        for _ in range(3)
    ]
    await until_decoding(engine, tasks)
    await engine.pause("keep")
    try:
        assert engine.statistics().paused
        ended_first = [task for task in tasks if task.done()]
    finally:
        await engine.resume()
    for segment in await asyncio.gather(*tasks):
        assert segment.finish_reason == "length" and len(segment.token_ids) == 300
        _assert_consistent(segment)
    _assert_idle(engine)
    if ended_first:  # done while paused: it ran out its tokens before the pause landed
        raise LateAction(f"{len(ended_first)} requests ran out their tokens before the pause")


async def bad_input_is_refused_and_others_complete(engine: Engine) -> None:
    for what, prompt, params in bad_inputs(engine):
        good = asyncio.ensure_future(
            engine.generate(_rid("good"), prompt_ids=PROMPT, sampling_params=_params(16))
        )
        rejected = engine.statistics().num_rejected
        rid: Any = 7 if what == "request id not a str" else _rid("bad")
        try:
            await engine.generate(rid, prompt_ids=prompt, sampling_params=params)
        except InvalidRequestError:
            pass
        else:
            raise AssertionError(f"{what}: accepted")
        assert len((await good).token_ids) == 16, what
        assert engine.statistics().num_rejected == rejected + 1, what
        assert not engine.is_dead, what
    _assert_idle(engine)


async def duplicate_live_request_id_is_refused(engine: Engine) -> None:
    rid = _rid("dup")
    first = asyncio.ensure_future(
        engine.generate(rid, prompt_ids=PROMPT, sampling_params=_params(64))
    )
    # One turn runs the first call's first step, and an engine registers a request id
    # there, before any await: this test fails for an engine that registers later (a
    # Ray proxy that left the check to its actor did, when the two calls reached the
    # actor in the other order).
    await asyncio.sleep(0)
    try:
        await engine.generate(rid, prompt_ids=PROMPT, sampling_params=_params(4))
    except InvalidRequestError as exc:
        assert "already live" in str(exc)
    else:
        raise AssertionError("a live request id was accepted twice")
    assert len((await first).token_ids) == 64


async def sampling_params_are_not_mutated(engine: Engine) -> None:
    params = _params(4)
    snapshot = dict(params)
    await engine.generate(_rid("nm"), prompt_ids=PROMPT, sampling_params=params)
    assert params == snapshot


@retry_if_late
async def cancelling_the_caller_aborts_the_request(engine: Engine) -> None:
    rid = _rid("cancel")
    task = asyncio.ensure_future(
        engine.generate(rid, prompt_ids=PROMPT, sampling_params=_params(400))
    )
    await until_decoding(engine, [task])
    task.cancel()
    try:
        segment = await task
    except asyncio.CancelledError:
        pass
    else:
        if ran_to_budget(segment, 400):  # it had ended before the cancel
            raise LateAction("the request ran out its 400 tokens before the cancel")
        raise AssertionError("the cancelled request completed")
    _assert_idle(engine)
    inside = getattr(engine, "num_unfinished_in_vllm", None)
    assert inside is None or inside() == 0
    again = await engine.generate(rid, prompt_ids=PROMPT, sampling_params=_params(4))
    assert len(again.token_ids) == 4  # the id is free again and the engine serves


ENGINE_CHECKS: dict[str, Callable[[Engine], Awaitable[None]]] = {
    check.__name__: check
    for check in (
        concurrent_requests_all_complete,
        same_seed_same_tokens,
        abort_returns_partial_output,
        pause_abort_ends_requests_and_gates_admission,
        abort_ends_a_request_waiting_to_be_admitted,
        pause_keep_freezes_and_resumes_to_completion,
        bad_input_is_refused_and_others_complete,
        duplicate_live_request_id_is_refused,
        sampling_params_are_not_mutated,
        cancelling_the_caller_aborts_the_request,
    )
}


async def check_engine(engine: Engine) -> None:
    """Run every generation check on ``engine`` (raises ``AssertionError`` on a breach)."""
    for check in ENGINE_CHECKS.values():
        await check(engine)


# -- the update contract ----------------------------------------------------------------------

UpdateCheck = Callable[
    [UpdatableEngine, WeightUpdater, Mapping[str, torch.Tensor]], Awaitable[None]
]


async def update_labels_new_tokens(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    steps = (engine.global_steps or 0) + 1
    report = await updater.update(weights, global_steps=steps)
    assert report.global_steps == steps and engine.global_steps == steps
    segment = await engine.generate(_rid("new"), prompt_ids=PROMPT, sampling_params=_params(8))
    assert set(segment.global_steps) == {steps}
    await updater.update(weights, global_steps=None)  # None keeps the label
    assert engine.global_steps == steps
    _assert_idle(engine)


async def versions_never_go_backwards(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    steps = (engine.global_steps or 0) + 2
    await updater.update(weights, global_steps=steps)
    for bad in (steps - 1, -1, "3", 18.5, True, 2**70):
        try:
            await updater.update(weights, global_steps=bad)  # type: ignore[arg-type]
        except InvalidRequestError:
            pass
        else:
            raise AssertionError(f"global_steps={bad!r} accepted after {steps}")
        assert engine.global_steps == steps
        _assert_idle(engine)
    await updater.update(weights, global_steps=steps)  # equal is fine


@retry_if_late
async def an_update_keeps_requests_in_keep_mode(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    before = engine.global_steps
    steps = (before or 0) + 1
    tasks = [
        asyncio.ensure_future(
            engine.generate(_rid("uk"), prompt_ids=PROMPT, sampling_params=_params(300))
        )
        for _ in range(2)
    ]
    await until_decoding(engine, tasks)
    await engine.pause("keep")  # none can finish before the update's own pause takes over
    await updater.update(weights, global_steps=steps, mode="keep")
    segments = await asyncio.gather(*tasks)
    if any(ran_to_budget(segment, 300, update=steps) for segment in segments):
        raise LateAction("a request ran out its 300 tokens before the pause")
    for segment in segments:
        assert segment.finish_reason == "length" and len(segment.token_ids) == 300
        _assert_consistent(segment)
        versions = list(segment.global_steps)  # old weights' tokens, then the new ones'
        assert versions[0] == before and set(versions) == {before, steps}, versions
        assert versions == sorted(versions, key=lambda v: v != before), versions
    _assert_idle(engine)


@retry_if_late
async def an_update_ends_requests_in_abort_mode(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    before = engine.global_steps
    task = asyncio.ensure_future(
        engine.generate(_rid("ua"), prompt_ids=PROMPT, sampling_params=_params(400))
    )
    await until_decoding(engine, [task])
    # Frozen (vLLM's keep), it cannot finish during the update's checks before its own pause.
    await engine.pause("keep")
    await updater.update(weights, global_steps=(before or 0) + 1, mode="abort")
    segment = await task
    if ran_to_budget(segment, 400, update=(before or 0) + 1):
        raise LateAction("the request ran out its 400 tokens before the pause")
    assert segment.finish_reason == "abort" and 0 < len(segment.token_ids) < 400
    assert set(segment.global_steps) == {before}
    _assert_idle(engine)


async def an_update_refuses_sleeping_weights(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    before = engine.global_steps
    await engine.sleep(1)
    try:
        assert engine.statistics().asleep
        waiting = asyncio.ensure_future(
            engine.generate(_rid("sleepy"), prompt_ids=PROMPT, sampling_params=_params(4))
        )
        try:
            await updater.update(weights, global_steps=(before or 0) + 1)
        except EngineSleepingError:
            pass
        else:
            raise AssertionError("an update reached sleeping weights")
        assert engine.global_steps == before
        assert not waiting.done()  # admission stays gated while asleep
    finally:
        await engine.wake_up()
    assert len((await waiting).token_ids) == 4
    _assert_idle(engine)


async def hold_gates_admission_until_a_push_succeeds(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    engine.weights.hold("contract check")
    try:
        assert engine.statistics().holding
        waiting = asyncio.ensure_future(
            engine.generate(_rid("held"), prompt_ids=PROMPT, sampling_params=_params(4))
        )
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done() and engine.statistics().in_flight == 0
    finally:
        await updater.update(weights, global_steps=None)  # a successful push ends the hold
    assert not engine.statistics().holding
    assert len((await waiting).token_ids) == 4
    _assert_idle(engine)


async def the_weight_port_commits_the_weights_in_force(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    """``engine.weights`` is one port; a commit with no push before it ends a hold and keeps
    the label and the weights. A port that takes pushes (``ReceivingPort``) is attached to
    the updater's sender after an update and reports one read range per worker."""
    port = engine.weights
    assert port is engine.weights, "engine.weights must be one port, not made per call"
    steps = engine.global_steps
    params = _params(6, temperature=0.0)
    before = await engine.generate(_rid("port-a"), prompt_ids=PROMPT, sampling_params=params)
    port.hold("contract check")
    assert engine.statistics().holding
    await port.commit(None)
    assert not engine.statistics().holding and engine.global_steps == steps
    after = await engine.generate(_rid("port-b"), prompt_ids=PROMPT, sampling_params=params)
    assert after.token_ids == before.token_ids and set(after.global_steps) <= {steps}
    if isinstance(engine, ReceivingEngine):
        port = engine.weights
        await updater.update(weights, global_steps=None)
        assert port.attached_to is not None
        workers = port.num_workers
        assert workers >= 1 and len(await port.read_ranges()) == workers
        assert isinstance(port.served_dtype, torch.dtype)
    _assert_idle(engine)


async def the_weight_port_refuses_bad_input(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    """A version that is not one, or one below the engine's, and (a ``ReceivingPort``) a bad
    take are refused with ``InvalidRequestError`` before anything reaches the engine: the
    label, the gate and the next update are as before."""
    port = engine.weights
    steps = engine.global_steps
    bad: list[object] = ["3", -2, 2**63, True, 1.0]
    if steps:
        bad.append(steps - 1)
    for value in bad:
        try:
            await port.commit(value)  # type: ignore[arg-type]
        except InvalidRequestError:
            continue
        raise AssertionError(f"commit({value!r}) was not refused")
    if isinstance(engine, ReceivingEngine):
        version = steps or 0
        takes: list[tuple[object, object, object]] = [
            (version, 0, "stale"), ("1", 0, "keep"), (-2, 0, "keep"), (version, -1, "keep"),
        ]
        for version_, push, mode in takes:
            try:
                await engine.weights.take(version_, push=push, mode=mode)  # type: ignore[arg-type]
            except InvalidRequestError:
                continue
            raise AssertionError(f"take({version_!r}, push={push!r}, mode={mode!r}) passed")
    assert engine.global_steps == steps
    _assert_idle(engine)
    await updater.update(weights, global_steps=None)  # the next update goes through
    assert engine.global_steps == steps


UPDATE_CHECKS: dict[str, UpdateCheck] = {
    check.__name__: check
    for check in (
        update_labels_new_tokens,
        versions_never_go_backwards,
        an_update_keeps_requests_in_keep_mode,
        an_update_ends_requests_in_abort_mode,
        an_update_refuses_sleeping_weights,
        hold_gates_admission_until_a_push_succeeds,
        the_weight_port_commits_the_weights_in_force,
        the_weight_port_refuses_bad_input,
    )
}


async def check_updatable_engine(
    engine: UpdatableEngine, updater: WeightUpdater, weights: Mapping[str, torch.Tensor]
) -> None:
    """Run every update check; ``updater`` updates ``engine`` (alone or with others) and
    ``weights`` are the weights it serves."""
    await check_engine(engine)
    for check in UPDATE_CHECKS.values():
        await check(engine, updater, weights)
