"""``RayEngine`` on a local Ray cluster started here: a vLLM CPU engine in a Ray actor.

One actor for the module (an engine start costs tens of seconds); the last test kills it.
"""

from __future__ import annotations

import asyncio
import glob
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from engine_helpers import ENGINE_ARGS, FRESH_GREEDY, greedy, hold, load_weights, until_decoding

from asyncroll import (
    AsyncServerManager,
    EngineDeadError,
    InvalidRequestError,
    VLLMEngine,
    WeightPusher,
)
from asyncroll.testing.contract import (
    ENGINE_CHECKS,
    UPDATE_CHECKS,
    LateAction,
    ran_to_budget,
    retry_if_late,
)

ray = pytest.importorskip("ray")

from asyncroll.ray import RayEngine  # noqa: E402 - after the skip

PARAMS: dict[str, Any] = {"max_tokens": 48, "temperature": 1.0, "ignore_eos": True}
LONG = 480


async def test_without_a_ray_cluster_start_is_a_typed_error(tiny_model_a: Path) -> None:
    """First in the module, before its cluster starts."""
    from asyncroll import EngineStartError

    if ray.is_initialized():
        pytest.skip("a cluster is up already")
    with pytest.raises(EngineStartError, match=r"ray\.init"):
        await RayEngine.start(tiny_model_a)


class _LastInFirstOutActor:
    """A stand-in for a Ray actor that runs its calls last in, first out: the order Ray may
    run an async actor's calls in, made certain. It runs a call only when ``run_one`` says."""

    def __init__(self) -> None:
        self.holding = False
        self.ran: list[str] = []
        self.queued: list[tuple[str, asyncio.Future[Any]]] = []
        self.call_sync = self  # ``actor.call_sync.remote(method, *args)``
        self.call = self  # ``actor.call.remote(method, *args)``

    def remote(self, method: str, *args: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.queued.append((method, future))
        return future

    def run_one(self) -> None:
        method, future = self.queued.pop()
        self.ran.append(method)
        self.holding = {"weights.hold": True, "weights.commit": False}.get(method, self.holding)
        future.set_result((None, {"paused": False, "asleep": False, "weights_asleep": False,
                                  "holding": self.holding, "global_steps": 0, "dead": False,
                                  "actor_s": 0.0}))


async def test_a_commit_never_overtakes_a_hold_even_when_the_actor_reorders_calls() -> None:
    """A hold is sent without waiting for an answer; the commit that ends it waits until every
    hold sent before it has run: else the actor, which may run the newest call first, would
    end the hold before it began and hold for good."""
    actor = _LastInFirstOutActor()
    info = {"vocab_size": 10, "max_model_len": 10, "model_path": "m", "pid": 1,
            "has_tokenizer": False, "num_workers": 1, "served_dtype": torch.float32}
    engine = RayEngine(actor, info, name="lifo", global_steps=0)
    for i in range(3):
        engine.weights.hold(f"test {i}")
    commit = asyncio.ensure_future(engine.weights.commit(None))
    while not commit.done():  # the actor runs whatever has reached it, newest first
        await asyncio.sleep(0)
        if actor.queued:
            actor.run_one()
    await commit
    assert actor.ran == ["weights.hold"] * 3 + ["weights.commit"]
    assert not actor.holding and not engine.statistics().holding


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local Ray cluster; on the way out, nothing of it or of the pushes may be left."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    segments = set(glob.glob("/dev/shm/asyncroll-*"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             namespace="asyncroll-tests")
    yield ray
    ray.shutdown()
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, left = psutil.wait_procs(started, timeout=60)  # exiting processes get time, not a pass
    assert not left, f"Ray left processes behind: {left}"
    assert set(glob.glob("/dev/shm/asyncroll-*")) <= segments, "a push left shared memory"


@pytest.fixture(scope="module")
async def remote(cluster: Any, tiny_model_a: Path, engine: VLLMEngine
                 ) -> AsyncIterator[RayEngine]:
    """A Ray engine on model A (``engine``, the local one, recorded model A's greedy outputs)."""
    started = await RayEngine.start(tiny_model_a, name="ray", **ENGINE_ARGS)
    yield started
    await started.aclose()


@pytest.fixture(scope="module")
async def pusher(remote: RayEngine) -> AsyncIterator[WeightPusher]:
    updater = WeightPusher([remote])
    yield updater
    await updater.aclose()


async def test_greedy_outputs_equal_a_local_engine_on_the_same_weights(remote: RayEngine
                                                                       ) -> None:
    assert await greedy(remote, "ray") == FRESH_GREEDY["a"]  # type: ignore[arg-type]


@pytest.mark.parametrize("check", ENGINE_CHECKS)
async def test_ray_engine_keeps_the_engine_contract(remote: RayEngine, check: str) -> None:
    await ENGINE_CHECKS[check](remote)
    assert await remote.remote_unfinished() == 0


async def test_the_proxy_refuses_a_duplicate_live_id_while_the_first_call_waits(
    remote: RayEngine,
) -> None:
    """Ray may run an async actor's calls in any order, so the actor cannot tell which of two
    calls with one id came first: the proxy registers the id at the call's first step. Here
    the first call waits at the proxy's gate (the engine holds), and the second is refused at
    once, without reaching the actor (stop 32's CI run saw the actor take the second first)."""
    params = {"max_tokens": 8, "ignore_eos": True}
    rejected = remote.statistics().num_rejected
    remote.weights.hold("test")
    try:
        first = asyncio.create_task(remote.generate("dup", prompt_ids=[5, 6],
                                                    sampling_params=params))
        await asyncio.sleep(0)
        second = asyncio.create_task(remote.generate("dup", prompt_ids=[5, 6],
                                                     sampling_params=params))
        await asyncio.sleep(0)
        assert second.done() and not first.done()
        with pytest.raises(InvalidRequestError, match="already live"):
            second.result()
        assert remote.statistics().num_rejected == rejected + 1
    finally:
        await remote.weights.commit(None)  # the weights in force: the hold ends
    assert len((await first).token_ids) == 8
    assert await remote.remote_unfinished() == 0


async def test_holds_and_commits_reach_the_actor_in_the_order_they_were_made(
    remote: RayEngine,
) -> None:
    """A hold is sent without waiting for an answer; a commit that overtook its hold in the
    actor would leave the actor holding (admitting nothing) while the proxy's gate is open:
    every later call would wait there for good."""
    for i in range(20):
        remote.weights.hold(f"test {i}")
        await remote.weights.commit(None)
    stats = await remote.remote_statistics()
    assert not stats.holding and not remote.statistics().holding
    params = {"max_tokens": 4, "ignore_eos": True}
    assert len((await remote.generate("after-holds", prompt_ids=[5, 6],
                                      sampling_params=params)).token_ids) == 4


@pytest.mark.parametrize("check", UPDATE_CHECKS)
async def test_ray_engine_keeps_the_update_contract(
    remote: RayEngine, pusher: WeightPusher, tiny_model_a: Path, check: str
) -> None:
    await UPDATE_CHECKS[check](remote, pusher, load_weights(tiny_model_a))
    assert await greedy(remote, f"ray-after-{check}") == FRESH_GREEDY["a"]  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["abort", "keep"])
