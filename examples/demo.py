"""Placeholder demo: start a real vLLM engine on a tiny local model and generate.

The recipes issue replaces this with a real fully-async training run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import uvloop

from asyncroll import VLLMEngine
from asyncroll.testing import make_tiny_model


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(folder, seed=0)
        print("starting a vLLM CPU engine on a tiny random model (20-40 s)...", flush=True)
        async with VLLMEngine.launch(model, max_model_len=512) as engine:
            start = time.perf_counter()
            segments = await asyncio.gather(
                *(
                    engine.generate(
                        f"demo-{i}",
                        prompt_ids=[2 + i, 3, 4],
                        sampling_params={"max_tokens": 32, "ignore_eos": True},
                    )
                    for i in range(8)
                )
            )
            elapsed = time.perf_counter() - start
            for segment in segments:
                print(segment.request_id, segment.token_ids[:8], "...", segment.finish_reason)
            tokens = sum(len(s.token_ids) for s in segments)
            print(f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tokens/s)")
            print(engine.statistics())


if __name__ == "__main__":
    uvloop.run(main())
