"""What the gateway's tokenizer-bound features cost a vLLM CPU engine: its start with the
tokenizer, and per token, detokenizing (stop strings) and a grammar (structured outputs).

Engines start alternately without and with the tokenizer (``--starts`` each); on the last one
with it, the same batch of requests (``--requests`` at once, ``--tokens`` each, the tiny model,
``ignore_eos``) runs plain, with a stop string that never matches (vLLM then detokenizes every
token), and under a JSON grammar (``json_object``), alternately ``--repeats`` times; the report
gives the median time per generated token of each and the difference to plain.

    .venv/bin/python bench/gateway_tokenizer_cost.py [--starts 2] [--requests 32] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncroll import VLLMEngine
from asyncroll.testing import make_tiny_model

KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "stop string": {"stop": ["\u00a7never\u00a7"]},
    "json grammar": {"structured_outputs": {"json_object": True}},
}


async def _start(model: Path, *, tokenizer: bool) -> tuple[VLLMEngine, float]:
    started = time.perf_counter()
    engine = await VLLMEngine.start(model, max_model_len=512, dtype="float32",
                                    skip_tokenizer_init=not tokenizer)
    return engine, time.perf_counter() - started


async def _batch(engine: VLLMEngine, args: argparse.Namespace, extra: dict[str, Any],
                 tag: str) -> float:
    params = {"max_tokens": args.tokens, "temperature": 1.0, "ignore_eos": True, **extra}
    started = time.perf_counter()
    outputs = await asyncio.gather(*(
        engine.generate(f"{tag}-{i}", prompt_ids=[5, 6, 7, i % 100 + 9], sampling_params=params)
        for i in range(args.requests)))
    seconds = time.perf_counter() - started
    return seconds / sum(len(output.token_ids) for output in outputs)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    starts: dict[str, list[float]] = {"without": [], "with": []}
    per_token: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "m", seed=0)
        for round_ in range(args.starts):
            engine, seconds = await _start(model, tokenizer=False)
            starts["without"].append(seconds)
            await engine.aclose()
            engine, seconds = await _start(model, tokenizer=True)
            starts["with"].append(seconds)
            if round_ < args.starts - 1:
                await engine.aclose()
        try:
            await _batch(engine, args, {}, "warm")
            for repeat in range(args.repeats):
                for kind, extra in KINDS.items():
                    per_token[kind].append(await _batch(engine, args, extra, f"{kind}{repeat}"))
        finally:
            await engine.aclose()
    us = {kind: statistics.median(values) * 1e6 for kind, values in per_token.items()}
    return {"start_s": starts, "us_per_token": us,
            "us_per_token_over_plain": {k: v - us["plain"] for k, v in us.items()},
            "requests": args.requests, "tokens": args.tokens, "repeats": args.repeats}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the result here")
    arguments = parser.parse_args()
    result = asyncio.run(main(arguments))
    for which, seconds in result["start_s"].items():
        print(f"engine start {which} tokenizer: " + ", ".join(f"{s:.1f} s" for s in seconds))
    for kind, us in result["us_per_token"].items():
        print(f"{kind:>12}: {us:7.1f} us/token "
              f"({result['us_per_token_over_plain'][kind]:+.1f} over plain)")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(result, indent=2) + "\n")
