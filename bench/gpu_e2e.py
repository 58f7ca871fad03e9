"""asyncroll on CUDA vLLM: correctness, hybrid mode, the manager under load, and push benchmarks.

Runs on one GPU with vLLM (0.24 on the lent H100; see docs/gpu.md for carrying it there). Each
section prints what it checked and measured, and appends its results to ``OUT/gpu_e2e.json``;
a failed check is reported, the other sections still run, and the exit status is 1.

Sections (``--sections``, comma-separated; default all):

- ``correctness``: an engine started on tiny model A takes the weights of model B (other seed)
  through the ``cuda_ipc`` transport and vLLM's native protocol; greedy outputs equal a fresh
  engine started on B, then A's again after pushing A back; tokens after an update carry its
  ``global_steps``; a request in flight across a ``keep``-mode update has per-token labels whose
  switch point is checked against the new weights' own continuation; a receiver-side failure
  leaves the old weights serving.
- ``hybrid``: ``sleep(1)`` frees the engine's memory (``torch.cuda.mem_get_info``), a training
  step runs on the freed GPU, a push while asleep is refused, ``wake_up(["weights"])``, push,
  ``wake_up(["kv_cache", "scheduling"])``, the engine serves exactly the trained weights.
- ``manager``: 256 concurrent requests across repeated updates, ``abort`` and ``keep`` modes:
  exact lengths, per-token ``global_steps`` that never decrease, outputs spanning versions.
- ``push``: random-weight models of Qwen2.5 shapes (``--sizes`` 0.5b, 1.5b, 7b), or of any
  shape of ``asyncroll.testing.tiny_model.SHAPES`` (``qwen3-30b-a3b``: 128 experts a layer,
  pushed into vLLM's fused expert parameters, checked in place), loaded with
  ``load_format="dummy"``; the same trainer tensors pushed by asyncroll (double-buffered
  ``cuda_ipc``) and by vLLM's built-in ``ipc`` backend (packed and unpacked), against the
  two-copy limit from a measured device copy. Stages: pack, wait (sender), load (worker).
- ``rollout``: rollout tokens/s on the 0.5b shape with updates every 2 s: none / abort / keep /
  drain (bench/rollout_throughput.py's workload and policies, 256 concurrent callers).

    python bench/gpu_e2e.py --out /tmp/out --sections correctness,hybrid,manager
    python bench/gpu_e2e.py --out /tmp/out --sections push,rollout --sizes 0.5b,1.5b
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch
import uvloop
from _timeline import render as render_timeline
from _timeline import summarize as summarize_timeline
from safetensors.torch import load_file

from asyncroll import (
    AsyncServerManager,
    EngineSleepingError,
    VLLMEngine,
    WeightPusher,
    WeightSyncError,
    frozen_heap,
)
from asyncroll.testing import make_tiny_model, vllm_client
from asyncroll.testing.faults import FAULTS_EXTENSION, inject_fault
from asyncroll.testing.probes import position_checksum
from asyncroll.testing.tiny_model import SHAPES as MODEL_SHAPES
from asyncroll.testing.tiny_model import checkpoint_shapes, write_model_config
from asyncroll.transport import CudaIpcBackend
from asyncroll.weights import SenderChannel

GiB = 1 << 30
FINISH_RPC = False
"""--finish-rpc: the workers finish an update in an RPC of its own (the A/B of 2026-11-28)."""
SKIP_BASELINE = False
"""``--skip-baseline``: no vLLM ipc baseline in the push section."""
SMALL = {  # GPU-friendly tiny model: head size 64, bf16
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {  # Qwen2.5 configs
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),
}
PROBES = [[5, 6, 7, 8], [100, 200, 300], [42] * 12, [7, 1, 7, 1, 7], [900, 17, 1500]]


def engine_args(**extra: Any) -> dict[str, Any]:
    """What every engine here starts with: no CUDA graphs (fast start), no async scheduling
    (docs/gpu.md: it stalled vLLM 0.24's start-up there), a modest share of the GPU."""
    return {"enforce_eager": True, "async_scheduling": False, "gpu_memory_utilization": 0.25,
            "max_model_len": 4096, "dtype": "bfloat16",
            "worker_extension_cls": FAULTS_EXTENSION, **extra}


def log(msg: str) -> None:
    print(msg, flush=True)


class Results:
    """Checks and measurements of one run, appended to OUT/gpu_e2e.json (or ``name``)."""

    def __init__(self, out: Path, name: str = "gpu_e2e.json") -> None:
        self.path = out / name
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.failed = 0

    def check(self, section: str, name: str, ok: bool, detail: Any = "") -> None:
        self.data.setdefault(section, {}).setdefault("checks", {})[name] = {
            "ok": bool(ok), "detail": detail}
        self.failed += not ok
        log(f"  [{'ok' if ok else 'FAILED'}] {section}: {name} {detail if not ok else ''}")

    def record(self, section: str, key: str, value: Any) -> None:
        self.data.setdefault(section, {})[key] = value
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


async def greedy(engine: VLLMEngine, tag: str, n: int = 32) -> list[tuple[int, ...]]:
    outs = []
    for i, prompt in enumerate(PROBES):
        seg = await engine.generate(f"{tag}-{i}", prompt_ids=prompt, sampling_params={
            "max_tokens": n, "temperature": 0.0, "ignore_eos": True})
        outs.append(seg.token_ids)
    return outs


def free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / GiB


def cuda_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in load_file(str(folder / "model.safetensors")).items()}


# -- correctness and hybrid mode on a small model ------------------------------------------------


async def correctness_and_hybrid(res: Results, work: Path, sections: set[str]) -> None:
    model_a = make_tiny_model(work / "a", seed=0, **SMALL)
    model_b = make_tiny_model(work / "b", seed=1, **SMALL)
    log("starting a fresh engine on model B (reference outputs)...")
    async with VLLMEngine.launch(model_b, name="fresh-b", **engine_args()) as fresh:
        fresh_b = await greedy(fresh, "fresh-b")
    weights_a, weights_b = cuda_weights(model_a), cuda_weights(model_b)
    log("starting the engine on model A (sleep mode on)...")
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(VLLMEngine.launch(
            model_a, name="a", enable_sleep_mode=True, **engine_args()
        ))
        # One pusher for the engine's updates, attached at its first and kept across them;
        # closed before the engine (the stack closes in reverse).
        pusher = WeightPusher([engine])
        stack.push_async_callback(pusher.aclose)
        res.record("env", "vllm", __import__("vllm").__version__)
        res.record("env", "native_versions", engine.native_versions)
        fresh_a = await greedy(engine, "fresh-a")
        res.check("correctness", "models differ", fresh_a != fresh_b)
        if "correctness" in sections:
            await _correctness(res, engine, pusher, weights_a, weights_b, fresh_a, fresh_b)
        if "hybrid" in sections:
            await _hybrid(res, engine, pusher, model_a, weights_b, fresh_b)
        if "manager" in sections:
            await _manager_load(res, engine, weights_a)


