"""Bad and failed weight updates against real vLLM CPU engines: nothing kills an engine, and
what the error says is what the engine serves afterwards (compared by greedy outputs)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from engine_helpers import (
    DOOMED_ARGS,
    FRESH_GREEDY,
    SpareEngines,
    greedy,
    inject_fault,
    load_weights,
    selected_tests,
    update_weights,
)

import asyncroll.weights as weights_module
from asyncroll import (
    AsyncServerManager,
    EngineDeadError,
    InvalidRequestError,
    VLLMEngine,
    WeightPusher,
    WeightSyncError,
)
from asyncroll.testing import vllm_client
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late, until_decoding
from asyncroll.types import Segment
from asyncroll.vllm import compat
from asyncroll.weights import SenderChannel

Q0 = "model.layers.0.self_attn.q_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"
NORM = "model.norm.weight"


@pytest.fixture
async def serving_a(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path
) -> AsyncIterator[VLLMEngine]:
    """The shared engine serving model A, checked before and after the test (``engine_b``
    started too: it records model B's fresh greedy outputs)."""
    steps = (engine.global_steps or 0) + 1
    await update_weights(engine, load_weights(tiny_model_a), global_steps=steps)
    assert await greedy(engine, "serving-a") == FRESH_GREEDY["a"]
    yield engine
    stats = engine.statistics()
    assert not stats.dead and not stats.paused and stats.in_flight == 0
    assert engine.num_unfinished_in_vllm() == 0


def _no_pause(engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a bad update paused the engine")

    monkeypatch.setattr(engine, "pause", refuse)


def _bad_updates(a: dict[str, torch.Tensor]) -> Iterator[tuple[str, dict[str, torch.Tensor], str]]:
    """(case, update, a word the error must contain)."""
    q0 = a[Q0]
    yield "unknown name last", {**a, "model.layers.9.mlp.up_proj.weight": q0}, "unknown"
    yield "fused member wrong shape", {**a, Q0: q0[:-1]}, Q0
    yield "final norm wrong shape", {**a, NORM: torch.ones(7)}, NORM
    yield "int32 for a float", {**a, NORM: a[NORM].to(torch.int32)}, NORM
    yield "bool for a float", {UP1: a[UP1] > 0}, UP1
    nan = a[UP1].clone()
    nan[3, 5] = float("nan")
    yield "NaN", {**a, UP1: nan}, UP1
    inf = a[NORM].clone()
    inf[0] = float("inf")
    yield "inf", {NORM: inf}, NORM


async def test_bad_updates_are_refused_before_any_engine_pauses(
    serving_a: VLLMEngine, tiny_model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fds_before = psutil.Process().num_fds()
    a = load_weights(tiny_model_a)
    before = serving_a.global_steps
    async with AsyncServerManager([serving_a]) as manager:
        _no_pause(serving_a, monkeypatch)
        for case, update, word in _bad_updates(a):
            with pytest.raises(InvalidRequestError, match=word):
                await manager.update_weights(update, global_steps=(before or 0) + 1)
            with pytest.raises(InvalidRequestError, match=word):
                await update_weights(serving_a, update, global_steps=(before or 0) + 1)
            assert serving_a.global_steps == before, case
        for steps in ("3", 18.5, -1, 2**70, True):
            with pytest.raises(InvalidRequestError, match="global_steps"):
                await manager.update_weights(a, global_steps=steps)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequestError, match="global_steps"):
                await update_weights(serving_a, a, global_steps=steps)  # type: ignore[arg-type]
        monkeypatch.undo()
        assert manager.statistics().updating is False
        # Nothing was touched: same weights, same label, and a good update goes through.
        assert await greedy(serving_a, "after-bad") == FRESH_GREEDY["a"]
        await manager.update_weights(a, global_steps=(before or 0) + 1)
    assert serving_a.global_steps == (before or 0) + 1
    assert psutil.Process().num_fds() <= fds_before + 4


async def test_a_failure_after_every_tensor_loaded_restores_the_previous_weights(
    serving_a: VLLMEngine, tiny_model_b: Path
) -> None:
    """The worst case for a rollback: every layer already holds (and processed) the new
    weights when the push fails. The error says the previous weights stay: they must."""
    before = serving_a.global_steps
    pusher = WeightPusher([serving_a])
    try:
        await pusher.update(load_weights(tiny_model_b), global_steps=None)  # attach
        assert await greedy(serving_a, "b-then") == FRESH_GREEDY["b"]
        await pusher.update(_served_a(serving_a), global_steps=None)
        async with inject_fault(serving_a, "after_load"):
            with pytest.raises(WeightSyncError, match="every engine serves its previous weights"):
                await pusher.update(load_weights(tiny_model_b), global_steps=(before or 0) + 1)
    finally:
        await pusher.aclose()
    assert serving_a.global_steps == before
    assert not serving_a.statistics().holding
    assert await greedy(serving_a, "after-late-failure") == FRESH_GREEDY["a"]


@pytest.mark.parametrize("skipped", ["", UP1], ids=["every-tensor", "one-tensor"])
async def test_a_push_the_worker_does_not_load_fails_loudly_and_keeps_the_old_weights(
    serving_a: VLLMEngine, tiny_model_b: Path, skipped: str
) -> None:
    """A worker whose loader takes nothing, or silently skips one name, must not turn a push
    into a silent no-op: the update fails naming what was lost, the label stays, and the
    previous weights keep serving."""
    before = serving_a.global_steps
    pusher = WeightPusher([serving_a])
    try:
        async with inject_fault(serving_a, "skip", tensor=skipped):
            with pytest.raises(WeightSyncError) as failed:
                await pusher.update(load_weights(tiny_model_b), global_steps=(before or 0) + 1)
    finally:
        await pusher.aclose()
    message = str(failed.value)
    assert "every engine serves its previous weights" in message
    if skipped:
        assert skipped in message and "never reached the model's loader" in message
    else:
        assert "loaded none of them" in message
    assert serving_a.global_steps == before
    assert not serving_a.statistics().holding
    assert await greedy(serving_a, "after-no-op") == FRESH_GREEDY["a"]


@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no-backup"])
async def test_a_tensor_loaded_wrong_fails_the_push_naming_it(
    serving_a: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path, backup: bool
) -> None:
    """A worker whose loaded weights differ from the pushed ones after the load (one element
    of one parameter changed, by a test hook): the fingerprints catch it, the push fails
    naming the tensor; with a backup the previous weights keep serving, without one the
    engine holds until a push succeeds."""
    before = serving_a.global_steps
    pusher = WeightPusher([serving_a], backup=backup)
    try:
        async with inject_fault(serving_a, "corrupt", tensor=NORM):
            with pytest.raises(WeightSyncError, match=r"differ from what was pushed.*model\.norm"):
                await pusher.update(load_weights(tiny_model_b), global_steps=(before or 0) + 1)
        assert serving_a.global_steps == before
        if backup:
            assert not serving_a.statistics().holding
            assert await greedy(serving_a, "after-corrupt") == FRESH_GREEDY["a"]
        else:
            assert serving_a.statistics().holding
        await pusher.update(load_weights(tiny_model_a), global_steps=(before or 0) + 1)
        (report,) = await vllm_client(serving_a).collective_rpc("asyncroll_last_receive_report")
        checked, unchecked = report["verified"]
        assert checked > 0 and checked + unchecked == len(load_weights(tiny_model_a))
    finally:
        await pusher.aclose()
    assert not serving_a.statistics().holding
    assert await greedy(serving_a, "after-good-push") == FRESH_GREEDY["a"]


def _served_a(engine: VLLMEngine) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(engine.model_path) / "model.safetensors"))


