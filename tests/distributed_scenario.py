"""One rank of a 2-rank FSDP2 trainer (gloo, CPU) pushing into a TP=2 vLLM CPU engine that rank 0
holds (``tests/test_distributed.py`` runs two of these and reads rank 0's JSON).

Rank 0: the engine starts on model B and serves B's greedy outputs; the ranks push A (sharded:
every parameter a ``DTensor``), then B, then A again, and rank 0 records what the engine serves
after each. B again as pieces; A and B through the split layout's push groups, then with
``fan_in``; A through the staged pusher again (it attaches the engine again). Then rank 1 dies
in the middle of the next push's gathers (``os._exit`` inside a gather): rank 0 records the
error it gets, the engine's label, and what it serves.

``--engines 2``: rank 0 holds two data-parallel engines (TP=1) instead, whose workers the two
ranks serve one each; the ranks push A, then B. With ``--die-rank 0``, rank 0 (the coordinator,
and the engines with it) then writes its JSON and dies inside a gather of a third push; rank 1
records what its update raised. (One run for both: each run's start-up is most of its time.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sharded_model(path: str) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    return sharded(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32))


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over every rank, a layer at a time (a mixture's fused experts: over the experts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def pieces_forced(pieces: dict[str, Any]) -> Any:
    """The coordinator's next update pushes ``pieces`` as pieces (name -> None: each rank its
    rows; or per rank the columns to exchange), whatever the workers read."""
    from asyncroll.distributed import DistributedWeightPusher

    original = DistributedWeightPusher._piece_names
    pending = dict(pieces)

    def forced(self: Any, named: Any) -> dict[str, Any]:
        chosen = dict(pending) or original(self, named)
        pending.clear()
        return chosen

    DistributedWeightPusher._piece_names = forced  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedWeightPusher._piece_names = original  # type: ignore[method-assign]


@contextlib.contextmanager
def counting(module: Any, name: str) -> Any:
    """Count the calls of ``module.name`` inside; yields a one-item list holding the count."""
    original, calls = getattr(module, name), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def die_in_gather(after: int) -> None:
    """This rank exits (as if killed) in the middle of its ``after``-th gather from now."""
    import asyncroll.distributed

    original = asyncroll.distributed.gather
    calls = 0

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > after:
            os._exit(17)
        return original(tensor)

    asyncroll.distributed.gather = gather


def gathers_match(model: torch.nn.Module) -> bool:
    """``asyncroll.distributed.gather`` equals ``full_tensor()`` for every parameter and for
    tensors whose rows do not split evenly (a rank may hold fewer rows, or none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncroll.distributed import gather
    from asyncroll.fingerprints import fingerprints

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(3)
    odd = [
        distribute_tensor(torch.randn(shape, generator=generator), mesh, [Shard(0)])
        for shape in ((5, 3), (1, 4), (3,), (7, 2, 2))
    ]
    tensors = [p.detach() for _, p in model.named_parameters()] + odd
    return all(torch.equal(gather(t), t.full_tensor()) for t in tensors) and all(
        shard_print(t, dtype) == fingerprints({"t": t.full_tensor().to(dtype)})["t"]
        for t in tensors for dtype in (torch.float32, torch.bfloat16)
    )


def blocks_match(model: torch.nn.Module) -> list[str]:
    """Every 2-D parameter's column blocks, exchanged as bf16 (``_column_block``: one
    all-to-all), against ``full_tensor()``'s columns, for even and uneven windows; the names
    that differ."""
    from asyncroll.distributed import _column_block, _Exchanges

    rank, wrong = dist.get_rank(), []
    for name, parameter in model.named_parameters():
        tensor = parameter.detach()
        if tensor.dim() != 2:
            continue
        columns = tensor.shape[1]
        even = [(0, columns // 2), (columns // 2, columns)]
        for windows in (even, [(0, 3), (1, columns)]):
            made = _column_block(tensor, windows, rank, torch.bfloat16).make()
            first, end = windows[rank]
            expected = tensor.full_tensor()[:, first:end].to(torch.bfloat16)  # type: ignore[attr-defined]
            if not torch.equal(made, expected):
                wrong.append(name)
        # Batched (a bucket's exchanges as one batch of sends and receives): two tensors'
        # blocks (of other values: a block paired with the other's send shows) made inside
        # the batch's context, read after it.
        exchanges = _Exchanges(tensor.device_mesh.get_group())  # type: ignore[attr-defined]
        both = (tensor, tensor * 2 + 1)
        lazies = [_column_block(t, even, rank, torch.bfloat16, exchanges=exchanges) for t in both]
        assert all(lazy.batch is exchanges.batch for lazy in lazies)
        with exchanges.batch():
            blocks = [lazy.make() for lazy in lazies]
        first, end = even[rank]
        for t, block in zip(both, blocks, strict=True):
            expected = t.full_tensor()[:, first:end].to(torch.bfloat16)  # type: ignore[attr-defined]
            if not torch.equal(block, expected):
                wrong.append(f"{name} (batched)")
    return wrong


def other_layouts(model: torch.nn.Module, out: dict[str, Any]) -> list[tuple[str, Any]]:
    """``model``'s parameters with ``lm_head`` redistributed on a 2-D mesh (1 x world:
    ``[Replicate(), Shard(0)]``) and the embedding as ``Shard(1)`` (columns); their layouts in
    ``out["other_layouts"]``. Collective: every rank, in the same order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    mesh_1d = init_device_mesh("cpu", (world,))
    changed = {
        "lm_head.weight": (mesh_2d, [Replicate(), Shard(0)]),
        "model.embed_tokens.weight": (mesh_1d, [Shard(1)]),
    }
    named = []
    for name, parameter in model.named_parameters():
        if name in changed:
            mesh, placements = changed[name]
            parameter = distribute_tensor(parameter.detach().full_tensor(), mesh, placements)
            out.setdefault("other_layouts", {})[name] = [
                tuple(parameter.device_mesh.shape), [str(p) for p in parameter.placements]]
        named.append((name, parameter))
    return named


def shard_print(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    """The fingerprint of a sharded tensor from every rank's samples of its own rows."""
    from asyncroll.distributed import shard_samples

    samples = shard_samples(tensor, dtype, rank=dist.get_rank())
    assert samples is not None
    joined = samples.view(torch.uint8).to(torch.int32)
    dist.all_reduce(joined)
    return bytes(joined.to(torch.uint8).numpy().tobytes())


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from engine_helpers import ENGINE_ARGS, greedy

    from asyncroll import VLLMEngine

    rank = dist.get_rank()
    if args.family != "qwen2":
        await fused_experts(out := {}, args)
        return out
    model_a, model_b = sharded_model(args.model_a), sharded_model(args.model_b)
    out: dict[str, Any] = {}
    engine = None
    if args.engines > 1:
        await data_parallel(out, args, model_a, model_b)
        return out
    async with contextlib.AsyncExitStack() as stack:
        if rank == 0:
            engine = await stack.enter_async_context(
                VLLMEngine.launch(args.model_b, name="tp2", tensor_parallel_size=2, **ENGINE_ARGS)
            )
            out["fresh_b"] = await greedy(engine, "fresh-b")
        # Rank 1 waits here for rank 0's engine (two minutes or more to start on a busy CI
        # machine), not in the pusher's group set-up, whose timeout bounds a push, not a start.
        dist.barrier()
        await run(out, engine, model_a, model_b, args)
    return out


async def fused_experts(out: dict[str, Any], args: argparse.Namespace) -> None:
    """A transformers-5 mixture (``args.family``) on both ranks, its experts fused and sharded
    over the ranks (four of the eight each), pushed into a TP=2 engine on rank 0 started on
    seed 1: seed 0, then seed 1; what the engine serves after each, and what it took."""
    from engine_helpers import ENGINE_ARGS, greedy

    from asyncroll import DistributedWeightPusher, VLLMEngine
    from asyncroll.testing import make_tiny_model
    from asyncroll.testing.tiny_model import tiny_module

    modules = {seed: sharded(tiny_module(seed=seed, family=args.family)) for seed in (0, 1)}
    fused = [(n, p) for n, p in modules[0].named_parameters() if n.endswith("experts.down_proj")]
    out["fused"] = [n for n, _ in fused[:1]]
    out["fused_shard"] = [list(p.to_local().shape) for _, p in fused[:1]]  # type: ignore[attr-defined]
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        if dist.get_rank() == 0:
            path = make_tiny_model(Path(args.out).parent / "seed1", seed=1, family=args.family)
            engine = await stack.enter_async_context(VLLMEngine.launch(
                path, name="experts-tp2", tensor_parallel_size=2, **ENGINE_ARGS))
            out["fresh_1"] = await greedy(engine, "fresh-1")
            engines = [engine]
        dist.barrier()
        pusher = DistributedWeightPusher(engines, timeout=args.timeout)
        for steps, seed in ((1, 0), (2, 1)):
            report = await pusher.update(modules[seed].named_parameters(), global_steps=steps)
            out[f"report_{seed}"] = [report.global_steps, report.tensors]
            if engines:
                out[f"on_{seed}"] = await greedy(engines[0], f"on-{seed}")
                delivery = report.deliveries[engines[0].name]
                out[f"delivery_{seed}"] = [delivery.workers, delivery.tensors, delivery.verified]
        await pusher.aclose()


async def data_parallel(
    out: dict[str, Any], args: argparse.Namespace, model_a: torch.nn.Module,
    model_b: torch.nn.Module,
) -> None:
    """Rank 0 holds ``args.engines`` engines of one worker each (worker ``i`` served by rank
    ``i % 2``); push A then B; what each engine serves after each, and what each took."""
    from engine_helpers import ENGINE_ARGS, greedy, start_engines

    from asyncroll import DistributedWeightPusher

    async with contextlib.AsyncExitStack() as stack:
        engines = []
        if dist.get_rank() == 0:
            specs = [(Path(args.model_b), f"dp{i}", ENGINE_ARGS) for i in range(args.engines)]
            engines = await start_engines(*specs)  # together: about as long as one

            async def close_all() -> None:
                await asyncio.gather(*(engine.aclose() for engine in engines))

            stack.push_async_callback(close_all)
            out["fresh_b"] = [await greedy(e, f"fresh-b-{e.name}") for e in engines]
        dist.barrier()
        pusher = DistributedWeightPusher(engines, timeout=args.timeout)
        for steps, model, tag in ((1, model_a, "a"), (2, model_b, "b")):
            report = await pusher.update(model.named_parameters(), global_steps=steps)
            assert report.push is not None
            out[f"receivers_{tag}"] = report.push.receivers  # this rank's workers
            if engines:
                out[f"on_{tag}"] = [await greedy(e, f"on-{tag}-{e.name}") for e in engines]
                out[f"delivery_{tag}"] = [
                    [report.deliveries[e.name].workers, report.deliveries[e.name].tensors]
                    for e in engines
                ]
                out[f"steps_{tag}"] = [e.global_steps for e in engines]
        await pusher.aclose()
        split = await split_pushes(out, engines, model_a, model_b, steps=3, args=args)
        await split.aclose()
        fan_in = await split_pushes(out, engines, model_a, model_b, steps=5, args=args,
                                    fan_in=True)
        await fan_in.aclose()
        # Engine 0 alone: rank 1 serves no worker, and only makes its part of the gathers.
        lone = DistributedWeightPusher(engines[:1], backend="broadcast", timeout=args.timeout)
        report = await lone.update(model_a.named_parameters(), global_steps=7)
        out["lone_receivers"] = report.push.receivers if report.push is not None else None
        if engines:
            out["lone_on_a"] = await greedy(engines[0], "lone-a")
            out["lone_steps"] = [e.global_steps for e in engines]
        if args.die_rank == 0:  # the coordinator, its engines with it: nothing left to close
            await push_as_one_dies(out, lone, model_a, steps=8, dying=0, record=args.out)
            return
        await lone.aclose()


async def split_pushes(
    out: dict[str, Any], engines: list[Any], model_a: torch.nn.Module,
    model_b: torch.nn.Module, *, steps: int, args: argparse.Namespace, fan_in: bool = False,
) -> Any:
    """A then B through ``backend="broadcast"`` (the split layout: each rank a push group of
    its own with the workers it serves; ``fan_in``: with every worker, sending its own rows);
    what each engine serves after each, what it took, and what each rank sent. Returns the
    pusher."""
    from engine_helpers import greedy

    from asyncroll import DistributedWeightPusher

    split = DistributedWeightPusher(engines, backend="broadcast", timeout=args.timeout,
                                    fan_in=fan_in)
    prefix = "fan_in" if fan_in else "split"
    for steps_now, model, tag in ((steps, model_a, "a"), (steps + 1, model_b, "b")):
        report = await split.update(model.named_parameters(), global_steps=steps_now)
        assert report.push is not None
        sender = split._pusher.channel.sender if engines else split._sender
        out[f"{prefix}_sent_{tag}"] = [type(sender).__name__, report.push.receivers,
                                       report.push.tensors, report.push.bytes]
        out[f"{prefix}_pieces_{tag}"] = sorted(report.pieces)
        if engines:
            out[f"{prefix}_on_{tag}"] = [await greedy(e, f"{prefix}-{tag}-{e.name}")
                                         for e in engines]
            out[f"{prefix}_delivery_{tag}"] = [
                [report.deliveries[e.name].workers, report.deliveries[e.name].tensors,
                 report.deliveries[e.name].verified]
                for e in engines
            ]
            out[f"{prefix}_steps_{tag}"] = [e.global_steps for e in engines]
    return split


async def push_as_one_dies(
    out: dict[str, Any], pusher: Any, model: torch.nn.Module, *, steps: int, dying: int,
    record: str,
) -> None:
    """Push ``model`` while rank ``dying`` exits inside a gather (writing what it found so far
    to ``record`` first); note what the update raised here, and how soon."""
    from asyncroll import WeightSyncError

    if dist.get_rank() == dying:
        Path(record).write_text(json.dumps(out))  # noqa: ASYNC240 (a small file; it dies next)
        die_in_gather(after=5)
    started = time.monotonic()
    try:
        await pusher.update(model.named_parameters(), global_steps=steps)
        out["died"] = "no error"
    except WeightSyncError as exc:
        out["died"] = f"{type(exc).__name__}: {exc}"
    out["died_after_s"] = time.monotonic() - started


async def run(
    out: dict[str, Any],
    engine: Any,
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    args: argparse.Namespace,
) -> None:
    from engine_helpers import greedy

    from asyncroll import DistributedWeightPusher

    pusher = DistributedWeightPusher([engine] if engine is not None else [], timeout=args.timeout)
    sharded = all(type(p).__name__ == "DTensor" for _, p in model_a.named_parameters())
    out["sharded"] = sharded
    out["gathers_match"] = gathers_match(model_a)
    out["blocks_differ"] = blocks_match(model_a)
    for steps, model, tag in ((1, model_a, "a"), (2, model_b, "b"), (3, model_a, "a_again")):
        # A again in layouts no piece maps (pushed whole: gathered by full_tensor()): the
        # head on a 2-D mesh (HSDP's replicate x shard), the embedding sharded by columns.
        named = other_layouts(model, out) if tag == "a_again" else model.named_parameters()
        report = await pusher.update(named, global_steps=steps)
        if engine is not None:
            out[f"on_{tag}"] = await greedy(engine, f"on-{tag}")
            delivery = report.deliveries[engine.name]
            out[f"delivery_{tag}"] = [delivery.workers, delivery.tensors, delivery.verified]
        out[f"report_{tag}"] = [report.global_steps, report.tensors, report.push is not None]
    # B again, with two tensors forced to travel as pieces, which these workers (layerwise
    # loads, no load plan) cannot load: q_proj as each rank's rows, o_proj as the column blocks
    # the ranks exchange (one batch of sends and receives, counted). Every rank pushes whole
    # tensors again.
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    columns = dict(model_b.named_parameters())[o_proj].shape[1]
    forced = {"model.layers.0.self_attn.q_proj.weight": None,
              o_proj: [(0, columns // 2), (columns // 2, columns)]}
    with counting(dist, "batch_isend_irecv") as exchanges, pieces_forced(forced):
        report = await pusher.update(model_b.named_parameters(), global_steps=4)
    out["retried"] = [report.global_steps, sorted(pusher.pieces), dict(report.pieces)]
    out["exchanges"] = exchanges[0]
    if engine is not None:
        out["on_b_retried"] = await greedy(engine, "on-b-retried")
    # A and B through the split layout's transport: each rank's own push group
    engines = [engine] if engine is not None else []
    split = await split_pushes(out, engines, model_a, model_b, steps=5, args=args)
    await split.aclose()
    fan_in = await split_pushes(out, engines, model_a, model_b, steps=7, args=args, fan_in=True)
    await fan_in.aclose()
    # The staged pusher again: it attaches the engine again (the push groups had it), and
    # its push of A lands; then rank 1 dies in its push of B.
    report = await pusher.update(model_a.named_parameters(), global_steps=9)
    out["back_report"] = [report.global_steps, report.tensors]
    if engine is not None:
        out["back_on_a"] = await greedy(engine, "back-on-a")
        out["back_steps"] = engine.global_steps
    await push_as_one_dies(out, pusher, model_b, steps=10, dying=1, record=args.out)
    if engine is not None:
        out["steps_after"] = engine.global_steps
        out["after_death"] = await greedy(engine, "after-death")
        out["dead"] = engine.is_dead


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-a", required=True)
    parser.add_argument("--model-b", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--family", default="qwen2", help="a mixture: the fused-experts run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
    )
    result = asyncio.run(main(args))
    if args.die_rank != args.rank:
        Path(args.out).write_text(json.dumps(result))
    os._exit(0)  # the other rank is gone: no collective teardown
