"""Updates committed between two engine steps (``mode="inflight"``), on a real vLLM engine.

The weights here make every forward pass say which weights it ran on. Attention and MLP add
nothing to the residual stream (``o_proj`` and ``down_proj`` are zero), so the last hidden
state is the embedding of the last token, the same row for every token: ``e0`` under weights
``old``, ``e1`` under ``new``. The head maps ``e0`` to token 1 and ``e1`` to token 3 in
``old``, ``e1`` to token 2 and ``e0`` to token 3 in ``new``. A greedy step samples 1 on the old
weights, 2 on the new ones, and 3 on any mix of the embedding of one and the head of the other
(they travel in different buckets). So each token says which weights sampled it, whatever KV
it attended to, and its label must say the same.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import load_weights, steps_held, until_decoding

from asyncroll import AsyncServerManager, InvalidRequestError, VLLMEngine, WeightSyncError
from asyncroll.interfaces import ResumeMode
from asyncroll.testing import vllm_client
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late
from asyncroll.transport.piece import Piece
from asyncroll.types import Segment
from asyncroll.weights import WeightPusher

OLD, NEW, MIXED = 1, 2, 3
BUDGET = 500
GREEDY = {"max_tokens": BUDGET, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7]
SMALL_BUCKETS = 64 * 1024
"""Smaller than the embedding (128 KiB): the embedding and the head travel apart."""


def telling(model: Path, which: int) -> dict[str, torch.Tensor]:
    """Model ``model``'s tensors, changed so that a greedy step samples ``which`` (``OLD`` or
    ``NEW``), and ``MIXED`` on a mix of the two sets (see the module doc)."""
    tensors = load_weights(model)
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensor)
    embed = tensors["model.embed_tokens.weight"]
    head = tensors["lm_head.weight"]
    row, other = (0, 1) if which == OLD else (1, 0)
    embed = torch.zeros_like(embed)
    embed[:, row] = 1.0
    head = torch.zeros_like(head)
    head[which, row] = 1.0
    head[MIXED, other] = 1.0
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    return tensors


def weights_of(token: int) -> int:
    assert token in (OLD, NEW), f"a forward pass sampled {token}: it ran on a mix of weights"
    return token


@pytest.fixture(params=[False, True], ids=["received", "landed"])
async def pusher(  # type: ignore[no-untyped-def]
    request: pytest.FixtureRequest, engine: VLLMEngine, tiny_model_a: Path
):
    """A pusher with small buckets into the shared engine, which gets model A back after:
    received in the commit's RPC, or landed first (``land=True``)."""
    pusher = WeightPusher([engine], bucket_bytes=SMALL_BUCKETS, backup=True, land=request.param)
    try:
        yield pusher
    finally:
        steps = (engine.global_steps or 0) + 1
        await pusher.update(load_weights(tiny_model_a), global_steps=steps)
        await pusher.aclose()


