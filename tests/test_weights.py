"""Weights into real vLLM engines through asyncroll's backend of vLLM's native protocol."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from pathlib import Path

import psutil
import pytest
import torch
from engine_helpers import (
    FRESH_GREEDY,
    PROBE_PROMPTS,
    PROMPT_PARAMS,
    greedy,
    hold,
    inject_fault,
    load_weights,
    pusher_of,
    until_decoding,
    update_weights,
)

from asyncroll import EngineSleepingError, InvalidRequestError, VLLMEngine, WeightSyncError
from asyncroll.testing import vllm_client
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late
from asyncroll.transport import (
    CudaIpcBackend,
    Piece,
    ShmBackend,
    WeightSender,
    open_weight_sender,
)
from asyncroll.types import PauseMode
from asyncroll.weights import SenderChannel, WeightPusher, default_buffers


async def _next_steps(engine: VLLMEngine) -> int:
    return (engine.global_steps or 0) + 1


async def test_push_is_token_exact_and_reversible(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    assert FRESH_GREEDY["a"] != FRESH_GREEDY["b"], "the two models must differ"
    steps = await _next_steps(engine)
    report = await update_weights(engine, weights_b, global_steps=steps)
    assert report.push is not None and report.push.tensors == len(weights_b)
    assert await greedy(engine, "pushed-b") == FRESH_GREEDY["b"]
    await update_weights(engine, weights_a, global_steps=steps + 1)
    assert await greedy(engine, "pushed-a") == FRESH_GREEDY["a"]


async def test_tokens_after_update_carry_its_global_steps(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    steps = max(7, await _next_steps(engine))
    await update_weights(engine, load_weights(tiny_model_a), global_steps=steps)
    segments = await asyncio.gather(
        *(
            engine.generate(f"v{i}", prompt_ids=[3, 4, i + 5], sampling_params=PROMPT_PARAMS)
            for i in range(4)
        )
    )
    for segment in segments:
        assert segment.global_steps == (steps,) * len(segment.token_ids)
    assert engine.statistics().global_steps == steps


@retry_if_late
async def test_keep_mode_request_spans_both_versions(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    before = engine.global_steps
    assert before is not None
    long = asyncio.create_task(
        engine.generate(
            "spanning",
            prompt_ids=[5, 6, 7],
            sampling_params={"max_tokens": 300, "ignore_eos": True},
        )
    )
    await until_decoding(engine, [long])
    await hold(engine)
    await update_weights(engine, load_weights(tiny_model_a), global_steps=before + 1, mode="keep")
    segment = await long
    if ran_to_budget(segment, 300, update=before + 1):
        raise LateAction("the request ran out its 300 tokens before the update's pause")
    assert segment.finish_reason == "length" and len(segment.token_ids) == 300
    switch = segment.global_steps.index(before + 1)
    assert 0 < switch < 300
    assert segment.global_steps == (before,) * switch + (before + 1,) * (300 - switch)


@retry_if_late
async def test_recompute_mode_labels_without_vllm_spans_switch_exactly_where_new_weights_took_over(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.24 reports no weight versions; the adapter labels tokens from the boundaries it
    records while paused. Forced on here (vLLM 0.32) and checked against the weights: with
    ``recompute`` the tokens from the switch on are model B's greedy continuation of
    everything before it (B computed the whole KV again)."""
    monkeypatch.setattr(engine, "native_versions", False)
    before = engine.global_steps
    assert before is not None
    prompt = [11, 12, 13]
    greedy_long = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    long = asyncio.create_task(
        engine.generate("no-spans", prompt_ids=prompt, sampling_params=greedy_long)
    )
    await until_decoding(engine, [long])
    await hold(engine)
    await update_weights(
        engine, load_weights(tiny_model_b), global_steps=before + 1, mode="recompute"
    )
    segment = await long
    # Late also where the hold left fewer than the 16 tokens compared below.
    if ran_to_budget(segment, 300, update=before + 1) or (
        segment.global_steps.index(before + 1) > 300 - 16
    ):
        await update_weights(engine, load_weights(tiny_model_a), global_steps=before + 2)
        raise LateAction("the update's pause came after the request's last 16 tokens began")
    switch = segment.global_steps.index(before + 1)
    assert 0 < switch < 300
    assert segment.global_steps == (before,) * switch + (before + 1,) * (300 - switch)
    head = prompt + list(segment.token_ids[:switch])
    greedy_16 = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    cont_b = await engine.generate("cont-b", prompt_ids=head, sampling_params=greedy_16)
    await update_weights(engine, load_weights(tiny_model_a), global_steps=before + 2)
    cont_a = await engine.generate("cont-a", prompt_ids=head, sampling_params=greedy_16)
    assert segment.token_ids[switch : switch + 16] == cont_b.token_ids != cont_a.token_ids
    assert cont_a.global_steps == (before + 2,) * 16


