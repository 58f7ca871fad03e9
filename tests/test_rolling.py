"""Rolling updates (``AsyncServerManager(rolling=k)``): engines updated group after group while
the others serve, on fake engines (the routing and the versions; a real engine's: the last
test, and ``tests/test_inflight.py`` for the commit itself)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import load_weights

from asyncroll import (
    AsyncServerManager,
    InvalidRequestError,
    ManagerClosedError,
    VLLMEngine,
    WeightSyncError,
)
from asyncroll.interfaces import Engine, ResumeMode
from asyncroll.testing import FakeEngine
from asyncroll.testing.fake_engine import FakeWeightUpdater

PARAMS = {"max_tokens": 3}


class Groups:
    """One ``FakeWeightUpdater`` a group, each held mid-push until released."""

    def __init__(self) -> None:
        self.updaters: dict[str, FakeWeightUpdater] = {}
        self.holds: dict[str, asyncio.Event] = {}

    def __call__(self, group: list[Engine]) -> FakeWeightUpdater:
        name = group[0].name
        self.holds[name] = asyncio.Event()
        fakes = [e for e in group if isinstance(e, FakeEngine)]
        self.updaters[name] = FakeWeightUpdater(fakes, hold=self.holds[name])
        return self.updaters[name]

    async def until_holding(self, name: str) -> None:
        """Loop turns, not time, until the group of ``name`` is paused mid-push."""
        for _ in range(200):
            updater = self.updaters.get(name)
            if updater is not None and updater.is_holding:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"the update of {name} never reached its push")

    async def let_through(self, *names: str) -> None:
        """Each named group in turn: wait until its update holds mid-push, then release it."""
        for name in names:
            await self.until_holding(name)
            self.holds[name].set()


@contextlib.asynccontextmanager
async def rolling_manager(
    names: str, mode: ResumeMode, **engine_args: Any
) -> AsyncIterator[tuple[list[FakeEngine], Groups, AsyncServerManager]]:
    """A manager over one fake engine a name, updating one at a time through ``Groups``."""
    engines = [FakeEngine(name=name, **engine_args) for name in names]
    groups = Groups()
    async with AsyncServerManager(engines, resume_mode=mode, weights=groups,
                                  rolling=1) as manager:
        yield engines, groups, manager


def skew(engines: Sequence[FakeEngine]) -> int:
    versions = [e.global_steps or 0 for e in engines]
    return max(versions) - min(versions)


async def test_a_rolling_update_serves_throughout_and_sends_new_calls_to_updated_engines() -> None:
    """Three engines, one at a time: a call made while an engine is paused goes to another
    and ends before the update does; once an engine has the new weights, new calls go there;
    the versions never differ by more than one; the version is published at the end."""
    async with rolling_manager("abc", "keep") as (
        engines, groups, manager
    ):
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.until_holding("a")
        assert engines[0].is_paused and not engines[1].is_paused
        first = await manager.generate("during-a", prompt_ids=[1], sampling_params=PARAMS)
        assert first.engines[0] != "a" and first.global_steps == (0, 0, 0)
        assert manager.global_steps == 0 and manager.statistics().updating
        groups.holds["a"].set()
        await groups.until_holding("b")
        assert skew(engines) == 1
        calls = [
            await manager.generate(f"during-b-{i}", prompt_ids=[1], sampling_params=PARAMS)
            for i in range(3)
        ]
        assert {c.engines for c in calls} == {("a",)}  # the one engine with the new weights
        assert all(c.global_steps == (1, 1, 1) for c in calls)
        groups.holds["b"].set()
        await groups.until_holding("c")
        assert skew(engines) == 1
        groups.holds["c"].set()
        report = await update
        assert manager.global_steps == 1 and [e.global_steps for e in engines] == [1, 1, 1]
        assert len(report.group_seconds) == 3 and report.engines == 3
        assert report.seconds >= max(report.group_seconds)
        assert not manager.statistics().updating
        assert not update.cancelled() and not any(e.is_paused for e in engines)


async def test_a_failed_group_stops_the_roll_and_the_next_update_starts_with_the_laggards() -> None:
    """The second group's push fails: the first keeps the new weights, the rest the old ones,
    the manager publishes nothing; the next update updates the engines behind first."""
    async with rolling_manager("abc", "abort") as (
        engines, groups, manager
    ):
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.let_through("a")
        await groups.until_holding("b")
        groups.updaters["b"].failures = 1
        groups.holds["b"].set()
        with pytest.raises(WeightSyncError, match=r"\['b'\] failed.*\['a'\] took it"):
            await update
        assert [e.global_steps for e in engines] == [1, 0, 0] and manager.global_steps == 0
        assert manager.statistics().num_failed_updates == 1
        for hold in groups.holds.values():
            hold.clear()
        update = asyncio.create_task(manager.update_weights([], global_steps=2))
        for name in "bca":  # the engines behind first
            await groups.until_holding(name)
            assert [e.name for e in engines if e.is_paused] == [name]
            groups.holds[name].set()
        await update
        assert [e.global_steps for e in engines] == [2, 2, 2] and manager.global_steps == 2


async def test_an_aborted_call_resumes_on_an_engine_that_is_not_paused() -> None:
    """``abort``: a call on the engine its group pauses ends there and resumes on another,
    never on one behind the weights it has tokens from."""
    async with rolling_manager("ab", "abort", token_delay=0.001, max_model_len=8192) as (
        _, groups, manager
    ):
        call = asyncio.create_task(manager.generate(  # to a: the first of two idle engines
            "long", prompt_ids=[1], sampling_params={"max_tokens": 500}))
        for _ in range(5):
            await asyncio.sleep(0)
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.until_holding("a")
        output = await call  # resumed on b while a is paused
        assert output.engines == ("a", "b") and len(output.token_ids) == 500
        assert set(output.global_steps) == {0}
        groups.holds["a"].set()
        await groups.let_through("b")
        await update


async def test_a_version_below_an_engine_ahead_is_refused_before_any_group_pauses() -> None:
    """A failed roll leaves an engine ahead of the published version; an update to a version
    below it is refused before anything pauses, not after the other groups took it."""
    async with rolling_manager("abc", "keep") as (
        engines, groups, manager
    ):
        engines[0]._global_steps = 2  # as a roll that failed after a's group leaves it
        with pytest.raises(InvalidRequestError, match="lower than a's 2"):
            await manager.update_weights([], global_steps=1)
        assert groups.updaters == {} and [e.global_steps for e in engines] == [2, 0, 0]


async def test_tensors_the_first_group_refuses_are_an_invalid_request_and_pause_nothing() -> None:
    """The channel's checks (names, shapes, dtypes) refuse the update in the first group,
    before it pauses: the caller gets ``InvalidRequestError``, not a failed roll."""

    async def refuse(tensors: object) -> None:
        raise InvalidRequestError("'w' has shape (2,), the engine's is (3,)")

    class Refusing(Groups):
        def __call__(self, group: list[Engine]) -> FakeWeightUpdater:
            updater = super().__call__(group)
            updater.channel.check = refuse  # type: ignore[method-assign]
            return updater

    engines = [FakeEngine(name=n) for n in "ab"]
    async with AsyncServerManager(engines, resume_mode="keep", weights=Refusing(),
                                  rolling=1) as manager:
        with pytest.raises(InvalidRequestError, match="shape"):
            await manager.update_weights([], global_steps=1)
        assert manager.statistics().num_failed_updates == 0
        assert [e.global_steps for e in engines] == [0, 0] and not any(e.is_paused for e in engines)


async def test_a_dead_group_is_skipped_and_the_live_engines_publish() -> None:
    async with rolling_manager("abc", "keep") as (
        engines, groups, manager
    ):
        engines[2].kill()
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.let_through("a", "b")
        report = await update
        assert "c" not in groups.updaters and len(report.group_seconds) == 2
        assert manager.global_steps == 1


async def test_a_manager_closed_mid_roll_makes_no_updater_after_its_close() -> None:
    engines = [FakeEngine(name=n) for n in "ab"]
    groups = Groups()
    manager = AsyncServerManager(engines, resume_mode="keep", weights=groups, rolling=1)
    update = asyncio.create_task(manager.update_weights([], global_steps=1))
    await groups.until_holding("a")
    await manager.aclose()
    groups.holds["a"].set()
    with pytest.raises(ManagerClosedError):
        await update
    assert "b" not in groups.updaters and not any(e.is_paused for e in engines)


async def test_an_engine_added_mid_roll_holds_the_version_back_until_it_has_it() -> None:
    async with rolling_manager("ab", "keep") as (
        _, groups, manager
    ):
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.until_holding("a")
        manager.add_engine(FakeEngine(name="late"))
        groups.holds["a"].set()
        await groups.let_through("b")
        await update
        assert manager.global_steps == 0  # "late" serves version 0
        for hold in groups.holds.values():
            hold.clear()
        update = asyncio.create_task(manager.update_weights([], global_steps=2))
        await groups.let_through("late", "a", "b")  # the engine behind first
        await update
        assert manager.global_steps == 2


async def test_a_call_that_only_a_paused_engine_can_serve_waits_for_it() -> None:
    """A resumed call whose tokens came from the new weights of an engine that died; the only
    other engine is paused mid-update: routing waits for it (not NoEngineAvailableError)."""
    async with rolling_manager("ab", "abort") as (
        engines, groups, manager
    ):
        update = asyncio.create_task(manager.update_weights([], global_steps=1))
        await groups.let_through("a")
        await groups.until_holding("b")
        engines[0].kill()
        route = asyncio.create_task(manager._route_when_able(None, 0, floor=1))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not route.done()  # b has not got version 1 yet
        groups.holds["b"].set()
        await update
        assert await route == 1


@pytest.mark.parametrize("rolling", [-1, True, 1.5])
async def test_a_bad_rolling_is_refused(rolling: object) -> None:
    with pytest.raises(InvalidRequestError, match="rolling"):
        AsyncServerManager([FakeEngine()], rolling=rolling)  # type: ignore[arg-type]


async def test_rolling_needs_a_function_that_makes_an_updater_for_a_group() -> None:
    engines = [FakeEngine(), FakeEngine()]
    with pytest.raises(InvalidRequestError, match="function"):
        AsyncServerManager(engines, weights=FakeWeightUpdater(engines), rolling=1)
    with pytest.raises(InvalidRequestError, match="rolling"):
        AsyncServerManager(engines, weights=Groups())  # type: ignore[arg-type]


@pytest.mark.engine
async def test_a_rolling_update_of_two_real_engines_labels_every_token(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path
) -> None:
    """Two vLLM engines, one at a time in ``keep``: calls made before and during the roll all
    finish, none aborted, every token labelled with a version its engine had; both engines
    end on the new weights (each engine's greedy output after the roll is the same)."""
    weights = load_weights(tiny_model_a)
    steps = max(engine.global_steps or 0, engine_b.global_steps or 0) + 1
    try:
        await _roll(engine, engine_b, weights, steps)
    finally:  # each engine back on its own model, as the shared fixtures expect
        await _restore(engine_b, tiny_model_b, steps + 1)


async def _roll(
    engine: VLLMEngine, engine_b: VLLMEngine, weights: dict[str, torch.Tensor], steps: int
) -> None:
    params = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    async with AsyncServerManager([engine, engine_b], resume_mode="keep", rolling=1) as manager:
        before = [asyncio.create_task(manager.generate(f"roll-{steps}-{i}", prompt_ids=[3, i],
                                                       sampling_params=params))
                  for i in range(4)]
        update = asyncio.create_task(manager.update_weights(weights, global_steps=steps))
        during = [asyncio.create_task(manager.generate(f"roll-during-{steps}-{i}",
                                                       prompt_ids=[4, i], sampling_params=params))
                  for i in range(4)]
        report = await update
        outputs = await asyncio.gather(*before, *during)
        assert len(report.group_seconds) == 2 and manager.global_steps == steps
        assert engine.global_steps == engine_b.global_steps == steps
        for output in outputs:
            assert len(output.token_ids) == 64 and output.finish_reason == "length"
            assert list(output.global_steps) == sorted(output.global_steps)
        probes = [await e.generate(f"roll-probe-{steps}-{e.name}", prompt_ids=[2, 3],
                                   sampling_params={**params, "max_tokens": 8})
                  for e in (engine, engine_b)]
        assert probes[0].token_ids == probes[1].token_ids
        assert manager.statistics().num_preempted == 0  # keep: none aborted, none resubmitted


async def _restore(engine: VLLMEngine, model: Path, steps: int) -> None:
    from asyncroll.weights import WeightPusher

    pusher = WeightPusher([engine])
    try:
        await pusher.update(load_weights(model), global_steps=steps)
    finally:
        await pusher.aclose()


@pytest.mark.engine
async def test_an_inflight_roll_over_two_transports_splits_every_call_at_one_boundary(
    engine: VLLMEngine, engine_b: VLLMEngine, tiny_model_a: Path, tiny_model_b: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine on the trainer's device and one on another device, each group with its own
    pusher: staged IPC, and the broadcast transport that reaches another GPU (gloo here,
    NCCL there). In ``inflight`` nothing pauses and nothing is aborted: each call's tokens
    carry versions its engine had, in order, split at one boundary at most; no engine is
    ever two versions from the other; both end on the new weights. The tensors are read
    for NaN and inf once, by the first group's check, not again by each group's."""
    from asyncroll import weights as weights_module
    from asyncroll.weights import WeightPusher

    if torch.cuda.is_available():  # NCCL refuses two ranks on one GPU; on the GPU it is the
        pytest.skip("shared engines share the trainer's GPU")  # rollout bench's --rollout-gpus
    steps = max(engine.global_steps or 0, engine_b.global_steps or 0) + 1
    before = {engine.global_steps, engine_b.global_steps}
    skews: list[int] = []

    class Recorded:
        """A group's pusher, the two engines' versions read as each group begins and ends."""

        def __init__(self, pusher: WeightPusher) -> None:
            self.pusher = pusher

        async def update(self, *args: Any, prechecked: bool = False, **kwargs: Any) -> Any:
            skews.append(abs((engine.global_steps or 0) - (engine_b.global_steps or 0)))
            try:
                return await self.pusher.update(*args, prechecked=prechecked, **kwargs)
            finally:
                skews.append(abs((engine.global_steps or 0) - (engine_b.global_steps or 0)))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.pusher, name)

    pushers = {engine.name: WeightPusher([engine]),
               engine_b.name: WeightPusher([engine_b], backend="broadcast",
                                           bucket_bytes=256 << 10)}
    params = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    checks: list[bool] = []  # each group's check of the tensors: read for NaN and inf?
    check_update = weights_module.check_update

    def counted(*args: Any, **kwargs: Any) -> None:
        checks.append(kwargs["check_finite"])
        check_update(*args, **kwargs)

    monkeypatch.setattr(weights_module, "check_update", counted)
    try:
        async with AsyncServerManager(
            [engine, engine_b], resume_mode="inflight", rolling=1,
            weights=lambda group: Recorded(pushers[group[0].name]),
        ) as manager:
            calls = [asyncio.create_task(manager.generate(
                f"roll-2t-{steps}-{i}", prompt_ids=[3, i], sampling_params=params))
                for i in range(6)]
            report = await manager.update_weights(load_weights(tiny_model_a),
                                                  global_steps=steps)
            outputs = await asyncio.gather(*calls)
            assert manager.statistics().num_preempted == 0  # inflight: none aborted
        assert len(report.group_seconds) == 2 and len(skews) == 4 and max(skews) <= 1
        assert checks == [True, False]  # every byte read once a roll, by the first group
        assert engine.global_steps == engine_b.global_steps == steps
        for output in outputs:
            assert len(output.token_ids) == 48 and output.finish_reason == "length"
            versions = list(output.global_steps)
            assert versions == sorted(versions) and set(versions) <= before | {steps}
            assert len(set(versions)) <= 2
        probes = [await e.generate(f"roll-2t-probe-{steps}-{e.name}", prompt_ids=[2, 3],
                                   sampling_params={**params, "max_tokens": 8})
                  for e in (engine, engine_b)]
        assert probes[0].token_ids == probes[1].token_ids  # both on model A
    finally:
        monkeypatch.undo()
        for pusher in pushers.values():
            await pusher.aclose()
        await _restore(engine_b, tiny_model_b, steps + 1)


async def test_the_groups_after_one_that_read_the_values_are_told_so() -> None:
    """``prechecked=True`` reaches a group's updater only once an earlier group's read the
    tensors for NaN and inf (``values_read``), and only an updater that names it: never one
    of one's own passing ``**kwargs`` on (what it passes them to may not take it)."""
    seen: list[tuple[str, object]] = []

    class Named(FakeWeightUpdater):
        async def update(self, *args: Any, prechecked: bool = False, **kwargs: Any) -> Any:
            seen.append((self.engines[0].name, prechecked))
            report = await super().update(*args, prechecked=prechecked, **kwargs)
            self.values_read = self.engines[0].name == "b"  # (b's channel reads them)
            return report

    class Forwarding:
        def __init__(self, inner: FakeWeightUpdater) -> None:
            self.inner = inner

        async def update(self, *args: Any, **kwargs: Any) -> Any:
            seen.append((self.inner.engines[0].name, kwargs.get("prechecked", "not passed")))
            return await self.inner.update(*args, **kwargs)

        async def aclose(self) -> None:
            await self.inner.aclose()

    engines = [FakeEngine(name=name) for name in "abcd"]

    def updater(group: list[Engine]) -> Any:
        fakes = [e for e in group if isinstance(e, FakeEngine)]
        return Forwarding(FakeWeightUpdater(fakes)) if group[0].name == "d" else Named(fakes)

    async with AsyncServerManager(engines, resume_mode="keep", weights=updater,
                                  rolling=1) as manager:
        await manager.update_weights({"w": torch.zeros(2)}, global_steps=1)
    assert seen == [("a", False), ("b", False), ("c", True), ("d", "not passed")]
    assert [e.global_steps for e in engines] == [1, 1, 1, 1]


async def test_an_updater_that_cannot_be_made_fails_the_roll_and_frees_its_engines() -> None:
    """The function making a group's updater raising mid-roll: a ``WeightSyncError`` naming
    the group, the groups before keep what they took, and no engine is left marked as
    updating (calls still reach it)."""
    engines = [FakeEngine(name=name) for name in "ab"]

    def updater(group: list[Engine]) -> Any:
        if group[0].name == "b":
            raise RuntimeError("no way to reach b")
        return FakeWeightUpdater([e for e in group if isinstance(e, FakeEngine)])

    async with AsyncServerManager(engines, resume_mode="keep", weights=updater,
                                  rolling=1) as manager:
        with pytest.raises(WeightSyncError, match="no way to reach b"):
            await manager.update_weights({"w": torch.zeros(2)}, global_steps=1)
        assert [e.global_steps for e in engines] == [1, 0]
        assert not manager.statistics().updating
        assert manager.statistics().num_failed_updates == 1
        for i in range(4):  # both engines take calls again
            await manager.generate(f"after-{i}", prompt_ids=[1], sampling_params=PARAMS)
        assert all(e.statistics().num_requests for e in engines)