@retry_if_late
async def test_inflight_updates_split_every_output_exactly_where_the_weights_changed(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher
) -> None:
    """Many requests decode through two inflight updates (old, new, old again): nothing is
    aborted or paused, no forward pass runs on a mix, and every token's label is the label of
    the weights that sampled it (the token says which), so each output switches at exactly
    one point per update it crossed."""
    old, new = telling(tiny_model_a, OLD), telling(tiny_model_a, NEW)
    steps = (engine.global_steps or 0) + 1
    await pusher.update(old, global_steps=steps)
    aborted = engine.statistics().num_aborted
    tasks = [
        asyncio.create_task(
            engine.generate(f"inflight-{steps}-{i}", prompt_ids=[5, 6, i + 7],
                            sampling_params=GREEDY)
        )
        for i in range(12)
    ]
    await until_decoding(engine, tasks)
    await pusher.update(new, global_steps=steps + 1, mode="inflight")
    assert not engine.is_paused
    await pusher.update(old, global_steps=steps + 2, mode="inflight")
    segments: list[Segment] = await asyncio.gather(*tasks)
    if any(ran_to_budget(s, BUDGET, update=steps + 2) for s in segments):
        raise LateAction("a request ran out its tokens before the second update")
    assert engine.statistics().num_aborted == aborted
    for segment in segments:
        assert segment.finish_reason == "length" and len(segment.token_ids) == BUDGET
        sampled_by = [weights_of(t) for t in segment.token_ids]
        # Old weights labelled steps, then steps + 2; new ones steps + 1.
        expected = []
        crossed = 0
        for by in sampled_by:
            if by == NEW:
                crossed = 1
            elif crossed:
                crossed = 2
            expected.append(steps + crossed)
        assert list(segment.global_steps) == expected, segment.request_id
        switches = sum(a != b for a, b in itertools.pairwise(segment.global_steps))
        assert switches == 2
    # After the updates, a new request samples from the weights its label names.
    after = await engine.generate("inflight-after", prompt_ids=[3], sampling_params={
        "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    assert after.token_ids == (OLD,) * 4 and after.global_steps == (steps + 2,) * 4


async def crossed_by(
    engine: VLLMEngine, pusher: WeightPusher, weights: dict[str, torch.Tensor], *, label: int,
    mode: ResumeMode, name: str,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One greedy request crossed by an update to ``weights`` (labelled ``label``) in
    ``mode``: the tokens it sampled after the update, and those a fresh request given the
    same prompt and the tokens before the update samples under ``weights``."""
    params = {"max_tokens": BUDGET, "temperature": 0.0, "ignore_eos": True}
    running = asyncio.create_task(engine.generate(name, prompt_ids=PROMPT, sampling_params=params))
    await until_decoding(engine, [running])
    await pusher.update(weights, global_steps=label, mode=mode)
    segment = await running
    if ran_to_budget(segment, BUDGET, update=label):
        raise LateAction(f"{name} ran out its tokens before the update")
    switch = segment.global_steps.index(label)
    assert switch > 0, f"{name}: the update landed before the request decoded"
    assert segment.global_steps == (label - 1,) * switch + (label,) * (BUDGET - switch)
    fresh = await engine.generate(f"{name}-fresh", prompt_ids=PROMPT + list(
        segment.token_ids[:switch]), sampling_params={**params, "max_tokens": BUDGET - switch})
    return segment.token_ids[switch:], fresh.token_ids


@retry_if_late
async def test_inflight_recompute_goes_on_as_the_new_weights_would_from_the_same_tokens(
    engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path, pusher: WeightPusher
) -> None:
    """A request crossed by an ``inflight-recompute`` update goes on exactly as a fresh
    request of the new weights given its tokens so far (its KV was computed again), with no
    pause and nothing aborted; crossed by an ``inflight`` one, it goes on from the old
    weights' KV and says other tokens (so the check tells the two modes apart)."""
    if not engine.recomputes_in_step:  # vLLM schedules ahead (the GPU's async scheduling)
        pytest.skip("refused where vLLM schedules ahead (test_inflight_is_refused_...)")
    a, b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    steps = (engine.global_steps or 0) + 1
    await pusher.update(a, global_steps=steps)
    aborted = engine.statistics().num_aborted
    went_on, fresh = await crossed_by(engine, pusher, b, label=steps + 1,
                                      mode="inflight-recompute", name=f"recompute-{steps}")
    assert went_on == fresh
    assert engine.statistics().num_aborted == aborted and not engine.is_paused
    await pusher.update(a, global_steps=steps + 2)
    went_on, fresh = await crossed_by(engine, pusher, b, label=steps + 3, mode="inflight",
                                      name=f"kept-{steps}")
    assert went_on != fresh


async def test_a_caller_cancelled_anywhere_leaves_the_engine_whole_and_labelled_as_it_serves(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher
) -> None:
    """An inflight update cancelled after 0, 1, 2... loop turns, each time while requests
    decode: the engine serves wholly old or wholly new weights (never a mix), labelled as
    they are, and the decoding requests finish, none aborted."""
    sets = {OLD: telling(tiny_model_a, OLD), NEW: telling(tiny_model_a, NEW)}
    steps = (engine.global_steps or 0) + 1
    await pusher.update(sets[OLD], global_steps=steps)
    serving = {steps: OLD}
    outcomes = set()
    for turns in range(0, 40, 3):
        label = engine.global_steps
        assert label is not None
        target = NEW if serving[label] == OLD else OLD
        running = asyncio.create_task(engine.generate(
            f"cancelled-{steps}-{turns}", prompt_ids=[4],
            sampling_params={"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}))
        update = asyncio.create_task(
            pusher.update(sets[target], global_steps=label + 1, mode="inflight")
        )
        for _ in range(turns):
            await asyncio.sleep(0)
        update.cancel()
        try:
            await update
            outcomes.add("done")
        except asyncio.CancelledError:
            outcomes.add("cancelled")
        except WeightSyncError:  # a push cancelled midway fails: the old weights, restored
            outcomes.add("failed")
        label = engine.global_steps
        assert label is not None
        serving.setdefault(label, target)
        probe = await engine.generate(
            f"probe-{steps}-{turns}", prompt_ids=[2],
            sampling_params={"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
        assert probe.token_ids == (serving[label],) * 2, (turns, label)
        assert probe.global_steps == (label,) * 2
        segment = await running
        assert segment.finish_reason == "length"
        for token, steps_of_token in zip(segment.token_ids, segment.global_steps, strict=True):
            assert weights_of(token) == serving[steps_of_token]
    assert "cancelled" in outcomes and not engine.is_paused
    label = engine.global_steps
    assert label is not None
    target = NEW if serving[label] == OLD else OLD
    await pusher.update(sets[target], global_steps=label + 1, mode="inflight")  # not cancelled
    probe = await engine.generate(f"probe-{steps}-last", prompt_ids=[2], sampling_params={
        "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert probe.token_ids == (target,) * 2 and probe.global_steps == (label + 1,) * 2


async def test_inflight_is_refused_before_anything_moves_where_it_cannot_be_atomic(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No backup to undo a failed push before the next step, or an engine that cannot commit
    between steps: refused at the call, nothing paused, label and weights unchanged."""
    weights = load_weights(tiny_model_a)
    label = engine.global_steps
    assert label is not None
    async def refused(mode: ResumeMode, match: str, backup: bool | None) -> None:
        pusher = WeightPusher([engine], backup=backup)
        try:
            with pytest.raises(InvalidRequestError, match=match):
                await pusher.update(weights, global_steps=label + 1, mode=mode)
        finally:
            await pusher.aclose()

    await refused("inflight", "backup", backup=False)
    monkeypatch.setattr(engine, "recomputes_in_step", False)  # as where vLLM schedules ahead
    await refused("inflight-recompute", "cannot preempt", backup=True)
    monkeypatch.setattr(engine, "commits_in_step", False)
    await refused("inflight", "between two engine steps", backup=None)
    assert engine.global_steps == label and not engine.is_paused
    assert engine.statistics().global_steps == label


async def test_a_bad_tensor_is_refused_before_anything_is_committed(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher
) -> None:
    weights = telling(tiny_model_a, NEW)
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1]  # one row short
    label = engine.global_steps
    assert label is not None
    with pytest.raises(InvalidRequestError, match="lm_head"):
        await pusher.update(weights, global_steps=label + 1, mode="inflight")
    assert engine.global_steps == label and not engine.is_paused


async def test_a_landed_push_arrives_while_the_engine_takes_no_step(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``land=True``: with the engine's step loop held (an RPC that waits), the whole push
    lands and passes every worker's check: the take, which the pusher sends only once the
    verdicts are in, is sent while the loop is still held. Once the loop goes on, the take
    commits between two steps and the engine serves the new weights under their label."""
    old, new = telling(tiny_model_a, OLD), telling(tiny_model_a, NEW)
    pusher = WeightPusher([engine], bucket_bytes=SMALL_BUCKETS, backup=True, land=True)
    taking = asyncio.Event()
    take = engine.weights.take

    async def spied(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("landed") is True
        taking.set()
        return await take(*args, **kwargs)

    try:
        steps = (engine.global_steps or 0) + 1
        await pusher.update(old, global_steps=steps, mode="inflight")
        monkeypatch.setattr(engine.weights, "take", spied)
        async with steps_held(engine) as hold:
            update = asyncio.ensure_future(
                pusher.update(new, global_steps=steps + 1, mode="inflight"))
            await taking.wait()  # every byte landed and was checked
            assert not hold.done() and not update.done()
        report = await update
        delivery = report.deliveries[engine.name]
        # (the commit's check of the parameters counts what it finds whole: on a GPU, fused
        # parameters hold several tensors; the landing checked every one of them already)
        assert delivery.verified + delivery.not_verifiable == len(new)
        probe = await engine.generate(f"landed-probe-{steps}", prompt_ids=[2], sampling_params={
            "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
        assert probe.token_ids == (NEW,) * 2 and probe.global_steps == (steps + 1,) * 2
    finally:
        monkeypatch.undo()
        await pusher.update(load_weights(tiny_model_a), global_steps=(engine.global_steps or 0) + 1)
        await pusher.aclose()


@pytest.mark.parametrize("when", ["before its take", "while its take runs"])
async def test_a_landed_update_cancelled_around_its_take_leaves_the_engine_whole_and_labelled(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """``land=True``, the caller cancelled once the push has landed: before its take is sent
    (nothing is committed; the landed push is never taken, and the next one replaces it), or
    while the take runs between two steps (it commits, and the engine still carries the new
    label). Either way the engine serves wholly old or wholly new weights under their label,
    a request decoding across it is labelled token by token, and the next update lands."""
    sets = {OLD: telling(tiny_model_a, OLD), NEW: telling(tiny_model_a, NEW)}
    pusher = WeightPusher([engine], bucket_bytes=SMALL_BUCKETS, backup=True, land=True)
    update: asyncio.Task[object] | None = None
    take = engine.weights.take

    async def cancelling(*args: Any, **kwargs: Any) -> Any:
        assert update is not None
        if when == "before its take":
            update.cancel()
            await asyncio.sleep(0)  # cancelled here: the take never leaves
        running = asyncio.ensure_future(take(*args, **kwargs))
        for _ in range(3):  # the RPC is out
            await asyncio.sleep(0)
        update.cancel()
        return await running

    try:
        steps = (engine.global_steps or 0) + 1
        await pusher.update(sets[OLD], global_steps=steps, mode="inflight")
        running = asyncio.create_task(engine.generate(
            f"landed-cancel-{steps}", prompt_ids=[4],
            sampling_params={"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}))
        await until_decoding(engine, [running])
        monkeypatch.setattr(engine.weights, "take", cancelling)
        update = asyncio.create_task(
            pusher.update(sets[NEW], global_steps=steps + 1, mode="inflight"))
        with pytest.raises(asyncio.CancelledError):
            await update
        monkeypatch.undo()
        label = steps if when == "before its take" else steps + 1
        serving = OLD if when == "before its take" else NEW
        assert engine.global_steps == label and not engine.is_paused
        probe = await engine.generate(f"landed-cancel-probe-{steps}", prompt_ids=[2],
                                      sampling_params={"max_tokens": 2, "temperature": 0.0,
                                                       "ignore_eos": True})
        assert probe.token_ids == (serving,) * 2 and probe.global_steps == (label,) * 2
        segment = await running
        for token, label_of in zip(segment.token_ids, segment.global_steps, strict=True):
            assert label_of == (steps if weights_of(token) == OLD else steps + 1)
        target = NEW if serving == OLD else OLD
        await pusher.update(sets[target], global_steps=label + 1, mode="inflight")
        probe = await engine.generate(f"landed-cancel-after-{steps}", prompt_ids=[2],
                                      sampling_params={"max_tokens": 2, "temperature": 0.0,
                                                       "ignore_eos": True})
        assert probe.token_ids == (target,) * 2 and probe.global_steps == (label + 1,) * 2
    finally:
        monkeypatch.undo()
        await pusher.update(load_weights(tiny_model_a), global_steps=(engine.global_steps or 0) + 1)
        await pusher.aclose()


async def test_pieces_a_landing_pusher_cannot_land_are_refused_before_any_pause(
    engine: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``land=True`` lands whole tensors: a push with a piece of one (a sharded trainer's) is
    refused at the call with ``InvalidRequestError``, before a pausing mode pauses; the engine
    keeps its label and serves on."""
    weights = load_weights(tiny_model_a)
    embed = weights.pop("model.embed_tokens.weight")
    half = embed[: embed.shape[0] // 2].contiguous()
    weights["model.embed_tokens.weight"] = Piece(half, whole=tuple(embed.shape), offset=0)
    label = engine.global_steps
    assert label is not None
    pauses: list[object] = []
    pause = engine.pause

    async def counted(*args: Any, **kwargs: Any) -> None:
        pauses.append(args)
        await pause(*args, **kwargs)

    monkeypatch.setattr(engine, "pause", counted)
    pusher = WeightPusher([engine], backup=True, land=True)
    try:
        for mode in ("keep", "inflight"):
            with pytest.raises(InvalidRequestError, match="lands whole tensors"):
                await pusher.update(weights, global_steps=label + 1, mode=mode)
        assert pusher.sender is None  # nothing attached, nothing moved
    finally:
        await pusher.aclose()
    assert pauses == [] and engine.global_steps == label and not engine.is_paused


async def test_a_landing_pusher_and_a_receiving_one_take_turns_on_one_engine(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher
) -> None:
    """Two pushers on one engine, one landing first and one not (each with its own sender:
    the landing threads and the workers' receivers), update it in turn: each push loads as
    its own sender said, and the engine serves every update under its label."""
    sets = {OLD: telling(tiny_model_a, OLD), NEW: telling(tiny_model_a, NEW)}
    other = WeightPusher([engine], bucket_bytes=SMALL_BUCKETS, backup=True,
                         land=not pusher.channel._land)
    try:
        steps = (engine.global_steps or 0) + 1
        for turn, (by, which) in enumerate(
            [(pusher, OLD), (other, NEW), (pusher, OLD), (other, NEW)]
        ):
            await by.update(sets[which], global_steps=steps + turn, mode="inflight")
            probe = await engine.generate(
                f"turns-{steps}-{turn}", prompt_ids=[2],
                sampling_params={"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
            assert probe.token_ids == (which,) * 2 and probe.global_steps == (steps + turn,) * 2
    finally:
        await other.aclose()


async def test_bytes_that_differ_from_their_fingerprints_commit_nothing(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's fingerprint of one tensor does not match its bytes (as a push altered on
    its way would): the inflight update fails, the engine serves its previous weights under
    their label (landed: refused in the landing, no take sent; received: rolled back in the
    take), and the next update goes through."""
    old, new = telling(tiny_model_a, OLD), telling(tiny_model_a, NEW)
    steps = (engine.global_steps or 0) + 1
    await pusher.update(old, global_steps=steps, mode="inflight")
    channel = pusher.channel
    real = channel._fingerprinter
    takes = 0
    take = engine.weights.take

    def altered(tensors: Any, *args: Any, **kwargs: Any) -> dict[str, bytes]:
        prints = real(tensors, *args, **kwargs)
        prints["model.norm.weight"] = bytes(len(prints["model.norm.weight"]))
        return prints

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal takes
        takes += 1
        return await take(*args, **kwargs)

    monkeypatch.setattr(channel, "_fingerprinter", altered)
    monkeypatch.setattr(engine.weights, "take", counted)
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight"):
        await pusher.update(new, global_steps=steps + 1, mode="inflight")
    assert takes == (0 if channel._land else 1)
    monkeypatch.undo()
    assert engine.global_steps == steps and not engine.is_paused
    probe = await engine.generate(f"refused-probe-{steps}", prompt_ids=[2], sampling_params={
        "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert probe.token_ids == (OLD,) * 2 and probe.global_steps == (steps,) * 2
    await pusher.update(new, global_steps=steps + 1, mode="inflight")
    probe = await engine.generate(f"refused-after-{steps}", prompt_ids=[2], sampling_params={
        "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert probe.token_ids == (NEW,) * 2 and probe.global_steps == (steps + 1,) * 2


@retry_if_late
async def test_the_manager_takes_new_calls_through_an_inflight_update(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher
) -> None:
    """Through the manager (its own pusher, with the backup this mode needs): requests in
    flight and one made during the update run on the weights in force when each token is
    sampled, labelled so, and none is resubmitted. (That the call is not held at the gate:
    ``test_update_races``, where the update can be held open.)"""
    old, new = telling(tiny_model_a, OLD), telling(tiny_model_a, NEW)
    steps = (engine.global_steps or 0) + 1
    await pusher.update(old, global_steps=steps)
    params = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    async with AsyncServerManager([engine], resume_mode="inflight") as manager:
        before = [asyncio.create_task(manager.generate(f"m-before-{steps}-{i}", prompt_ids=[5, i],
                                                       sampling_params=params))
                  for i in range(4)]
        await until_decoding(manager, before)
        update = asyncio.create_task(manager.update_weights(new, global_steps=steps + 1))
        during = asyncio.create_task(manager.generate(f"m-during-{steps}", prompt_ids=[6],
                                                      sampling_params=params))
        await update
        outputs = await asyncio.gather(*before, during)
        assert manager.global_steps == steps + 1
        assert manager.statistics().num_preempted == 0
    if any(ran_to_budget(o, 300, update=steps + 1) for o in outputs[:4]):
        raise LateAction("a request ran out its tokens before the update")
    for output in outputs:
        assert len(output.token_ids) == 300
        for token, label in zip(output.token_ids, output.global_steps, strict=True):
            assert label == (steps if weights_of(token) == OLD else steps + 1)


async def test_a_caller_cancelled_while_the_commit_answers_still_gets_its_label(
    engine: VLLMEngine, tiny_model_a: Path, pusher: WeightPusher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker committed; the caller is cancelled while the RPC's answer is on its way
    back. The engine serves the new weights, so it must carry their label (it kept the old
    one: the answer, which places the boundary, was dropped with the cancelled wait)."""
    old, new = telling(tiny_model_a, OLD), telling(tiny_model_a, NEW)
    steps = (engine.global_steps or 0) + 1
    await pusher.update(old, global_steps=steps)
    update: asyncio.Task[object] | None = None
    real = vllm_client(engine).collective_rpc

    async def answering_late(method: str, *args: object, **kwargs: object) -> object:
        answer = await real(method, *args, **kwargs)
        if method == "asyncroll_take_update" and update is not None:
            update.cancel()
            for _ in range(20):  # loop turns: the cancellation reaches the receive first
                await asyncio.sleep(0)
        return answer

    monkeypatch.setattr(vllm_client(engine), "collective_rpc", answering_late)
    running = asyncio.create_task(engine.generate(
        f"answered-late-{steps}", prompt_ids=[4],
        sampling_params={"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}))
    update = asyncio.create_task(pusher.update(new, global_steps=steps + 1, mode="inflight"))
    with pytest.raises(asyncio.CancelledError):
        await update
    monkeypatch.undo()
    assert engine.global_steps == steps + 1 and not engine.is_paused
    probe = await engine.generate(f"answered-late-probe-{steps}", prompt_ids=[2], sampling_params={
        "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert probe.token_ids == (NEW,) * 2 and probe.global_steps == (steps + 1,) * 2
    segment = await running
    for token, label in zip(segment.token_ids, segment.global_steps, strict=True):
        assert label == (steps if weights_of(token) == OLD else steps + 1)


@pytest.mark.engine  # imports vLLM (the worker's module)
def test_the_count_of_a_request_that_just_ended_reaches_the_next_commit() -> None:
    """A request can end in the step before a commit while its last output still waits in the
    client for the commit's answer: its count must be in that answer, then forgotten."""
    import types

    import numpy as np

    from asyncroll.vllm.worker import SampleCounter

    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_id_to_index={"a-12345678": 0, "b-12345678": 1}),
        discard_request_mask=types.SimpleNamespace(np=np.array([False, True])),
        execute_model=lambda step, *args: None,
    )
    counter = SampleCounter(runner)

    def step(scheduled: list[str], finished: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        runner.execute_model(types.SimpleNamespace(
            finished_req_ids=set(finished), total_num_scheduled_tokens=len(scheduled),
            num_scheduled_tokens=dict.fromkeys(scheduled, 1)))

    step(["a-12345678", "b-12345678"])  # b's prompt is cut mid-way: nothing sampled
    step(["a-12345678"])
    step([], {"a-12345678"})  # a ended; no batch ran
    assert counter.sampled == {} and counter.report() == {"a-12345678": 2}
    assert counter.report() == {}


async def test_the_step_spans_bracket_an_rpc_run_between_two_steps(engine: VLLMEngine) -> None:
    """``asyncroll_step_spans`` (what the rollout benchmark splits an inflight commit's gap
    by): each step's start and end, in order and apart, on the clock every process shares;
    an RPC held between two steps lies after the end of the step before it and before the
    start of the step after it."""
    import time

    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    since = time.perf_counter()
    await engine.generate("spans-before", prompt_ids=[2, 3], sampling_params=params)
    async with steps_held(engine):
        held = time.perf_counter()
        after = asyncio.ensure_future(
            engine.generate("spans-after", prompt_ids=[2, 4], sampling_params=params))
        await asyncio.sleep(0)
        released = time.perf_counter()
    await after
    spans = (await engine.collective_rpc("asyncroll_step_spans", kwargs={"since": since}))[0]
    assert len(spans) >= 2 * params["max_tokens"]
    assert all(a <= b for a, b in spans) and all(b > a for a, b in spans[-3:])  # ends stamped
    assert all(b <= c for (_, b), (c, _) in itertools.pairwise(spans))
    before_hold = [s for s in spans if s[0] < held]
    after_hold = [s for s in spans if s[0] >= held]
    assert before_hold and after_hold
    assert before_hold[-1][1] <= held and after_hold[0][0] >= released