async def _correctness(
    res: Results, engine: VLLMEngine, pusher: WeightPusher, weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor], fresh_a: list[Any], fresh_b: list[Any],
) -> None:
    s = "correctness"
    report = await pusher.update(weights_b, global_steps=1)
    assert report.push is not None
    res.record(s, "tiny push", {"bytes": report.push.bytes, "buckets": report.push.buckets})
    res.check(s, "push B: greedy equals a fresh engine on B", await greedy(engine, "b") == fresh_b)
    res.record(s, "tiny update ms", {k: round(v * 1e3, 2) for k, v in asdict(report).items()
                                      if k.endswith("seconds") and isinstance(v, float)})
    await pusher.update(weights_a, global_steps=2)
    outs = await asyncio.gather(*(engine.generate(f"lab{i}", prompt_ids=p, sampling_params={
        "max_tokens": 16, "ignore_eos": True}) for i, p in enumerate(PROBES)))
    res.check(s, "push A back: greedy equals A's again", await greedy(engine, "a2") == fresh_a)
    res.check(s, "tokens after update(global_steps=2) are labelled 2",
              all(o.global_steps == (2,) * 16 for o in outs))
    # keep and recompute across an update to B: labels switch where B's weights took over;
    # recompute continues as B would from scratch, keep from the KV A computed (neither)
    steps = 2
    for mode in ("recompute", "keep"):
        prompt = [11, 12, 13]
        params = {"max_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
        long = asyncio.create_task(
            engine.generate(f"span-{mode}", prompt_ids=prompt, sampling_params=params))
        await asyncio.sleep(0.5)
        await pusher.update(weights_b, global_steps=steps + 1, mode=mode)
        seg = await long
        labels = seg.global_steps
        switch = labels.index(steps + 1) if steps + 1 in labels else -1
        res.check(s, f"{mode} mode: one output, labels {steps} then {steps + 1}",
                  len(seg.token_ids) == 3000 and 0 < switch < 3000
                  and labels == (steps,) * switch + (steps + 1,) * (3000 - switch),
                  f"switch at {switch}")
        if 0 < switch < 3000:
            head = list(prompt) + list(seg.token_ids[:switch])
            cont_b = (await engine.generate(f"cont-b-{mode}", prompt_ids=head, sampling_params={
                "max_tokens": 16, "temperature": 0.0, "ignore_eos": True})).token_ids
            await pusher.update(weights_a, global_steps=steps + 2)
            cont_a = (await engine.generate(f"cont-a-{mode}", prompt_ids=head, sampling_params={
                "max_tokens": 16, "temperature": 0.0, "ignore_eos": True})).token_ids
            after = seg.token_ids[switch:switch + 16]
            if mode == "recompute":
                res.check(s, "recompute mode: tokens from the switch are B's continuation, "
                          "not A's", after == cont_b and after != cont_a,
                          {"after": after, "B": cont_b, "A": cont_a})
            else:
                res.check(s, "keep mode: tokens from the switch are neither A's continuation "
                          "nor B's from scratch (B on the KV A computed)",
                          after != cont_b and after != cont_a,
                          {"after": after, "B": cont_b, "A": cont_a})
            res.record(s, f"{mode} switch position", switch)
        else:
            await pusher.update(weights_a, global_steps=steps + 2)
        steps += 2
    # the prefix cache across an update in keep mode (no reset in vLLM: a new cache salt)
    cached = {}
    prompt = [5 + i % 900 for i in range(200)]
    short = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    for name in ("cache-1", "cache-2"):
        cached[name] = (await engine.generate(name, prompt_ids=prompt,
                                              sampling_params=short)).num_cached_tokens
    await pusher.update(weights_a, global_steps=steps + 1, mode="keep")
    for name in ("cache-3", "cache-4"):
        cached[name] = (await engine.generate(name, prompt_ids=prompt,
                                              sampling_params=short)).num_cached_tokens
    res.check(s, "prefix cache: hit before an update, missed right after it, hit again",
              cached["cache-2"] > 0 and cached["cache-3"] == 0 and cached["cache-4"] > 0, cached)
    # a receiver-side failure (with backup) leaves the served weights untouched
    served = await greedy(engine, "before-fail")
    label = engine.global_steps
    backed_up = WeightPusher([engine], backup=True)
    try:
        async with inject_fault(engine, "load", tensor="model.layers.1.mlp.down_proj.weight"):
            await backed_up.update(weights_b, global_steps=9)
        failed = False
    except WeightSyncError as exc:
        failed = "down_proj" in str(exc)
    finally:
        await backed_up.aclose()
    res.check(s, "receiver failure raises WeightSyncError naming the tensor", failed)
    res.check(s, "after the failure: old weights and label serve",
              await greedy(engine, "after-fail") == served and engine.global_steps == label)


async def _hybrid(
    res: Results, engine: VLLMEngine, pusher: WeightPusher, model_a: Path,
    weights_b: dict[str, torch.Tensor], fresh_b: list[Any],
) -> None:
    from transformers import Qwen2ForCausalLM

    s = "hybrid"
    trainer = Qwen2ForCausalLM.from_pretrained(str(model_a), dtype=torch.bfloat16).cuda()
    torch.cuda.synchronize()
    awake = free_gib()
    await engine.sleep(1)
    asleep = free_gib()
    res.record(s, "free GiB awake / asleep", [round(awake, 2), round(asleep, 2)])
    res.check(s, "sleep(1) frees the engine's memory", asleep - awake > 1.0,
              f"{asleep - awake:.2f} GiB freed")
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    batch = torch.randint(2, SMALL["vocab_size"], (8, 64), device="cuda")
    loss = trainer(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    res.record(s, "training step loss", float(loss))
    named = {k: v.detach() for k, v in trainer.state_dict().items()}
    try:
        await pusher.update(named, global_steps=10)
        refused = False
    except EngineSleepingError:
        refused = True
    res.check(s, "push while asleep is refused", refused)
    await engine.wake_up(["weights"])
    report = await pusher.update(named, global_steps=10)
    await engine.wake_up(["kv_cache", "scheduling"])
    res.record(s, "push after wake_up(weights) ms", round(report.seconds * 1e3, 2))
    (digest,) = await engine.collective_rpc("asyncroll_weight_digest")
    served = dict(digest)
    exact = all(
        served[n] == float(named[n].double().sum()) for n in ("model.embed_tokens.weight",
                                                              "lm_head.weight"))
    res.check(s, "the engine serves exactly the trained tensors (embed, lm_head sums)", exact)
    outs = await greedy(engine, "trained")
    res.check(s, "serves after wake-up", all(len(o) == 32 for o in outs))
    await pusher.update(weights_b, global_steps=11)
    res.check(s, "then push B: greedy equals a fresh engine on B", await greedy(engine, "b3")
              == fresh_b)
    del trainer, optimizer
    torch.cuda.empty_cache()


async def _manager_load(
    res: Results, engine: VLLMEngine, weights: dict[str, torch.Tensor]
) -> None:
    s = "manager"
    for mode in ("abort", "keep", "recompute"):
        async with AsyncServerManager([engine], resume_mode=mode) as manager:
            params = {"max_tokens": 1500, "temperature": 1.0, "ignore_eos": True}
            started = time.perf_counter()
            tasks = [asyncio.create_task(manager.generate(
                f"{mode}{i}", prompt_ids=[2 + i % 1000, 3, 4], sampling_params=params))
                for i in range(256)]
            updates, pending = 0, set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.5)
                if pending:
                    await manager.update_weights(
                        weights, global_steps=(manager.global_steps or 0) + 1)
                    updates += 1
            outs = [t.result() for t in tasks]
            elapsed = time.perf_counter() - started
            stats = manager.statistics()
        exact = all(len(o.token_ids) == len(o.log_probs) == len(o.global_steps) == 1500
                    and o.finish_reason == "length" for o in outs)
        monotone = all(list(o.global_steps) == sorted(o.global_steps) for o in outs)  # type: ignore[type-var]
        spanning = sum(o.min_global_steps != o.max_global_steps for o in outs)
        res.check(s, f"{mode}: 256 requests complete with exactly 1500 tokens", exact)
        res.check(s, f"{mode}: per-token global_steps never decrease", monotone)
        res.check(s, f"{mode}: outputs span several versions", spanning > 0 and updates >= 2,
                  f"{spanning} spanning, {updates} updates")
        res.check(s, f"{mode}: nothing in flight at the end", stats.in_flight == 0)
        res.record(s, f"{mode} run", {"updates": updates, "spanning": spanning,
                                      "seconds": round(elapsed, 2),
                                      "tokens_per_s": round(256 * 1500 / elapsed),
                                      "preempted": stats.num_preempted})


# -- push benchmark -----------------------------------------------------------------------------


def write_config(folder: Path, shape: dict[str, Any]) -> Path:
    from transformers import Qwen2Config

    if "family" in shape:  # a shape of asyncroll.testing.tiny_model.SHAPES
        return write_model_config(folder, shape)
    folder.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**shape, max_position_embeddings=4096).save_pretrained(folder)
    return folder