@retry_if_late
async def test_the_manager_routes_and_updates_local_and_ray_engines_alike(
    remote: RayEngine, engine: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path, mode: str
) -> None:
    weights_a, weights_b = load_weights(tiny_model_a), load_weights(tiny_model_b)
    async with AsyncServerManager([engine, remote], resume_mode=mode) as manager:  # type: ignore[arg-type]
        # Long calls (the model's length allows 510 tokens): the update must land inside them
        # after the decoding has begun, on a 2-core machine that a busy loop shares.
        calls = [asyncio.ensure_future(manager.generate(
            f"mix-{mode}-{i}", prompt_ids=[5, i + 2],
            sampling_params={**PARAMS, "max_tokens": LONG})) for i in range(8)]
        await until_decoding(manager, calls)  # every call is inside an engine, both engines busy
        await hold(manager)  # none ends before the update's pause
        before = {engine.global_steps, remote.global_steps}  # (they may differ)
        steps = (manager.global_steps or 0) + 1
        report = await manager.update_weights(weights_b, global_steps=steps)
        outputs = await asyncio.gather(*calls)
        await manager.update_weights(weights_a, global_steps=steps + 1)
        if all(ran_to_budget(output, LONG, update=steps) for output in outputs):
            raise LateAction(f"every call ran out its {LONG} tokens before the update's pause")
        assert set(report.deliveries) == {engine.name, remote.name}
        assert {o.engines[0] for o in outputs} == {engine.name, remote.name}
        spanning = 0
        for output in outputs:
            assert len(output.token_ids) == LONG
            versions = [v for v in output.global_steps if v is not None]
            assert versions == sorted(versions) and versions[-1] in before | {steps}
            spanning += versions[0] < steps == versions[-1]
        assert spanning, "the update landed inside no call"
        if mode == "abort":
            assert any(o.num_preempted for o in outputs)
    assert await greedy(remote, f"ray-back-{mode}") == FRESH_GREEDY["a"]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def broadcaster(remote: RayEngine, engine: VLLMEngine) -> AsyncIterator[WeightPusher]:
    """Pushes over the broadcast transport (gloo here) into the Ray engine and the local one:
    the group forms from this host's address, whatever host the actor is on."""
    updater = WeightPusher([remote, engine], backend="broadcast", bucket_bytes=256 << 10)
    yield updater
    await updater.aclose()