async def test_a_bad_tensor_that_slips_past_the_checks_never_kills_the_engine(
    serving_a: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: with the pre-checks switched off, a wrong-shaped fused member and an
    unknown last name reach the workers; the push fails there, the engine lives and serves
    what it served before."""
    monkeypatch.setattr(weights_module, "check_update", lambda *args, **kwargs: None)
    b = load_weights(tiny_model_b)
    before = serving_a.global_steps
    for update in ({**b, Q0: b[Q0][:-1]}, {**b, "model.layers.9.mlp.up_proj.weight": b[UP1]}):
        with pytest.raises(WeightSyncError):
            await update_weights(serving_a, update, global_steps=(before or 0) + 1)
        assert not serving_a.is_dead and not serving_a.statistics().holding
        assert serving_a.global_steps == before
        assert await greedy(serving_a, "after-slipped") == FRESH_GREEDY["a"]
    monkeypatch.undo()
    await update_weights(serving_a, load_weights(tiny_model_a), global_steps=(before or 0) + 1)


@pytest.mark.parametrize(
    "names",
    [pytest.param([Q0], id="one fused member"), pytest.param(None, id="all but one up_proj")],
)
async def test_partial_updates_with_unchanged_values_change_nothing(
    serving_a: VLLMEngine, tiny_model_a: Path, names: list[str] | None
) -> None:
    a = load_weights(tiny_model_a)
    update = {n: a[n] for n in names} if names else {n: t for n, t in a.items() if n != UP1}
    await update_weights(serving_a, update, global_steps=(serving_a.global_steps or 0) + 1)
    assert await greedy(serving_a, f"partial-{len(update)}") == FRESH_GREEDY["a"]


async def test_a_partial_update_applies_exactly_its_tensors(
    serving_a: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """B's tensors pushed one module at a time into an engine serving A end up serving B."""
    a, b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    steps = (serving_a.global_steps or 0) + 1
    half = sorted(b)[: len(b) // 2]
    await update_weights(serving_a, {n: b[n] for n in half}, global_steps=steps)
    await update_weights(serving_a, {n: b[n] for n in b if n not in half}, global_steps=steps + 1)
    assert await greedy(serving_a, "pieces-b") == FRESH_GREEDY["b"]
    await update_weights(serving_a, a, global_steps=steps + 2)


async def test_a_partial_update_without_a_backup_fails_loudly_and_holds(
    serving_a: VLLMEngine, tiny_model_a: Path
) -> None:
    """The layerwise load cannot fill in a fused layer's other members without a backup."""
    a = load_weights(tiny_model_a)
    pusher = WeightPusher([serving_a], backup=False)
    try:
        with pytest.raises(WeightSyncError, match="needs a backup"):
            await pusher.update({Q0: a[Q0]}, global_steps=None)
        assert serving_a.statistics().holding
        await pusher.update(a, global_steps=(serving_a.global_steps or 0) + 1)
    finally:
        await pusher.aclose()
    assert not serving_a.statistics().holding
    assert await greedy(serving_a, "after-partial-hold") == FRESH_GREEDY["a"]


async def test_a_cancelled_update_leaves_the_engine_whole(
    serving_a: VLLMEngine, tiny_model_b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancel the update while the bytes move (small buckets: many of them); afterwards the
    engine serves the old weights under the old label, or the new ones under the new label."""
    before = serving_a.global_steps
    entered = asyncio.Event()
    transfer = SenderChannel._transfer

    async def signalling(self: SenderChannel, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        return await transfer(self, *args, **kwargs)

    monkeypatch.setattr(SenderChannel, "_transfer", signalling)
    pusher = WeightPusher([serving_a], bucket_bytes=64 << 10)
    try:
        update = asyncio.create_task(
            pusher.update(load_weights(tiny_model_b), global_steps=(before or 0) + 1)
        )
        await entered.wait()
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
    finally:
        await pusher.aclose()
    stats = serving_a.statistics()
    assert not stats.dead and not stats.paused and not stats.holding
    served = await greedy(serving_a, "after-cancel")
    if serving_a.global_steps == before:
        assert served == FRESH_GREEDY["a"]
    else:
        assert serving_a.global_steps == (before or 0) + 1 and served == FRESH_GREEDY["b"]
    monkeypatch.undo()
    await update_weights(serving_a, _served_a(serving_a), global_steps=(before or 0) + 2)


def _workers_of(core_pid: int) -> list[int]:
    return [child.pid for child in psutil.Process(core_pid).children(recursive=True)]


SPARES = {
    "test_a_worker_killed_mid_push_fails_the_update_and_spares_the_others": "doomed-push",
    "test_calls_in_flight_when_the_engine_core_dies_fail_at_once": "core-dies",
}
"""The fresh engine each test kills."""


@pytest.fixture(scope="module")
async def spares(
    request: pytest.FixtureRequest, tiny_model_a: Path
) -> AsyncIterator[SpareEngines]:
    """Fresh engines on model A for the tests that kill one, started together."""
    names = [SPARES[test] for test in selected_tests(request) if test in SPARES]
    started = SpareEngines(tiny_model_a, names, DOOMED_ARGS)
    try:
        yield started
    finally:
        await started.aclose()


async def test_a_worker_killed_mid_push_fails_the_update_and_spares_the_others(
    serving_a: VLLMEngine, spares: SpareEngines, tiny_model_b: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doomed = await spares.take("doomed-push")
    try:
        (core,) = (process.pid for process in compat.engine_core_processes(vllm_client(doomed)))
        victims = _workers_of(core)
        assert victims, "the CPU build runs its worker in a process of its own"
        transfer = SenderChannel._transfer

        async def kill_then_transfer(self: SenderChannel, *args: Any, **kwargs: Any) -> Any:
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            return await transfer(self, *args, **kwargs)

        monkeypatch.setattr(SenderChannel, "_transfer", kill_then_transfer)
        pusher = WeightPusher([serving_a, doomed], timeout=20.0)
        async with AsyncServerManager([serving_a, doomed], weights=pusher) as manager:
            steps = (manager.global_steps or 0) + 1
            with pytest.raises(WeightSyncError):
                await manager.update_weights(load_weights(tiny_model_b), global_steps=steps)
            monkeypatch.undo()
            assert not serving_a.is_dead and not serving_a.statistics().holding
            assert await greedy(serving_a, "survivor") == FRESH_GREEDY["a"]
    finally:
        await doomed.aclose()


@retry_if_late
@pytest.mark.engine
async def test_calls_in_flight_when_the_engine_core_dies_fail_at_once(
    spares: SpareEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's client never fails a call it sent before its EngineCore exited: without the
    adapter's own watch, the resume below waits forever (CI saw it: an update whose engine's
    worker was killed hung in the resume after the failed push)."""
    doomed = await spares.take("core-dies")
    ended: Segment | None = None
    try:
        (core,) = compat.engine_core_processes(vllm_client(doomed))
        client = vllm_client(doomed).engine_core
        send = client._send_input_message
        sent: list[object] = []
        both_sent = asyncio.Event()

        def counted(message: Any, engine: Any) -> Any:
            sending = send(message, engine)

            async def sent_then_counted() -> None:
                await sending
                sent.append(message)
                if len(sent) == 2:
                    both_sent.set()

            return sent_then_counted()

        decoding = asyncio.ensure_future(doomed.generate(
            "in-flight", prompt_ids=[1, 2, 3],
            sampling_params={"max_tokens": 400, "ignore_eos": True},
        ))
        await until_decoding(doomed, [decoding])
        monkeypatch.setattr(client, "_send_input_message", counted)
        os.kill(core.pid, signal.SIGSTOP)  # it reads nothing from here on: no call is answered
        calls = [
            asyncio.ensure_future(doomed.resume()),
            asyncio.ensure_future(doomed.weights.read_ranges()),
        ]
        await both_sent.wait()  # each call now waits for an answer that never comes
        os.kill(core.pid, signal.SIGKILL)
        for call in calls:
            with pytest.raises(EngineDeadError, match="core-dies"):
                await call
        try:
            ended = await decoding
        except EngineDeadError as dead:
            assert "core-dies" in str(dead)
        else:  # it had run out its tokens before the core stopped
            assert ran_to_budget(ended, 400), ended
        assert doomed.is_dead and doomed.statistics().dead
        with pytest.raises(EngineDeadError):
            await doomed.generate("after", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 2})
    finally:
        monkeypatch.undo()
        await doomed.aclose()
    if ended is not None:
        raise LateAction("the request ran out its 400 tokens before the core stopped")