@retry_if_late
async def test_keep_mode_goes_on_from_the_kv_the_old_weights_computed(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """``keep`` is an in-flight update: the kept request is not preempted, so after the switch
    model B attends over the KV model A computed, and its tokens differ from B's continuation
    of the same text from scratch (what ``recompute`` gives, test above). The kept request's
    260-token prompt fills two of the CPU build's 128-token blocks with A's KV; a new request
    with the same head reuses none of it."""
    await update_weights(engine, load_weights(tiny_model_a), global_steps=await _next_steps(engine))
    before = engine.global_steps
    assert before is not None
    prompt = [11 + i % 300 for i in range(260)]
    greedy_long = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}  # 460 <= 512
    long = asyncio.create_task(
        engine.generate("kept-kv", prompt_ids=prompt, sampling_params=greedy_long)
    )
    await until_decoding(engine, [long])
    await hold(engine)
    try:
        await update_weights(
            engine, load_weights(tiny_model_b), global_steps=before + 1, mode="keep"
        )
        segment = await long
        if ran_to_budget(segment, 200, update=before + 1):
            raise LateAction("the request ran out its 200 tokens before the update's pause")
        switch = segment.global_steps.index(before + 1)
        if switch > 200 - 16:  # the hold came too late to leave 16 tokens to compare
            raise LateAction(f"the update's pause came after {switch} of 200 tokens")
        assert 0 < switch
        assert segment.global_steps == (before,) * switch + (before + 1,) * (200 - switch)
        head = prompt + list(segment.token_ids[:switch])
        greedy_16 = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        cont_b = await engine.generate("kept-cont-b", prompt_ids=head, sampling_params=greedy_16)
        assert cont_b.num_cached_tokens == 0  # A's 256 cached prompt tokens are not reused
        after = segment.token_ids[switch : switch + 16]
        assert len(after) == 16 and after != cont_b.token_ids
    finally:
        await update_weights(engine, load_weights(tiny_model_a), global_steps=before + 2)