async def test_a_broadcast_push_into_ray_and_local_engines_is_token_exact(
    remote: RayEngine, engine: VLLMEngine, broadcaster: WeightPusher, tiny_model_a: Path,
    tiny_model_b: Path,
) -> None:
    """Against model B's greedy outputs as the staged transport delivers it (token-exact with
    a fresh engine on B: tests/test_engine.py), and a fresh engine's where one ran."""
    steps = max(remote.global_steps or 0, engine.global_steps or 0) + 1
    staged = WeightPusher([engine])
    try:
        await staged.update(load_weights(tiny_model_b), global_steps=steps)
        expected_b = await greedy(engine, "staged-b")
        await staged.update(load_weights(tiny_model_a), global_steps=steps + 1)
    finally:
        await staged.aclose()
    assert expected_b != FRESH_GREEDY["a"] and expected_b == FRESH_GREEDY.get("b", expected_b)
    steps += 2
    remote.call_times.clear()
    report = await broadcaster.update(load_weights(tiny_model_b), global_steps=steps)
    # The push's verdict told the actor every rank took it: it labelled the push as its
    # receive ended, and the label cost no round trip of its own.
    assert "take_update" in remote.call_times and "weights.commit" not in remote.call_times
    assert (await remote.remote_statistics()).global_steps == steps
    assert set(report.deliveries) == {remote.name, engine.name}
    assert all(d.tensors == len(load_weights(tiny_model_b)) for d in report.deliveries.values())
    assert report.push is not None and report.push.receivers == 2
    assert await greedy(remote, "bc-b") == expected_b  # type: ignore[arg-type]
    assert await greedy(engine, "bc-b-local") == expected_b
    assert remote.global_steps == engine.global_steps == steps
    await broadcaster.update(load_weights(tiny_model_a), global_steps=steps + 1)
    assert await greedy(remote, "bc-a") == FRESH_GREEDY["a"]  # type: ignore[arg-type]
    assert await greedy(engine, "bc-a-local") == FRESH_GREEDY["a"]


@pytest.mark.parametrize("check", UPDATE_CHECKS)
async def test_broadcast_pushes_keep_the_update_contract(
    remote: RayEngine, tiny_model_a: Path, check: str
) -> None:
    pusher = WeightPusher([remote], backend="broadcast", bucket_bytes=256 << 10)
    try:
        await UPDATE_CHECKS[check](remote, pusher, load_weights(tiny_model_a))
    finally:
        await pusher.aclose()
    assert await greedy(remote, f"bc-after-{check}") == FRESH_GREEDY["a"]  # type: ignore[arg-type]


async def test_a_worker_failing_a_broadcast_push_rolls_every_engine_back(
    remote: RayEngine, engine: VLLMEngine, broadcaster: WeightPusher, tiny_model_a: Path,
    tiny_model_b: Path,
) -> None:
    from asyncroll import WeightSyncError
    from asyncroll.testing.faults import inject_fault

    versions = (remote.global_steps, engine.global_steps)
    steps = max(v or 0 for v in versions)
    async with inject_fault(engine, "load", tensor="model.norm.weight"):
        with pytest.raises(WeightSyncError, match="previous weights") as failed:
            await broadcaster.update(load_weights(tiny_model_b), global_steps=steps + 1)
    # The failing engine's own error is the one raised (it names the tensor), not the
    # sender's "failed in 1 of 2 receivers"; the Ray engine, whose part went well, learned
    # from the push's verdict that it failed, and did not label it.
    assert "model.norm.weight" in str(failed.value)
    assert (remote.global_steps, engine.global_steps) == versions  # no label moved
    assert (await remote.remote_statistics()).global_steps == versions[0]
    assert await greedy(remote, "bc-failed") == FRESH_GREEDY["a"]  # type: ignore[arg-type]
    assert await greedy(engine, "bc-failed-local") == FRESH_GREEDY["a"]
    await broadcaster.update(load_weights(tiny_model_a), global_steps=steps + 1)  # goes on
    assert remote.global_steps == engine.global_steps == steps + 1


@retry_if_late
async def test_a_killed_actor_is_dead_and_its_requests_finish_locally(
    remote: RayEngine, engine: VLLMEngine
) -> None:
    """Last in the module: it kills the actor."""
    async with AsyncServerManager([remote, engine]) as manager:  # type: ignore[list-item]
        calls = [asyncio.ensure_future(manager.generate(
            f"kill-{i}", prompt_ids=[7, i + 2], sampling_params={**PARAMS, "max_tokens": 200},
            session_key=f"kill-{i}")) for i in range(4)]
        while remote.statistics().in_flight < 1:  # noqa: ASYNC110 - a call reaches the actor
            await asyncio.sleep(0.005)
        # Frozen in the actor (calls still on their way wait at its gate): none can end there
        # while Ray takes its time to kill it, on cores its processes share with the engines.
        await remote.pause("keep")
        if not remote.statistics().in_flight:  # each call there had ended before the pause
            await remote.resume()
            await asyncio.gather(*calls)
            raise LateAction("every call in the actor ran out its tokens before the pause")
        ray.kill(remote.actor)
        await remote.wait_dead()  # seen by the engine's watch, whatever the calls do
        assert remote.is_dead
        outputs = await asyncio.gather(*calls)
        assert all(len(o.token_ids) == 200 and o.finish_reason == "length" for o in outputs)
        # Each ends locally, but one that had ended in the actor before its pause.
        assert all(o.engines[-1] == engine.name or o.engines == (remote.name,) for o in outputs)
        assert remote.is_dead and manager.statistics().num_engine_failovers >= 1
    with pytest.raises(EngineDeadError):
        await remote.generate("after-death", prompt_ids=[5], sampling_params=PARAMS)

