"""Does an open LoRA landing thread cost a CPU engine throughput (the question
``bench/inflight_landed_cpu.py --idle-landing`` raised for full-weight landings)? Tokens/s of
192 long-tailed requests from 32 callers on one adapter, twice before the adapter's later
revisions land (its first one goes the step loop's way, and no landing thread is open yet),
then twice with the landing threads open after three landed revisions.

    .venv/bin/python bench/lora_landing_idle_cpu.py
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import rollout_throughput as rt

from asyncroll import AsyncServerManager, VLLMEngine
from asyncroll.adapters import AdapterConfig
from asyncroll.testing import make_tiny_model
from asyncroll.testing.lora import random_adapter
from asyncroll.testing.probes import PROBES_EXTENSION

CONFIG = AdapterConfig(rank=8, alpha=16)
_ids = itertools.count()


async def speed(manager: AsyncServerManager, jobs: list[tuple[list[int], int]]) -> float:
    """Tokens a second of ``jobs`` on adapter ``a``, 32 callers."""
    queue = list(jobs)
    tokens = 0

    async def caller() -> None:
        nonlocal tokens
        while queue:
            prompt, n = queue.pop()
            out = await manager.generate(
                f"idle-{next(_ids)}", prompt_ids=prompt, adapter="a",
                sampling_params={"max_tokens": n, "ignore_eos": True})
            tokens += len(out.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(32)))
    return tokens / (time.perf_counter() - started)


async def main() -> None:
    jobs = rt.workload(192)
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "m", seed=0, init_std=0.2)
        async with VLLMEngine.launch(
            model, max_model_len=512, skip_tokenizer_init=True, enable_lora=True,
            max_lora_rank=8, max_loras=4, max_cpu_loras=4,
            worker_extension_cls=PROBES_EXTENSION,
        ) as engine, AsyncServerManager([engine]) as manager:
            def revision(seed: int) -> dict[str, object]:
                return random_adapter(model, CONFIG, seed=seed, scale=0.5)

            await manager.update_adapter("a", revision(1), config=CONFIG, global_steps=1)
            before = [round(await speed(manager, jobs)) for _ in range(2)]
            for step in range(2, 5):
                await manager.update_adapter("a", revision(step), config=CONFIG,
                                             global_steps=step)
            after = [round(await speed(manager, jobs)) for _ in range(2)]
    print(f"tokens/s before any landing thread {before}, with the landing threads open {after}")


if __name__ == "__main__":
    asyncio.run(main())
