"""An update cancelled anywhere leaves the manager's version equal to what its engines serve."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncroll import AsyncServerManager, InvalidRequestError
from asyncroll.testing import FakeEngine
from asyncroll.testing.fake_engine import FakeWeightUpdater


@pytest.mark.parametrize("where", ["weights.commit", "resume"])
async def test_an_update_cancelled_after_the_label_publishes_it(where: str) -> None:
    """The engines take the new label shielded from cancellation; a caller cancelled there (or
    later, in the resume) used to leave the manager one version behind its engines."""
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    manager = AsyncServerManager(engines, weights=FakeWeightUpdater(engines))
    update: asyncio.Task[object] | None = None
    owner: object = engines[1].weights if where == "weights.commit" else engines[1]
    where = where.removeprefix("weights.")
    real = getattr(owner, where)
    calls = 0

    async def cancelling(*args: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1 and update is not None:
            update.cancel()  # the caller goes while this engine's step is under way
        await real(*args)

    setattr(owner, where, cancelling)
    async with manager:
        await manager.update_weights([], global_steps=1)
        calls = 0
        update = asyncio.create_task(manager.update_weights([], global_steps=2))
        with pytest.raises(asyncio.CancelledError):
            await update
        assert [e.global_steps for e in engines] == [2, 2]
        assert not any(e.statistics().paused for e in engines)  # resumed, cancelled or not
        assert manager.global_steps == 2
        assert manager.statistics().num_updates == 2
        out = await manager.generate("after", prompt_ids=[5, 6], sampling_params={"max_tokens": 3})
        assert out.global_steps == (2, 2, 2)


async def test_an_update_cancelled_before_the_label_keeps_the_old_version() -> None:
    engines = [FakeEngine(name="a")]
    hold, paused = asyncio.Event(), asyncio.Event()
    manager = AsyncServerManager(engines, weights=FakeWeightUpdater(engines, hold=hold))
    real_pause = engines[0].pause

    async def pause(*args: object, **kwargs: object) -> None:
        await real_pause(*args, **kwargs)  # type: ignore[arg-type]
        paused.set()

    engines[0].pause = pause  # type: ignore[method-assign]
    async with manager:
        update = asyncio.create_task(manager.update_weights([], global_steps=3))
        await paused.wait()  # the push waits for ``hold``: cancel it there
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        assert manager.global_steps == engines[0].global_steps == 0
        assert manager.statistics().num_updates == 0


async def test_a_refused_update_is_not_counted_even_at_the_published_version() -> None:
    engines = [FakeEngine(name="a")]
    async with AsyncServerManager(engines, weights=FakeWeightUpdater(engines)) as manager:
        await manager.update_weights([], global_steps=1)
        for bad in ([("w", "not a tensor")], [("w", torch.empty(2, device="meta"))]):
            with pytest.raises(InvalidRequestError):
                await manager.update_weights(bad, global_steps=1)  # type: ignore[arg-type]
        assert manager.statistics().num_updates == 1 and manager.global_steps == 1


@pytest.mark.parametrize("mode", ["inflight", "inflight-recompute", "keep"])
async def test_calls_wait_for_a_pausing_update_and_not_for_an_inflight_one(mode: str) -> None:
    """A call made while an update is out waits at the manager's gate for the new weights,
    except in the inflight modes, where the engines never stop and the call runs at once."""
    engines = [FakeEngine(name="a")]
    hold = asyncio.Event()
    updater = FakeWeightUpdater(engines, hold=hold)
    async with AsyncServerManager(engines, weights=updater, resume_mode=mode) as manager:  # type: ignore[arg-type]
        update = asyncio.create_task(manager.update_weights({}, global_steps=1))
        for _ in range(20):  # loop turns, not time: the update reaches its push
            await asyncio.sleep(0)
        assert updater.is_holding
        call = asyncio.create_task(
            manager.generate("during", prompt_ids=[1], sampling_params={"max_tokens": 3}))
        for _ in range(20):
            await asyncio.sleep(0)
        inflight = mode.startswith("inflight")
        assert call.done() is inflight
        assert engines[0].is_paused is not inflight
        hold.set()
        await update
        output = await call
        if inflight:
            assert output.global_steps == (0, 0, 0)  # sampled before the commit
        else:
            assert output.global_steps == (1, 1, 1)