def random_weights(shape: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Trainer-side tensors with Hugging Face Qwen2 names and shapes, bf16 on the GPU (or a
    shape of ``asyncroll.testing.tiny_model.SHAPES``: its checkpoint's names, norms at 1)."""
    return dict(iter_random_weights(shape, seed))


def weight_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``random_weights`` makes, in its order."""
    if "family" in shape:
        return checkpoint_shapes(shape)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,),
                   f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.q_proj.bias": (h,),
                   f"{p}.self_attn.k_proj.weight": (kv, h), f"{p}.self_attn.k_proj.bias": (kv,),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.v_proj.bias": (kv,),
                   f"{p}.self_attn.o_proj.weight": (h, h),
                   f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                   f"{p}.mlp.down_proj.weight": (h, inter)}
    shapes["model.norm.weight"] = (h,)
    if not shape["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (shape["vocab_size"], h)
    return shapes


def iter_random_weights(shape: dict[str, Any], seed: int = 0,
                        device: str = "cuda") -> Iterator[tuple[str, torch.Tensor]]:
    """``random_weights`` one tensor at a time (the same bytes, in the same order): a caller
    that shards each tensor as it comes never holds the whole model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    moe = "family" in shape
    for n, s in weight_shapes(shape).items():
        if moe:
            yield n, (torch.ones(s, dtype=torch.bfloat16, device=device)
                      if n.endswith("norm.weight")
                      else torch.randn(s, generator=gen, device=device,
                                       dtype=torch.bfloat16) * 0.02)
        else:
            yield n, (torch.randn(s, generator=gen, device=device) * 0.02).to(torch.bfloat16)


def _sum(tensor: torch.Tensor) -> float:
    return float(tensor.sum(dtype=torch.float64))


def copy_rate_gbs() -> float:
    """Best payload rate of one 1 GiB device-to-device copy."""
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return GiB / best / 1e9


async def timed(repeats: int, push: Callable[[int], Awaitable[dict[str, float]]]) -> dict[str, Any]:
    await push(0)  # warm-up: attach, first import of buffers, allocator
    runs = [await push(i + 1) for i in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def push_benchmark(res: Results, work: Path, size: str, repeats: int,
                         pairs: int = 40, only_one_copy: bool = False) -> None:
    s = f"push {size}"
    shape = SHAPES.get(size) or MODEL_SHAPES[size]
    folder = write_config(work / size, shape)
    tensors = random_weights(shape)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rate = copy_rate_gbs()
    limit_ms = 2 * nbytes / rate / 1e6
    res.record(s, "payload", {"GiB": round(nbytes / GiB, 3), "tensors": len(tensors),
                              "copy GB/s": round(rate, 1), "two-copy limit ms": round(limit_ms, 2),
                              "one-copy limit ms": round(limit_ms / 2, 2)})
    log(f"{size}: {nbytes / GiB:.2f} GiB in {len(tensors)} tensors; copy {rate:.0f} GB/s, "
        f"two-copy limit {limit_ms:.1f} ms")
    large = nbytes > 20 * GiB  # a 30B-A3B: two variants, one baseline (minutes a push)
    util = 0.25 if size != "7b" else 0.4
    if nbytes > 20 * GiB:  # the engine's copy, its KV cache, and the trainer's beside it
        util = min(0.85, (nbytes / GiB + 12) / (torch.cuda.mem_get_info()[1] / GiB))
    results: dict[str, Any] = {}
    steps = itertools.count(1)
    async with VLLMEngine.launch(folder, name=f"ours-{size}", load_format="dummy",
                                 **engine_args(gpu_memory_utilization=util)) as engine:
        if FINISH_RPC:  # the finish as an RPC of its own, as before 2026-11-28
            engine.weights.finish_in_receive = False
        rpcs = 1 if engine.weights.finish_in_receive else 2
        res.record(s, "RPCs to the workers an update", rpcs)
        # (load, bucket MiB, buffers, compiled load plan, one-copy, verify): the plan against
        # the old load_weights path, staged against one-copy, two buffers against three, the
        # fingerprint check against none
        variants = [("direct", 512, 2, True, True, True), ("direct", 512, 2, True, False, True),
                    ("direct", 512, 3, True, False, True), ("direct", 512, 2, False, False, True),
                    ("direct", 512, 2, True, False, False),
                    ("direct", 1024, 2, True, False, True),
                    ("layerwise", 512, 2, False, False, True)]
        if size == "7b":
            variants = variants[:5]
        elif large:  # a mixture of experts, tens of GiB: one-copy and staged, nothing else
            variants = variants[:2]
        if only_one_copy:  # a quick A/B of one-copy updates: no baselines
            variants = variants[:1]
        for load, bucket_mib, buffers, planned, one_copy, verify in variants:
            how = "plan" if planned else ("load_weights" if load == "direct" else "reload")
            label = (f"asyncroll one-copy {how}" if one_copy
                     else f"asyncroll {load} {how} {bucket_mib} MiB x{buffers}")
            if not verify:
                label += " unverified"
            pusher = WeightPusher([engine], bucket_bytes=bucket_mib << 20, load=load,  # type: ignore[arg-type]
                                  buffers=buffers, load_plan=planned, one_copy=one_copy,
                                  verify=verify)
            last: dict[str, Any] = {}

            async def ours(i: int, pusher: WeightPusher = pusher,
                           last: dict[str, Any] = last, buffers: int = buffers) -> dict[str, Any]:
                called = time.perf_counter()
                r = await pusher.update(tensors, global_steps=next(steps))
                call_ms = (time.perf_counter() - called) * 1e3  # checks and fingerprints too
                (worker,) = await engine.collective_rpc("asyncroll_last_receive_report")
                assert r.push is not None
                last["timeline"] = summarize_timeline(r.push.timeline, worker["timeline"],
                                                      buffers=buffers)
                if r.push.timeline:  # how long the sender waited for the worker's receive RPC
                    last["timeline"]["receiver began after the sender (ms)"] = round(
                        (worker["began"] - r.push.timeline[0].waited) * 1e3, 3)
                    last["timeline"]["worker: vLLM called us after the sender began (ms)"] = (
                        round((worker["entered"] - r.push.timeline[0].waited) * 1e3, 3))
                phases = update_phases(r, worker)
                details = update_details(r, worker, engine)
                return {"update_ms": (r.push_seconds + r.finish_seconds) * 1e3,
                        **phases, **details,
                        "call_ms": call_ms,
                        "total_with_pause_resume_ms": r.seconds * 1e3,
                        "pause_ms": r.pause_seconds * 1e3, "push_ms": r.push_seconds * 1e3,
                        "finish_ms": r.finish_seconds * 1e3,
                        "resume_ms": r.resume_seconds * 1e3,
                        "pack_ms": r.push.pack_seconds * 1e3, "wait_ms": r.push.wait_seconds * 1e3,
                        "sender_ms": r.push.seconds * 1e3,
                        "recv_total_ms": worker["seconds"] * 1e3,
                        "recv_wait_ms": worker["wait_seconds"] * 1e3,
                        "load_ms": worker["load_seconds"] * 1e3,
                        "record_ms": worker["record_seconds"] * 1e3,
                        "ack_ms": worker["ack_seconds"] * 1e3,
                        "sync_ms": worker["sync_seconds"] * 1e3,
                        "planned": worker.get("planned", 0), "fallback": worker.get("fallback", 0),
                        "copies": worker.get("copies", 0), "buckets": r.push.buckets,
                        "verify_ms": worker.get("verify_seconds", 0.0) * 1e3,
                        "verified": worker.get("verified", [0, 0])[0],
                        "not verifiable": worker.get("verified", [0, 0])[1],
                        "early reads": worker.get("early_reads", 0)}

            results[label] = await timed(repeats, ours)
            res.record(s, f"{label} timeline (last push)", last["timeline"])
            log(f"  {label}: {results[label]['update_ms']:.1f} ms; the last push by link:\n"
                + render_timeline(last["timeline"]))
            phase_lines = "\n".join(f"    {k[7:]:52s} {v:7.2f}"
                                    for k, v in results[label].items() if k.startswith("phase: "))
            log(f"  {label}: the update by phase (median ms):\n{phase_lines}")
            detail_lines = "\n".join(f"    {k[8:]:52s} {v:7.2f}"
                                     for k, v in results[label].items()
                                     if k.startswith("detail: "))
            if detail_lines:
                log(f"  {label}: within the phases (median ms):\n{detail_lines}")
            (worker,) = await engine.collective_rpc("asyncroll_last_receive_report")
            if planned:
                res.record(s, f"{label} not planned", worker.get("unplannable"))
                res.check(s, f"{label}: the plan replays the push",
                          worker.get("planned", 0) > 0.9 * len(tensors), worker)
            after_first = free_gib()
            for _ in range(10):
                await pusher.update(tensors, global_steps=next(steps))
            drift = (after_first - free_gib()) / (torch.cuda.mem_get_info()[1] / GiB) * 100
            results[label]["gpu mem drift % of total"] = round(drift, 3)
            res.record(s, "results", results)
            (digest,) = await engine.collective_rpc("asyncroll_weight_digest")
            name = "model.embed_tokens.weight"
            res.check(s, f"{label}: engine serves the pushed tensors",
                      math.isclose(dict(digest)[name], _sum(tensors[name]), rel_tol=1e-9))
            if shape.get("family") == "qwen3_moe":
                await _experts_in_place(res, s, label, engine, shape, tensors)
            if one_copy and verify:
                await _changed_in_place(res, s, label, engine, pusher, tensors, steps)
            await pusher.aclose()
        rtt_ms = await _rpc_round_trip_ms(engine)
        if not only_one_copy:
            await _verify_cost(res, s, engine, tensors, steps, pairs)
        if size == "0.5b" and not only_one_copy:
            await _plan_bitwise(res, s, engine, tensors, steps)
    gc.collect()
    torch.cuda.empty_cache()
    if not only_one_copy and not SKIP_BASELINE:
        results |= await vllm_ipc_baseline(res, s, folder, tensors, util, repeats, results,
                                           variants=1 if large else 3)
    ours = results.get("asyncroll direct plan 512 MiB x2") or results["asyncroll one-copy plan"]
    ours_ms = ours["update_ms"]
    # An update through vLLM's protocol makes two RPCs (the receive, the finish), one where
    # the workers finish in the receive's: the floor under it is the copies plus that many
    # round trips, measured on the same engine.
    floors = {"one-copy": limit_ms / 2 + rpcs * rtt_ms, "two-copy": limit_ms + rpcs * rtt_ms}
    res.record(s, "vLLM RPC floor", {"no-op collective_rpc round trip ms (median of 50)":
                                     round(rtt_ms, 3),
                                     **{f"{k} floor through vLLM ms": round(v, 2)
                                        for k, v in floors.items()}})
    for name, r in results.items():
        r["vs limit"] = round((limit_ms / 2 if "one-copy" in name else limit_ms)
                              / r["update_ms"], 3)
        floor = floors["one-copy" if "one-copy" in name else "two-copy"]
        r["vs floor through vLLM"] = round(floor / r["update_ms"], 3)
        r["asyncroll plan 512 MiB speed-up"] = round(r["update_ms"] / ours_ms, 2)
    res.record(s, "results", results)
    for name, r in results.items():
        log(f"  {name}: {r['update_ms']:.1f} ms ({r['vs limit'] * 100:.1f}% of its limit,"
            f" {r['vs floor through vLLM'] * 100:.1f}% of the floor through vLLM)")


def update_phases(report: Any, worker: dict[str, Any]) -> dict[str, float]:
    """Where one update's push and finish went, end to end, in ms: the sender's and the
    worker's ``time.perf_counter()`` stamps on one clock (Linux), the rest by difference."""
    timeline = worker.get("timeline") or []
    if not timeline or not report.push.began:
        return {}
    began, entered, r_began = report.push.began, worker["entered"], worker["began"]
    first, last = timeline[0]["received"], timeline[-1]["acked"]
    r_end = r_began + worker["seconds"]
    verify = worker.get("verify_seconds", 0.0)
    called, returned = worker.get("called") or entered, worker.get("returned") or 0.0
    phases = {
        # negative where vLLM called the worker first: since 2026-11-27 the receive RPC
        # leaves before the sender's first step, and "the rest" holds the time before it
        "phase: sender began -> vLLM calls the worker": called - began,
        "phase: vLLM starts the update in the worker": entered - called,
        "phase: the worker prepares its receive": r_began - entered,
        "phase: the receiver waits for the first message": first - r_began,
        "phase: first message -> last ack": last - first,
        "phase: last ack -> the receive returns (End, sync)": r_end - last,
        "phase: the worker checks fingerprints": verify,
    }
    if returned:  # the worker's stamps at its RPC's ends (older workers have none)
        tail = "phase: the worker after its receive (reload finish, commit, sync)"
        phases[tail] = returned - r_end - verify
    accounted = sum(phases.values())
    phases["phase: the rest (RPC back, the pusher)"] = report.push_seconds - accounted
    phases["phase: finish (vLLM's finish RPC, the label)"] = report.finish_seconds
    return {name: seconds * 1e3 for name, seconds in phases.items()}


def update_details(report: Any, worker: dict[str, Any], engine: Any) -> dict[str, float]:
    """Splits of ``update_phases``' phases (not summed with them), in ms, where the stamps
    exist: the load plan's check of the parameters (in the copies' phase, where a one-copy
    push replays first; else in the preparation); the first message's
    way (the sender sent it, the receiver's socket had it, the receiver read and checked it);
    the End's way (the sender saw the last ack, sent the End, the receive returned); and the
    way back (the worker's RPC returned, its answer reached the pusher, the push ended)."""
    timeline = worker.get("timeline") or []
    push = report.push
    if not timeline or push is None or not push.timeline:
        return {}
    out: dict[str, float] = {}
    if "plan_check_seconds" in worker:  # since session 25 in the copies' phase, as they run
        out["detail: the plan's check of the parameters"] = worker["plan_check_seconds"]
    first, sent = timeline[0], push.timeline[0]
    if first.get("arrived"):
        out["detail: first message: sent -> the receiver's socket had it"] = (
            first["arrived"] - sent.signalled)
        out["detail: first message: receiver began -> socket had it (0: queued)"] = max(
            0.0, first["arrived"] - worker["began"])
        out["detail: first message: read and check it"] = first["received"] - first["arrived"]
    last_sent, last = push.timeline[-1], timeline[-1]
    r_end = worker["began"] + worker["seconds"]
    if getattr(last_sent, "acked", 0.0) and push.ended:
        out["detail: End: last ack -> the sender saw it"] = last_sent.acked - last["acked"]
        out["detail: End: the sender sends the End"] = push.ended - last_sent.acked
        out["detail: End: sent -> the receive returned"] = r_end - push.ended
    port = getattr(engine, "weights", None)  # the take's answer: ``VLLMWeightPort.answered``
    answered, returned = getattr(port, "answered", 0.0), worker.get("returned") or 0.0
    if answered and returned:
        out["detail: back: the worker returned -> its answer reached the pusher"] = (
            answered - returned)
        out["detail: back: answer -> the sender's push returned (< 0: before)"] = (
            push.began + push.seconds - answered)
    return {name: seconds * 1e3 for name, seconds in out.items()}


async def _changed_in_place(res: Results, s: str, label: str, engine: VLLMEngine,
                            pusher: WeightPusher, tensors: dict[str, torch.Tensor],
                            steps: Iterator[int]) -> None:
    """A one-copy push of tensors the trainer changed in place (same storages, new values),
    then of the old values again: each is checked, the check's read queued early behind the
    loads (a read that ran before the copies would see the other values, and fail the
    push), and the engine serves each."""
    name = "model.embed_tokens.weight"
    ok, detail = True, []
    for _ in range(2):
        for t in tensors.values():
            t.neg_()
        (before,) = await engine.collective_rpc("asyncroll_last_receive_report")
        await pusher.update(tensors, global_steps=next(steps))
        (after,) = await engine.collective_rpc("asyncroll_last_receive_report")
        (digest,) = await engine.collective_rpc("asyncroll_weight_digest")
        early = after.get("early_reads", 0) - before.get("early_reads", 0)
        served = math.isclose(dict(digest)[name], _sum(tensors[name]), rel_tol=1e-9)
        verified = after.get("verified", [0, 0])[0]
        ok = ok and early == 1 and served and verified == len(tensors)
        detail.append({"early reads": early, "served": served, "verified": verified})
    res.check(s, f"{label}: tensors changed in place are pushed, checked early, served",
              ok, detail)


async def _experts_in_place(res: Results, s: str, label: str, engine: VLLMEngine,
                            shape: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The fused expert parameters of the first and last layers hold the pushed experts, in
    order (a position-weighted checksum: a swapped expert or crossed gate/up shows)."""
    layers = shape["num_hidden_layers"]
    gate, up, down = ("gate_proj", "up_proj", "down_proj")
    for layer in (0, layers - 1):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(prefix + ".")})
        w13 = torch.cat([torch.cat([tensors[f"{prefix}.{e}.{gate}.weight"],
                                    tensors[f"{prefix}.{e}.{up}.weight"]]) for e in experts])
        w2 = torch.cat([tensors[f"{prefix}.{e}.{down}.weight"] for e in experts])
        (digest,) = await engine.collective_rpc("asyncroll_weight_digest")
        served = [n for n, _ in digest if f"layers.{layer}." in n]
        w13_name = next(n for n in served if n.endswith("w13_weight"))
        w2_name = next(n for n in served if n.endswith("w2_weight"))
        want = {w13_name: position_checksum(w13), w2_name: position_checksum(w2)}
        (got,) = await engine.collective_rpc("asyncroll_weight_checksums", args=(list(want),))
        res.check(s, f"{label}: layer {layer}'s experts hold the pushed ones, in order",
                  all(math.isclose(got[n], want[n], rel_tol=1e-9) for n in want),
                  {"got": got, "want": want})


async def _rpc_round_trip_ms(engine: VLLMEngine, n: int = 50) -> float:
    """The median round trip of a no-op ``collective_rpc`` into the engine's workers."""
    times = []
    for _ in range(n + 5):
        t0 = time.perf_counter()
        await engine.collective_rpc("asyncroll_ping")
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[5:])


async def _verify_cost(res: Results, s: str, engine: VLLMEngine,
                       tensors: dict[str, torch.Tensor], steps: Any, pairs: int) -> None:
    """What the fingerprint check costs, measured in ``pairs`` pairs: one pusher (staged
    512 MiB x2, plan), its check switched on and off push by push in ABBA order, so drift and
    warm-up hit both sides alike; the mean paired difference with its standard error."""
    pusher = WeightPusher([engine], bucket_bytes=512 << 20, load="direct")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for _ in range(2):  # warm-up: attach, learn the plan, first fingerprints
            await pusher.update(tensors, global_steps=next(steps))
        for i in range(pairs * 2):
            flag = (i % 4) in (0, 3)
            pusher.verify = flag
            called = time.perf_counter()
            r = await pusher.update(tensors, global_steps=next(steps))
            call_ms = (time.perf_counter() - called) * 1e3
            (worker,) = await engine.collective_rpc("asyncroll_last_receive_report")
            delivery = r.deliveries.get(engine.name)
            runs[flag].append({
                "update_ms": (r.push_seconds + r.finish_seconds) * 1e3,
                "push_ms": r.push_seconds * 1e3, "call_ms": call_ms,
                "worker_verify_ms": worker.get("verify_seconds", 0.0) * 1e3,
                "sender_ms": r.push.seconds * 1e3 if r.push else 0.0,
                "recv_total_ms": worker["seconds"] * 1e3,
                "worker prep ms": (worker["began"] - worker["entered"]) * 1e3,
                "verified (UpdateReport)": delivery.verified if delivery else -1,
            })
        pusher.verify = True
        failed = ""
        async with inject_fault(engine, "corrupt", tensor="model.norm.weight"):
            try:
                await pusher.update(tensors, global_steps=next(steps))
            except WeightSyncError as exc:
                failed = str(exc)
        await pusher.update(tensors, global_steps=next(steps))  # whole again: serves
        res.check(s, "a load corrupted after the push fails it, naming the tensor",
                  "model.norm.weight" in failed and "fingerprints" in failed, failed[:300])
    finally:
        await pusher.aclose()
    out: dict[str, Any] = {}
    for flag, label in ((True, "verified"), (False, "unverified")):
        out[label] = {k: round(statistics.median(r[k] for r in runs[flag]), 3)
                      for k in runs[flag][0]}
    diffs = [a["update_ms"] - b["update_ms"] for a, b in zip(runs[True], runs[False], strict=True)]
    out["pairs"] = len(diffs)
    mean = statistics.fmean(diffs)
    sem = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    out["mean paired difference (update ms)"] = round(mean, 3)
    out["standard error of that mean (ms)"] = round(sem, 3)
    out["mean cost % of the unverified update"] = round(
        100 * mean / out["unverified"]["update_ms"], 2)
    for key in ("push_ms", "sender_ms", "recv_total_ms", "worker_verify_ms"):
        out[f"median paired difference ({key})"] = round(statistics.median(
            a[key] - b[key] for a, b in zip(runs[True], runs[False], strict=True)), 3)
    out["median paired difference (update ms)"] = round(statistics.median(diffs), 3)
    out["cost % of the unverified update"] = round(
        100 * out["median paired difference (update ms)"] / out["unverified"]["update_ms"], 2)
    res.record(s, "verify cost (ABBA pairs)", out)
    res.check(s, "every verified push checked every tensor (UpdateReport)",
              all(r["verified (UpdateReport)"] == len(tensors) for r in runs[True]),
              out["verified"])
    log(f"  verify cost: {out['median paired difference (update ms)']:.2f} ms "
        f"({out['cost % of the unverified update']:.1f}%), worker check "
        f"{out['verified']['worker_verify_ms']:.2f} ms")


async def _plan_bitwise(res: Results, s: str, engine: VLLMEngine,
                        tensors: dict[str, torch.Tensor], steps: Any) -> None:
    """A planned push leaves the engine bitwise where ``load_weights`` leaves it: learn the plan
    on other weights, replay it on ``tensors``; then the same two pushes without a plan. The
    buckets are 64 MiB, so that the embedding spans several (and is placed piece by piece)."""
    other = random_weights(SHAPES["0.5b"], seed=1)
    hashes = []
    for planned in (True, False):
        pusher = WeightPusher([engine], load="direct", load_plan=planned, bucket_bytes=64 << 20)
        try:
            await pusher.update(other, global_steps=next(steps))
            await pusher.update(tensors, global_steps=next(steps))
            (report,) = await engine.collective_rpc("asyncroll_last_receive_report")
            (digest,) = await engine.collective_rpc("asyncroll_weight_hash")
            hashes.append((digest, report.get("planned", 0)))
        finally:
            await pusher.aclose()
    (plan_hash, planned), (plain_hash, _) = hashes
    res.check(s, "planned push is bitwise equal to load_weights (every parameter)",
              plan_hash == plain_hash and planned > 0, {"planned": planned})


async def vllm_ipc_baseline(
    res: Results, s: str, folder: Path, tensors: dict[str, torch.Tensor], util: float,
    repeats: int, results: dict[str, Any], variants: int = 3,
) -> dict[str, Any]:
    """vLLM's built-in ``ipc`` backend: ``trainer_send_weights`` (packed / unpacked), the same
    engine set-up, the same start / update / finish protocol around it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _baseline_ext import install_ray_stub

    install_ray_stub()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # its handles travel as pickles
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerSendWeightsArgs,
        IPCWeightTransferEngine,
    )

    name = "model.embed_tokens.weight"
    want = _sum(tensors[name])  # before the engine takes its share of the memory
    async with VLLMEngine.launch(
        folder, name="vllm-ipc", load_format="dummy",
        weight_transfer_config=WeightTransferConfig(backend="ipc"),
        **engine_args(gpu_memory_utilization=util,
                      worker_extension_cls="_baseline_ext.BaselineWorkerExtension"),
    ) as engine:
        llm = vllm_client(engine)
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        loop = asyncio.get_running_loop()

        def send(info: Any) -> None:
            request = WeightTransferUpdateRequest(update_info=asdict(info))
            asyncio.run_coroutine_threadsafe(llm.update_weights(request), loop).result()

        for label, packed, buffer in (("vLLM ipc packed 1 GiB (default)", True, GiB),
                                      ("vLLM ipc packed 2 GiB", True, 2 * GiB),
                                      ("vLLM ipc unpacked", False, GiB))[:variants]:
            args = IPCTrainerSendWeightsArgs(send_mode=send, packed=packed,
                                             packed_buffer_size_bytes=buffer)

            async def baseline(i: int, args: Any = args) -> dict[str, float]:
                started = time.perf_counter()
                await llm.start_weight_update()
                try:
                    await asyncio.to_thread(IPCWeightTransferEngine.trainer_send_weights,
                                            iter(tensors.items()), args)
                finally:
                    await llm.finish_weight_update()
                return {"update_ms": (time.perf_counter() - started) * 1e3}

            try:
                results[label] = await timed(repeats, baseline)
                res.record(s, "results", results)
            except Exception as exc:  # report, keep going with the other variants
                res.record(s, f"{label} failed", repr(exc)[:500])
                log(f"  {label} failed: {exc!r}"[:400])
        (digest,) = await engine.collective_rpc("asyncroll_weight_digest")
        res.check(s, "vLLM ipc: engine serves the pushed tensors",
                  math.isclose(dict(digest)[name], want, rel_tol=1e-9))
    return results


# -- rollout throughput -------------------------------------------------------------------------


async def rollout(res: Results, work: Path, interval: float, policies: list[str],
                  slow_turns: bool, eager: bool = False,
                  batch: dict[str, int] | None = None, rounds: int = 1,
                  num_engines: int = 1, size: str = "0.5b", gpus: int = 1) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import rollout_throughput as rt
    from gpu_broadcast import visible

    gpus = min(gpus, num_engines)
    if gpus > 1 and (mixed := [p for p in policies if p != "none" and not p.endswith("-roll")]):
        raise ValueError(f"engines on {gpus} GPUs are updated group by group (-roll policies"
                         f" only), not {mixed}: no one pusher reaches them all")

    folder = write_config(work / f"rollout-{size}", SHAPES[size])
    tensors = random_weights(SHAPES[size])
    # With CUDA graphs a 384-request run lasts ~12 s: 1024 requests give updates enough.
    jobs = [(prompt, min(1000, n * 2))
            for prompt, n in rt.workload((384 if eager else 1024) * num_engines, seed=0)]
    concurrency = 256 * num_engines
    res.record("rollout", "workload", {"shape": size,
                                       "requests": len(jobs), "tokens": sum(n for _, n in jobs),
                                       "concurrency": concurrency, "engines": num_engines,
                                       "gpus": gpus, "update every s": interval,
                                       "pushers": "one a group (-roll): CUDA IPC to an engine"
                                       " on GPU 0 (with the policy's -land, -1copy), the"
                                       " broadcast transport (NCCL, received in the commit)"
                                       " to one on another GPU" if gpus > 1 else "one"})
    table = {}
    # CUDA graphs on: the stall an update causes is measured on the engine users run. Several
    # engines (``--rollout-engines``, for ``-roll`` policies) share the GPU's half, or with
    # ``--rollout-gpus`` go one a GPU in turn: engine i on GPU i % gpus, its process seeing
    # that GPU only. The trainer's tensors stay on GPU 0: an engine there is pushed to
    # through CUDA IPC, one on another GPU through the broadcast transport (NCCL).
    placed = [i % gpus for i in range(num_engines)]
    share = 0.5 / placed.count(0)
    async with contextlib.AsyncExitStack() as stack:
        launched = []
        for i in range(num_engines):  # one after the other: vLLM measures the free memory
            with visible(str(placed[i]) if gpus > 1 else None):
                launched.append(await stack.enter_async_context(VLLMEngine.launch(
                    folder, name=f"rollout-{i}", load_format="dummy",
                    **engine_args(gpu_memory_utilization=share, enforce_eager=eager,
                                  **(batch or {})))))
        on_gpu = {e.name: placed[i] for i, e in enumerate(launched)}

        def group_pusher(engine: VLLMEngine, suffixes: set[str], inflight: bool) -> Any:
            backup = True if inflight else None
            if on_gpu[engine.name] == 0:
                return WeightPusher([engine], one_copy="-1copy" in suffixes,
                                    land="-land" in suffixes, backup=backup)
            return WeightPusher([engine], backend="broadcast", backup=backup)
        engine: Any = launched[0] if num_engines == 1 else list(launched)
        first = launched[0]
        # What the scheduler runs at once: without arguments, AsyncLLM takes vLLM's bare
        # fallbacks (128 sequences, 2048 tokens a step), not its serving or offline defaults.
        scheduler = vllm_client(first).vllm_config.scheduler_config
        res.record("rollout", "scheduler", {"max_num_seqs": scheduler.max_num_seqs,
                                            "max_num_batched_tokens":
                                                scheduler.max_num_batched_tokens})
        await rt.run_policy(engine, tensors, "none", jobs[:32], interval, concurrency=256)
        # What the README tells users: start-up's heap frozen, young collections rarer (before
        # 2026-11-29 these runs froze the heap but kept CPython's 700 threshold).
        res.record("rollout", "heap", {"frozen": stack.enter_context(frozen_heap()),
                                       "young_threshold": gc.get_threshold()[0]})
        rounds_run: list[dict[str, dict[str, Any]]] = []
        for number in range(rounds):  # the policies in turn, ``rounds`` times: host drift
            run: dict[str, dict[str, Any]] = {}  # moves every policy of a round alike
            for policy in policies:
                log(f"rollout, round {number + 1} of {rounds}: {policy}...")
                run[policy] = await rt.run_policy(engine, tensors, policy, jobs, interval,
                                                  concurrency=concurrency,
                                                  slow_turns=slow_turns,
                                                  group_pushers=group_pusher
                                                  if gpus > 1 else None)
                log(f"  {run[policy]['tokens_per_s']:.0f} tokens/s, update stages ms "
                    f"{run[policy]['update_stage_ms']}, engine stall ms "
                    f"{run[policy].get('update_stall_ms')}, groups ms {run[policy]['group_ms']}")
            rounds_run.append(run)
            table = table or run  # the first round's details, as with one round
            if rounds > 1:  # each round kept as it ends: a later one may fail
                res.record("rollout", "rounds", _rounds_summary(rounds_run, policies))
                res.save()
    for base in ("none", "drain"):
        for r in table.values():
            if base in table:
                r[f"vs {base}"] = round(r["tokens_per_s"] / table[base]["tokens_per_s"], 3)
    res.record("rollout", "results", table)


def _rounds_summary(rounds_run: list[dict[str, dict[str, Any]]],
                    policies: list[str]) -> dict[str, dict[str, Any]]:
    """Per policy: tokens/s and the median update's stall each round; with ``none`` among the
    policies, each round's ratio to that round's ``none`` and their median."""
    summary: dict[str, dict[str, Any]] = {}
    for policy in policies:
        row: dict[str, Any] = {
            "tokens_per_s": [round(run[policy]["tokens_per_s"]) for run in rounds_run],
            "stall ms (median update), each round": [
                (run[policy].get("update_stage_ms") or {}).get("total") for run in rounds_run
            ],
        }
        for key in ("update_stall_ms", "update_stall_worst_ms", "step_gap_median_ms",
                    "commit_gap_ms", "commit_stall_beyond_step_ms", "commit_gap_split_ms",
                    "rollout_stall_ms", "rollout_stall_worst_ms", "rollout_gap_median_ms",
                    "roll_vs_one_group", "skew_worst", "group_call_ms",
                    "commit_stall_beyond_biased_step_ms", "step_gap_length_biased_ms", "plan",
                    "loop_worst_ms", "receive_ms", "group_ms", "reprefill_per_update"):
            row[f"{key}, each round"] = [run[policy].get(key) for run in rounds_run]
        if "none" in policies:
            ratios = [run[policy]["tokens_per_s"] / run["none"]["tokens_per_s"]
                      for run in rounds_run]
            row["vs none, each round"] = [round(r, 3) for r in ratios]
            row["vs none, median"] = round(statistics.median(ratios), 3)
            log(f"rollout {policy}: vs none {row['vs none, each round']},"
                f" median {row['vs none, median']}")
        summary[policy] = row
    return summary


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--sections", default="correctness,hybrid,manager,push,rollout")
    parser.add_argument("--sizes", default="0.5b,1.5b,7b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verify-pairs", type=int, default=40,
                        help="ABBA pairs measuring the fingerprint check's cost (push section)")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--policies", default="none,abort,keep,recompute,drain")
    parser.add_argument("--rollout-engines", type=_positive, default=1,
                        help="rollout: engines sharing the GPU (for -roll policies: rolling=1)")
    parser.add_argument("--rollout-gpus", type=_positive, default=1,
                        help="rollout: engine i on GPU i %% N (engines off GPU 0 are pushed to"
                             " over NCCL; -roll policies give each engine its own pusher)")
    parser.add_argument("--rollout-size", default="0.5b", choices=sorted(SHAPES),
                        help="rollout: the model shape (random weights)")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="rollout: run the policies in turn this many times; each ratio is"
                             " taken against the same round's none (its median is reported)")
    parser.add_argument("--slow-turns", action="store_true",
                        help="sample the loop thread's stack on long turns (perturbs the run)")
    parser.add_argument("--no-slow-turns", action="store_true", help="the default; kept")
    parser.add_argument("--eager", action="store_true",
                        help="rollout engine without CUDA graphs (enforce_eager)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="rollout engine: sequences scheduled at once (vLLM's default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="rollout engine: tokens a step (vLLM's default)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the trainer's event loop (asyncroll's examples run uvloop)")
    parser.add_argument("--sender-first", action="store_true",
                        help="the update's old order, as a baseline: the sender begins before"
                             " the engines' receive RPCs leave")
    parser.add_argument("--finish-rpc", action="store_true",
                        help="push: the workers finish an update in an RPC of its own (the"
                             " order before 2026-11-28), for an A/B against the default")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="push: no vLLM ipc baseline (an A/B of our own paths)")
    parser.add_argument("--only-one-copy", action="store_true",
                        help="push: only the one-copy variant, no baselines (a quick A/B of"
                             " two trees on one machine; the limit is still measured)")
    parser.add_argument("--torch-copies", action="store_true",
                        help="baseline: the sender packs with torch's copy_, not the driver's"
                             " memcpy from address ranges")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        log("gpu_e2e needs CUDA and CUDA vLLM; skipped (see docs/gpu.md)")
        return 0
    sections = set(args.sections.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    res = Results(args.out)
    res.record("env", "gpu", torch.cuda.get_device_name())
    res.record("env", "torch", torch.__version__)
    res.record("env", "event loop", args.loop)
    if args.sender_first:
        SenderChannel._receivers_first = False
    if args.skip_baseline:
        global SKIP_BASELINE
        SKIP_BASELINE = True
    res.record("env", "ASYNCROLL_FUSE_BYTES", os.environ.get("ASYNCROLL_FUSE_BYTES", "default"))
    if args.finish_rpc:
        global FINISH_RPC
        FINISH_RPC = True
    res.record("env", "finish", "an RPC of its own" if args.finish_rpc else "in the receive's RPC")
    if args.torch_copies:
        CudaIpcBackend.queue_spans = lambda self, spans: False  # type: ignore[method-assign]
    res.record("env", "sender copies", "torch" if args.torch_copies else "driver memcpy")
    res.record("env", "order", "sender first" if args.sender_first else "receivers first")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if sections & {"correctness", "hybrid", "manager"}:
            steps.append(("small", lambda: correctness_and_hybrid(res, work, sections)))
        if "push" in sections:
            for size in args.sizes.split(","):
                steps.append((f"push {size}",
                              lambda size=size: push_benchmark(res, work, size, args.repeats,
                                                                 args.verify_pairs,
                                                                 args.only_one_copy)))
        if "rollout" in sections:
            batch = {key: value for key, value in (
                ("max_num_seqs", args.max_num_seqs),
                ("max_num_batched_tokens", args.max_num_batched_tokens),
            ) if value is not None}
            steps.append(("rollout", lambda: rollout(res, work, args.interval,
                                                     args.policies.split(","),
                                                     args.slow_turns, args.eager, batch,
                                                     args.rounds, args.rollout_engines,
                                                     args.rollout_size, args.rollout_gpus)))
        await run_steps(res, steps)
    return finish(res)


async def run_steps(res: Results, steps: list[tuple[str, Callable[[], Awaitable[None]]]]) -> None:
    """Each step in turn, timed; one that raises is a failed check, and the rest still run."""
    for name, step in steps:
        started = time.perf_counter()
        log(f"== {name}")
        try:
            await step()
        except Exception:
            res.check(name, "ran to the end", False, traceback.format_exc()[-3000:])
        log(f"== {name}: {time.perf_counter() - started:.0f} s")
        res.save()


def finish(res: Results) -> int:
    """Save, print the tail of the results and the failed checks; the exit status."""
    res.save()
    log(json.dumps(res.data, indent=1, default=str)[-6000:])
    log(f"{res.failed} checks failed")
    return 1 if res.failed else 0


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit((uvloop.run if arguments.loop == "uvloop" else asyncio.run)(main(arguments)))
