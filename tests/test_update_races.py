"""An update cancelled anywhere leaves the manager's version equal to what its engines serve."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncroll import AsyncServerManager, InvalidRequestError
from asyncroll.testing import FakeEngine
from asyncroll.testing.fake_engine import FakeWeightUpdater


@pytest.mark.parametrize("where", ["commit_version", "reset_prefix_cache", "resume"])
async def test_an_update_cancelled_after_the_label_publishes_it(where: str) -> None:
    """The engines take the new label shielded from cancellation; a caller cancelled there (or
    later, in the resume) used to leave the manager one version behind its engines."""
    engines = [FakeEngine(name="a"), FakeEngine(name="b")]
    manager = AsyncServerManager(engines, weights=FakeWeightUpdater(engines))
    update: asyncio.Task[object] | None = None
    real = getattr(engines[1], where)
    calls = 0

    async def cancelling(*args: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1 and update is not None:
            update.cancel()  # the caller goes while this engine's step is under way
        await real(*args)

    setattr(engines[1], where, cancelling)
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
