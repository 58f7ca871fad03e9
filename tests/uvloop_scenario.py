"""The manager's concurrency scenario on uvloop with a real engine (run as a subprocess by
tests/test_manager.py, since the suite's own event loop is asyncio's)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import uvloop
from engine_helpers import hold, until_decoding
from safetensors.torch import load_file

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.testing.contract import LateAction, ran_to_budget, retry_if_late


async def scenario(model: Path) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    weights = load_file(str(model / "model.safetensors"))
    async with VLLMEngine.launch(model, max_model_len=512, dtype="float32",
                                 skip_tokenizer_init=True, enforce_eager=True) as engine:
        for mode in ("abort", "keep"):
            async with AsyncServerManager([engine], resume_mode=mode) as manager:
                updates = await updates_across(manager, weights, mode)
                assert manager.statistics().in_flight == 0
            print(f"uvloop scenario ok ({mode}): {updates} updates, 16 requests complete")


@retry_if_late
async def updates_across(manager: AsyncServerManager, weights: Any, mode: str) -> int:
    params = {"max_tokens": 120, "ignore_eos": True}
    tasks = [
        asyncio.create_task(
            manager.generate(f"{mode}{i}", prompt_ids=[5, i + 2], sampling_params=params)
        )
        for i in range(16)
    ]
    await until_decoding(manager, tasks)
    await hold(manager)  # the first update lands mid-decode
    first = (manager.global_steps or 0) + 1
    await manager.update_weights(weights, global_steps=first)
    updates = 1
    pending = {task for task in tasks if not task.done()}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        if pending:
            steps = (manager.global_steps or 0) + 1
            await manager.update_weights(weights, global_steps=steps)
            updates += 1
    outputs = [task.result() for task in tasks]
    if all(ran_to_budget(o, 120, update=first) for o in outputs):
        raise LateAction("every request ran out its 120 tokens before the first update")
    assert all(len(o.token_ids) == len(o.global_steps) == 120 for o in outputs)
    assert all(list(o.global_steps) == sorted(o.global_steps) for o in outputs)  # type: ignore[type-var]
    assert any(o.min_global_steps != o.max_global_steps for o in outputs)
    assert any(o.num_preempted for o in outputs) == (mode == "abort")
    return updates


if __name__ == "__main__":
    uvloop.run(scenario(Path(sys.argv[1])))