async def test_an_unknown_resume_mode_is_refused_before_the_pause(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[str] = []
    real_pause = engine.pause

    async def counted_pause(mode: PauseMode = "abort", *, clear_cache: bool = True) -> None:
        pauses.append(mode)
        await real_pause(mode, clear_cache=clear_cache)

    monkeypatch.setattr(engine, "pause", counted_pause)
    current = engine.global_steps
    with pytest.raises(InvalidRequestError, match="mode must be one of abort, keep, recompute"):
        await update_weights(engine, {}, global_steps=current, mode="stale")  # type: ignore[arg-type]
    assert engine.global_steps == current and pauses == []


async def test_lower_version_is_refused(engine: VLLMEngine, tiny_model_a: Path) -> None:
    current = engine.global_steps
    assert current is not None and current > 0
    with pytest.raises(InvalidRequestError, match="backwards"):
        await update_weights(engine, load_weights(tiny_model_a), global_steps=current - 1)
    assert engine.global_steps == current


async def test_a_piece_that_does_not_fit_its_tensor_is_refused_before_the_pause(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """A ``Piece`` whose rows lie outside its whole tensor: ``InvalidRequestError`` naming it,
    before anything pauses; the engine keeps its label and serves as before."""
    current = engine.global_steps
    served = await greedy(engine, "before-bad-piece")
    tensors: dict[str, torch.Tensor | Piece] = dict(load_weights(tiny_model_a))
    name = "model.norm.weight"
    norm = tensors[name]
    assert isinstance(norm, torch.Tensor)
    tensors[name] = Piece(norm, whole=tuple(norm.shape), offset=1)
    with pytest.raises(InvalidRequestError, match=r"model\.norm\.weight.*does not fit"):
        await update_weights(engine, tensors, global_steps=await _next_steps(engine))
    assert engine.global_steps == current and not engine.statistics().holding
    assert await greedy(engine, "after-bad-piece") == served


async def test_a_push_failing_before_its_first_message_ends_the_workers_receive_at_once(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers are receiving before the sender starts. A push that fails before its first
    message (made to here) ends their receive with its error at once, instead of after the
    receiver's timeout: the update fails naming it, nothing holds, the label stays, and the
    next update goes through."""
    current = engine.global_steps
    served = await greedy(engine, "before-called-off")
    push = WeightSender._push
    calls: list[int] = []

    async def failing_once(self: WeightSender, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the sender failed before its first message")
        return await push(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(WeightSender, "_push", failing_once)
    weights = load_weights(tiny_model_a)
    steps = await _next_steps(engine)
    # (a bound far above the seconds this takes, far below the workers' 120 s receive
    # timeout, which is what a lost End would cost)
    with pytest.raises(WeightSyncError, match="before its first message"):
        async with asyncio.timeout(60):
            await update_weights(engine, weights, global_steps=steps)
    assert engine.global_steps == current and not engine.statistics().holding
    assert await greedy(engine, "after-called-off") == served
    report = await update_weights(engine, weights, global_steps=steps)
    assert report.global_steps == engine.global_steps == steps and len(calls) == 2


async def test_the_sender_first_order_still_delivers(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order before 2026-11-27 (``bench/update_phases.py``'s baseline): the push starts
    before the receives, so the push's id must be read before it starts, or the workers
    would skip the very push they wait for."""
    monkeypatch.setattr(SenderChannel, "_receivers_first", False)
    weights = load_weights(tiny_model_a)
    for _ in range(2):
        steps = await _next_steps(engine)
        async with asyncio.timeout(60):  # (a skipped push costs the workers' 120 s timeout)
            report = await update_weights(engine, weights, global_steps=steps)
        assert report.global_steps == engine.global_steps == steps


async def test_an_update_cancelled_as_its_receive_rpc_leaves_leaves_no_worker_waiting(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled the moment the workers' receive RPC leaves, before the sender's first step:
    the push is called off (its End reaches the workers, whose receive ends at once), the
    label stays, nothing holds, and the next update goes through."""
    current = engine.global_steps
    rpc = vllm_client(engine).collective_rpc
    update: asyncio.Future[object] | None = None

    async def spied(method: str, *args: object, **kwargs: object) -> object:
        if method == "asyncroll_take_update" and update is not None and not update.done():
            update.cancel()  # the RPC still leaves: this is its sending step
        return await rpc(method, *args, **kwargs)

    monkeypatch.setattr(vllm_client(engine), "collective_rpc", spied)
    weights = load_weights(tiny_model_a)
    steps = await _next_steps(engine)
    update = asyncio.ensure_future(update_weights(engine, weights, global_steps=steps))
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(60):  # (as above: a lost End costs 120 s)
            await update
    assert engine.global_steps == current and not engine.statistics().holding
    report = await update_weights(engine, weights, global_steps=steps)
    assert report.global_steps == engine.global_steps == steps


async def test_an_end_left_in_a_workers_socket_does_not_fail_the_next_update(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """A push that ended while the workers were not receiving (here: one called off) leaves
    its End in their sockets. The next update tells the workers which push to take, so they
    skip it: the update goes through, where they used to read that End as their push's and
    fail this update and, one push late, every later one."""
    weights = load_weights(tiny_model_a)
    await update_weights(engine, weights, global_steps=await _next_steps(engine))
    sender = pusher_of(engine).sender
    assert isinstance(sender, WeightSender)
    await sender.call_off(0, RuntimeError("left over"))
    for _ in range(2):
        steps = await _next_steps(engine)
        report = await update_weights(engine, weights, global_steps=steps)
        assert report.global_steps == engine.global_steps == steps


async def test_push_while_asleep_is_refused(engine: VLLMEngine, tiny_model_a: Path) -> None:
    await engine.sleep(1)
    try:
        with pytest.raises(EngineSleepingError):
            await update_weights(
                engine, load_weights(tiny_model_a), global_steps=await _next_steps(engine)
            )
    finally:
        await engine.wake_up()
    assert await greedy(engine, "after-sleep") == FRESH_GREEDY["a"]


async def test_receiver_failure_keeps_old_weights_and_version(
    engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    before = engine_b.global_steps
    served_before = await greedy(engine_b, "before-failure")  # whatever it serves now
    pusher = WeightPusher([engine_b])
    try:
        async with inject_fault(engine_b, "load", tensor="model.layers.1.mlp.down_proj.weight"):
            with pytest.raises(WeightSyncError, match="down_proj"):
                # push the model it does not serve, so a partial load would change its outputs
                other = tiny_model_a if served_before == FRESH_GREEDY["b"] else tiny_model_b
                await pusher.update(load_weights(other), global_steps=(before or 0) + 5)
    finally:
        await pusher.aclose()
    assert engine_b.global_steps == before
    assert not engine_b.is_dead and not engine_b.is_paused
    assert await greedy(engine_b, "after-failure") == served_before


async def test_pushers_sharing_an_engine_take_turns(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """An engine's workers hold one receiver; a pusher that another displaced attaches again."""
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    steps = await _next_steps(engine)
    other = WeightPusher([engine])
    try:
        await other.update(weights_b, global_steps=steps)
        assert await greedy(engine, "turn-b") == FRESH_GREEDY["b"]
        # the staging buffers by backend (``default_buffers``), here shared memory's
        assert isinstance(other.sender, WeightSender)
        assert other.sender.statistics().buffers == default_buffers(ShmBackend.name) == 2
        await update_weights(engine, weights_a, global_steps=steps + 1)
        assert await greedy(engine, "turn-a") == FRESH_GREEDY["a"]
        await other.update(weights_b, global_steps=steps + 2)
        assert await greedy(engine, "turn-b2") == FRESH_GREEDY["b"]
    finally:
        await other.aclose()
    await update_weights(engine, weights_a, global_steps=steps + 3)
    assert await greedy(engine, "turn-a2") == FRESH_GREEDY["a"]


async def test_a_channel_adopting_a_sender_keeps_the_engines_attached_to_it(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """How a sharded trainer's coordinator attaches again (``DistributedWeightPusher``): the
    engine joins a new sender under the channel's name, then the channel adopts that
    sender. The old sender closes; the engine, attached again, stays attached (a detach
    here closed the receivers just connected: the other ranks' senders then waited for
    theirs until the deadline), and the next push goes through the adopted sender."""
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    steps = await _next_steps(engine)
    pusher, other = WeightPusher([engine]), WeightPusher([engine])
    try:
        await pusher.update(weights_b, global_steps=steps)
        on_b = await greedy(engine, "adopting-b")
        await other.update(weights_a, global_steps=steps + 1)  # the engine is other's now
        channel = pusher.channel
        workers = engine.weights.num_workers
        stack = contextlib.AsyncExitStack()
        sender = await stack.enter_async_context(open_weight_sender(receivers=workers))
        config = {**sender.receiver_config(), **channel.worker_config()}
        await asyncio.gather(
            sender.wait_receivers(workers), engine.weights.attach(config, owner=channel)
        )
        await channel.adopt([engine], sender, stack)
        assert engine.weights.attached_to is channel and channel.is_attached([engine])
        assert sender.statistics().receivers == workers
        await pusher.update(weights_b, global_steps=steps + 2)
        assert pusher.sender is sender
        assert await greedy(engine, "adopted-b") == on_b != FRESH_GREEDY["a"]
    finally:
        await other.aclose()
        await pusher.aclose()


async def test_failed_push_without_backup_holds_requests_until_a_push_succeeds(
    engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """Without a backup (the GPU default: it would double memory) a failed push leaves partly
    loaded weights: the engine takes no request until a push succeeds, and serves none from
    the mixed weights."""
    before = engine_b.global_steps or 0
    served = await greedy(engine_b, "before-hold")
    pusher = WeightPusher([engine_b], backup=False)
    try:
        # A failure before the worker loaded anything leaves the served weights whole: the
        # error says so, and the engine serves on.
        async with inject_fault(engine_b, "load", tensor="model.layers.1.mlp.down_proj.weight"):
            with pytest.raises(WeightSyncError, match="every engine serves its previous weights"):
                await pusher.update(load_weights(tiny_model_a), global_steps=before + 1)
        assert not engine_b.statistics().holding
        assert await greedy(engine_b, "not-held") == served
    finally:
        await pusher.aclose()
    # A failure once every tensor was loaded leaves a mix: the engine holds.
    pusher = WeightPusher([engine_b], backup=False)
    try:
        async with inject_fault(engine_b, "after_load"):
            with pytest.raises(WeightSyncError, match="no requests until a push succeeds"):
                await pusher.update(load_weights(tiny_model_a), global_steps=before + 1)
    finally:
        await pusher.aclose()
    assert engine_b.statistics().holding and engine_b.global_steps == before
    waiting = asyncio.create_task(
        engine_b.generate("held", prompt_ids=PROBE_PROMPTS[0], sampling_params=PROMPT_PARAMS)
    )
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done() and engine_b.statistics().in_flight == 0
    await update_weights(engine_b, load_weights(tiny_model_b), global_steps=before + 2)
    assert not engine_b.statistics().holding
    assert (await waiting).global_steps == (before + 2,) * PROMPT_PARAMS["max_tokens"]
    assert await greedy(engine_b, "after-held") == FRESH_GREEDY["b"]


async def test_an_update_resets_the_prefix_cache(engine: VLLMEngine, tiny_model_a: Path) -> None:
    prompt = [10 + i % 400 for i in range(300)]  # the CPU build's KV blocks hold 128 tokens
    params = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    await engine.generate("cache-1", prompt_ids=prompt, sampling_params=params)
    warm = await engine.generate("cache-2", prompt_ids=prompt, sampling_params=params)
    assert warm.num_cached_tokens >= 128  # the cache does hit while weights stay
    await update_weights(engine, load_weights(tiny_model_a), global_steps=await _next_steps(engine))
    cold = await engine.generate("cache-3", prompt_ids=prompt, sampling_params=params)
    assert cold.num_cached_tokens == 0  # no KV computed with the old weights is reused
    warm_again = await engine.generate("cache-4", prompt_ids=prompt, sampling_params=params)
    assert warm_again.num_cached_tokens >= 128  # the new weights' KV is cached and hit


@retry_if_late
async def test_an_update_keeps_kept_requests_off_the_old_cache_and_new_ones_too(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """vLLM cannot reset its prefix cache while kept requests hold blocks; the update still
    succeeds in ``keep`` mode, and a new request reuses none of the old weights' KV."""
    prompt = [20 + i % 400 for i in range(300)]
    params = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    await engine.generate("kept-cache-1", prompt_ids=prompt, sampling_params=params)
    long = asyncio.create_task(
        engine.generate(
            "kept-holds-blocks", prompt_ids=prompt,  # 300 + 150 tokens fit max_model_len 512
            sampling_params={"max_tokens": 150, "ignore_eos": True},
        )
    )
    await until_decoding(engine, [long])
    await hold(engine)
    steps = await _next_steps(engine)
    await update_weights(engine, load_weights(tiny_model_a), global_steps=steps, mode="keep")
    cold = await engine.generate("kept-cache-2", prompt_ids=prompt, sampling_params=params)
    assert cold.num_cached_tokens == 0
    kept = await long
    if ran_to_budget(kept, 150, update=steps):
        raise LateAction("the request ran out its 150 tokens before the update's pause")
    assert kept.finish_reason == "length" and kept.global_steps[-1] == steps
    assert kept.global_steps[0] < steps  # it was in flight across the update, and kept


def _rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20


async def test_an_updates_stamps_follow_one_another_on_one_clock(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """The sender's, the worker's and the receiver's ``perf_counter`` stamps of one update, in
    the order the update passes them: what ``bench/update_phases.py`` splits an update by.
    (The sender and the worker start independently: the receive RPC leaves first.)"""
    report = await update_weights(engine, load_weights(tiny_model_a),
                                         global_steps=await _next_steps(engine))
    ended = time.perf_counter()
    (worker,) = await vllm_client(engine).collective_rpc("asyncroll_last_receive_report")
    assert report.push is not None and report.push.began > 0
    received = worker["began"] + worker["seconds"]
    stamps = [worker["called"], worker["entered"], worker["began"], received,
              worker["returned"], ended]
    assert stamps == sorted(stamps), stamps
    timeline = worker["timeline"]
    assert worker["began"] <= timeline[0]["received"] <= timeline[-1]["acked"] <= received
    assert report.push.began <= timeline[0]["received"]


async def test_the_workers_receive_rpc_leaves_before_the_sender_begins(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receive RPC is on its way into vLLM before the sender's first step: the sender's
    work before its first message overlaps the RPC and the workers' preparation, where it
    used to precede them."""
    sent: dict[str, float] = {}
    rpc = vllm_client(engine).collective_rpc

    async def spied(method: str, *args: object, **kwargs: object) -> object:
        sent.setdefault(method, time.perf_counter())  # the step that sends it
        return await rpc(method, *args, **kwargs)

    monkeypatch.setattr(vllm_client(engine), "collective_rpc", spied)
    report = await update_weights(engine, load_weights(tiny_model_a),
                                         global_steps=await _next_steps(engine))
    assert report.push is not None
    assert sent["asyncroll_take_update"] < report.push.began


async def test_an_update_reports_what_the_workers_took_without_asking_them_again(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receive RPC returns each worker's delivery: the report needs no RPC of its own
    (which a busy engine answers only between two steps), and says what asking would."""
    asked: list[str] = []
    rpc = vllm_client(engine).collective_rpc

    def spied(method: str, *args: object, **kwargs: object) -> object:
        asked.append(method)
        return rpc(method, *args, **kwargs)

    monkeypatch.setattr(vllm_client(engine), "collective_rpc", spied)
    report = await update_weights(engine, load_weights(tiny_model_a),
                                         global_steps=await _next_steps(engine))
    assert "asyncroll_take_update" in asked and "asyncroll_last_receive_report" not in asked
    delivery = report.deliveries[engine.name]
    (worker,) = await rpc("asyncroll_last_receive_report")
    assert delivery.version == worker["version"] == report.global_steps
    assert (delivery.tensors, delivery.bytes) == (worker["tensors"], worker["bytes"])
    assert [delivery.verified, delivery.not_verifiable] == worker["verified"]
    assert delivery.tensors == report.tensors and delivery.verified > 0


async def test_workers_that_finish_with_the_receive_need_no_finish_rpc(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``finish_in_receive`` (the default on vLLM 0.24): the workers finish the update in the
    receive's RPC, the commit only labels it. The weights served, the label and the tokens'
    versions are those of a finish RPC; the next update starts (the session was ended); a push
    that fails in the worker is not finished, keeps the label and the weights, and the next
    one goes through. (``engine_b``: its start records model b's greedy tokens.)"""
    asked: list[str] = []
    rpc = vllm_client(engine).collective_rpc

    def spied(method: str, *args: object, **kwargs: object) -> object:
        asked.append(method)
        return rpc(method, *args, **kwargs)

    finishes: list[object] = []
    finish = vllm_client(engine).finish_weight_update

    def counted(*args: object, **kwargs: object) -> object:
        finishes.append(args or kwargs)
        return finish(*args, **kwargs)

    monkeypatch.setattr(vllm_client(engine), "collective_rpc", spied)
    monkeypatch.setattr(vllm_client(engine), "finish_weight_update", counted)
    monkeypatch.setattr(engine.weights, "finish_in_receive", True)
    steps = await _next_steps(engine)
    for pushed, model, expected in ((1, tiny_model_b, "b"), (2, tiny_model_a, "a")):
        await update_weights(engine, load_weights(model), global_steps=steps + pushed)
        assert engine.global_steps == steps + pushed
        assert await greedy(engine, f"finished-in-receive-{pushed}") == FRESH_GREEDY[expected]
        segment = await engine.generate(
            f"finished-in-receive-tagged-{pushed}", prompt_ids=[3, 4, 5],
            sampling_params=PROMPT_PARAMS,
        )
        assert segment.global_steps == (steps + pushed,) * len(segment.token_ids)
    assert asked.count("asyncroll_take_update") == 2
    assert "finish_weight_update" not in asked and not finishes
    async with inject_fault(engine, "load", tensor="model.layers.1.mlp.down_proj.weight"):
        with pytest.raises(WeightSyncError, match="down_proj"):
            await update_weights(engine, load_weights(tiny_model_b), global_steps=steps + 3)
    assert engine.global_steps == steps + 2 and not engine.is_paused
    assert await greedy(engine, "finished-in-receive-failed") == FRESH_GREEDY["a"]
    await update_weights(engine, load_weights(tiny_model_b), global_steps=steps + 3)
    assert await greedy(engine, "finished-in-receive-after") == FRESH_GREEDY["b"]
    assert "finish_weight_update" not in asked and not finishes
    monkeypatch.setattr(engine.weights, "finish_in_receive", False)  # back: the finish RPC again
    await update_weights(engine, load_weights(tiny_model_a), global_steps=steps + 4)
    assert len(finishes) == 1 and engine.global_steps == steps + 4


async def test_thirty_pushes_keep_memory_bounded(engine: VLLMEngine, tiny_model_a: Path) -> None:
    weights = load_weights(tiny_model_a)
    steps = await _next_steps(engine)
    for i in range(5):  # warm up allocators and caches
        await update_weights(engine, weights, global_steps=steps + i)
    baseline = _rss_mib(psutil.Process().pid)
    for i in range(30):
        await update_weights(engine, weights, global_steps=steps + 5 + i)
    growth = _rss_mib(psutil.Process().pid) - baseline
    assert growth < 64, f"trainer + engine resident memory grew {growth:.0f} MiB over 30 pushes"
    assert await greedy(engine, "after-30") == FRESH_GREEDY["a"]


def test_staging_buffers_default_by_backend_and_mode() -> None:
    """Three with CUDA IPC, where a third buffer keeps the device busy across the host hops;
    two with shared memory, over broadcast, and for a one-copy pusher (it packs nothing)."""
    assert default_buffers(CudaIpcBackend.name) == 3
    assert default_buffers(CudaIpcBackend.name, one_copy=True) == 2
    assert default_buffers(ShmBackend.name) == 2
    assert default_buffers("broadcast") == default_buffers("broadcast_cpu") == 2


async def test_bad_pusher_options_are_rejected(engine: VLLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="load must be"):
        WeightPusher([engine], load="fast")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="backend must be"):
        WeightPusher([engine], backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="one_copy must be"):
        WeightPusher([engine], one_copy="yes")  # type: ignore[arg-type]
    for buffers in (0, True, 1.5):
        with pytest.raises(InvalidRequestError, match="buffers must be an int of at least 1"):
            WeightPusher([engine], buffers=buffers)  # type: ignore[arg-type]
    for bucket_bytes in (0, -256, 1000, True, 256.0):
        for backend in ("auto", "broadcast"):
            with pytest.raises(InvalidRequestError, match="bucket_bytes must be a positive"):
                WeightPusher([engine], bucket_bytes=bucket_bytes, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="one_copy=True reads through CUDA IPC"):
        WeightPusher([engine], backend="broadcast", one_copy=True)


async def test_one_copy_of_cpu_tensors_is_refused_before_anything_pauses(
    engine: VLLMEngine, tiny_model_a: Path
) -> None:
    """One-copy reads the trainer's CUDA tensors in place: CPU tensors get a typed error naming
    the tensor, the engine is never paused, its label stays, and the next push works."""
    weights = load_weights(tiny_model_a)
    before = engine.global_steps
    pusher = WeightPusher([engine], one_copy=True)
    try:
        with pytest.raises(InvalidRequestError, match="contiguous CUDA tensor"):
            await pusher.update(weights, global_steps=(before or 0) + 1)
    finally:
        await pusher.aclose()
    assert not engine.is_paused and engine.global_steps == before
    assert engine.statistics().in_flight == 0
    report = await update_weights(engine, weights, global_steps=(before or 0) + 1)
    assert report.push is not None and engine.global_steps == (before or 0) + 1


async def test_bad_tensors_are_rejected_before_any_push(engine: VLLMEngine) -> None:
    with pytest.raises(InvalidRequestError):
        await update_weights(engine, {}, global_steps=None)
    with pytest.raises(InvalidRequestError):
        await update_weights(engine, [("x", [1, 2])], global_steps=None)  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError):
        twice = [("x", torch.zeros(1)), ("x", torch.zeros(1))]
        await update_weights(engine, twice, global_steps=None)
    assert engine.statistics().in_flight == 0 and not engine.is_paused


async def test_an_update_said_to_change_the_weights_warns_when_it_does_not(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """``changed=True`` fingerprints the tensors: the same tensors as the previous update's warn
    (and still go through, labelled), different ones do not. An update without the flag is not
    compared, but the next one with it compares with it (its verification's fingerprints)."""
    import warnings

    from asyncroll import AsyncServerManager, UnchangedWeightsWarning

    a, b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    steps = await _next_steps(engine)
    async with AsyncServerManager([engine]) as manager:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnchangedWeightsWarning)
            await manager.update_weights(b, global_steps=steps, changed=True)
            await manager.update_weights(a, global_steps=steps + 1, changed=True)
            await manager.update_weights(a, global_steps=steps + 2)  # not compared
        # pytest.warns records every warning in its block and re-raises the others: collect
        # garbage earlier tests left first, so an unclosed resource's ResourceWarning from a
        # finaliser cannot land inside it.
        gc.collect()
        with pytest.warns(UnchangedWeightsWarning, match=r"all \d+ tensors pushed equal"):
            await manager.update_weights(a, global_steps=steps + 3, changed=True)
        with pytest.warns(UnchangedWeightsWarning, match=r"all \d+ tensors pushed equal"):
            await manager.update_weights(
                {name: t.clone() for name, t in a.items()}, global_steps=steps + 4, changed=True
            )
        assert manager.statistics().global_steps == steps + 4
    assert await greedy(engine, "after-unchanged") == FRESH_GREEDY["a"]


def test_fingerprints_tell_equal_tensors_from_changed_ones() -> None:
    from asyncroll.fingerprints import fingerprints

    g = torch.Generator().manual_seed(0)
    base = {
        "w": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "strided": torch.randn(50, 40, generator=g)[:, ::3],
        "small": torch.randn(5, generator=g),
        "empty": torch.empty(0, 3),
    }
    same = {name: t.clone() for name, t in base.items()}
    assert fingerprints(base) == fingerprints(same)
    stepped = {**same, "w": base["w"] + 0.5}  # a training step moves every element
    assert fingerprints(stepped)["w"] != fingerprints(base)["w"]
    assert fingerprints({**same, "small": base["small"].double()})["small"] != (
        fingerprints(base)["small"]
    )
    assert fingerprints(base)["empty"] == b""  # nothing to sample (receivers compare
    # fingerprints of tensors of the pushed dtype and shape only)


def test_a_widened_copy_has_the_pushed_fingerprint() -> None:
    """bf16 served as float32 holds every value exactly: fingerprinted as bf16 it matches;
    one element moved, it does not; float16 in bfloat16 is not exact and never compared."""
    from asyncroll.fingerprints import Fingerprinter, fingerprints, holds_exactly

    pushed = {"w": torch.randn(40, 9).to(torch.bfloat16)}
    served = {"w": pushed["w"].float()}
    as_bf16 = {"w": torch.bfloat16}
    assert Fingerprinter()(served, as_bf16) == fingerprints(pushed)
    served["w"][0, 0] += 1
    assert Fingerprinter()(served, as_bf16) != fingerprints(pushed)
    assert holds_exactly(torch.float32, torch.bfloat16)
    assert not holds_exactly(torch.bfloat16, torch.float16)
    assert not holds_exactly(torch.bfloat16, torch.float32)


@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "mixed-dtypes"])
def test_differing_names_exactly_the_tensors_that_changed(mixed: bool) -> None:
    """The receiver's check: one comparison of every sampled byte when all match (one dtype),
    and the names of the changed tensors, no more, when some do not; the same answer the
    fingerprints compared one by one give, across repeated calls on the same mapping."""
    from asyncroll.fingerprints import Fingerprinter, fingerprints

    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(64 + 37 * i, generator=g).to(torch.bfloat16)
               for i in range(12)}
    if mixed:
        tensors["norm"] = torch.randn(100, generator=g)
    expected = fingerprints(tensors)
    check = Fingerprinter()
    assert check.differing(tensors, expected) == []
    tensors["t3"][0] += 1  # the first element is always sampled
    tensors["t7"].add_(0.5)
    assert check.differing(tensors, expected) == ["t3", "t7"]  # the same mapping, cached views
    changed = {n for n, f in fingerprints(tensors).items() if f != expected[n]}
    assert changed == {"t3", "t7"}
    served = {n: t.float() for n, t in tensors.items()}  # widened: checked as the pushed dtype
    assert check.differing(served, expected, {n: t.dtype for n, t in tensors.items()}) == [
        "t3", "t7"
    ]
