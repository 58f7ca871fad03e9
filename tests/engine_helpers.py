"""Helpers shared by the engine tests (a module, so every test sees the same state).

Importing it loads neither vLLM nor the fault-injecting worker (which imports vLLM): a module
that mixes pure tests with engine tests imports it at its top, and a run of the pure tests
alone stays free of vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file

from asyncroll import AsyncServerManager, UpdateReport, VLLMEngine, WeightPusher
from asyncroll.interfaces import Engine
from asyncroll.testing.contract import requests_inside

if TYPE_CHECKING:
    from asyncroll.testing.faults import FaultPoint

_PUSHERS: dict[str, WeightPusher] = {}
"""One pusher per engine (by name), made on its first update, kept attached across tests as
an engine's own pusher used to be, and closed with the shared engines (``close_pushers``)."""


async def update_weights(
    engine: VLLMEngine,
    named_tensors: Any,
    *,
    global_steps: int | None,
    mode: Any = "abort",
    changed: bool = False,
) -> UpdateReport:
    """Update one engine through its pusher (``WeightPusher([engine]).update``)."""
    pusher = _PUSHERS.get(engine.name)
    if pusher is None or pusher.engines != [engine]:
        if pusher is not None:
            await pusher.aclose()
        pusher = _PUSHERS[engine.name] = WeightPusher([engine])
    return await pusher.update(
        named_tensors, global_steps=global_steps, mode=mode, changed=changed
    )


def pusher_of(engine: VLLMEngine) -> WeightPusher:
    """The pusher ``update_weights`` updates ``engine`` through (after its first update)."""
    return _PUSHERS[engine.name]


async def close_pushers() -> None:
    """Close every pusher ``update_weights`` made."""
    pushers = list(_PUSHERS.values())
    _PUSHERS.clear()
    await asyncio.gather(*(pusher.aclose() for pusher in pushers), return_exceptions=True)


PROBE_PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 12, [7, 1, 7, 1, 7]]
"""Prompts whose greedy continuations identify the weights an engine serves."""

PROMPT_PARAMS: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True}

HANG = 300.0
"""Seconds an HTTP client in a test waits for an answer: a guard against a hang, never a
deadline a busy machine could meet (httpx's default is 5 s)."""

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 512,
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "worker_extension_cls": "asyncroll.testing.faults.FaultInjectingExtension",
    "num_gpu_blocks_override": 1024,
    "enforce_eager": not torch.cuda.is_available(),
}
"""How every test engine starts (with the fault-injection extension of asyncroll.testing.faults,
for the tests that inject failures). float32, not the adapter's bf16 default: tests compare greedy
outputs token for token across batches, resumes (a re-prefill computes the KV with other kernels
than decoding did) and engines, and a random tiny model's logits have near-ties that bf16 rounding
flips; float32 keeps the comparisons about our code, not about rounding. No tokenizer: the tiny
models carry one (for the gateway, which tokenizes in our process), the engines stay token-in,
token-out. 1024 KV blocks of 128 tokens (131k tokens, 128 MiB, where VLLM_CPU_KVCACHE_SPACE's
least, 1 GiB, makes 8192): far more than a test holds at once, and 0.9 GB less a worker, so that
runs that start engines side by side fit in memory. The extension is named, not imported (its
module imports vLLM); the shared engines' fixture checks the name against
``asyncroll.testing.faults.FAULTS_EXTENSION``. Eager on the CPU build (no ``torch.compile`` of
the model): the compile is half an engine's start on the 2-core machine (36 s against 16-19 s
eager, measured 2026-11-29), and every test engine starts alike, so their outputs still
compare. On a GPU the tests keep CUDA graphs: an update must leave them valid."""

ENGINE_ARGS.update(json.loads(os.environ.get("ASYNCROLL_TEST_ENGINE_ARGS", "{}")))
"""More engine arguments from the environment (a GPU run sets ``async_scheduling``)."""

DOOMED_ARGS: dict[str, Any] = {**ENGINE_ARGS, "enforce_eager": True}
"""How an engine that its test kills starts: nothing it serves is compared token for token, so
vLLM's compile of the model (a third of a start, more on a busy machine) buys nothing."""

FRESH_GREEDY: dict[str, list[tuple[int, ...]]] = {}
"""Greedy outputs of each model, recorded on its engine before any push reached it."""


async def greedy(engine: VLLMEngine, tag: str, max_tokens: int = 24) -> list[tuple[int, ...]]:
    """Greedy continuations of the probe prompts."""
    outputs = []
    for i, prompt in enumerate(PROBE_PROMPTS):
        segment = await engine.generate(
            f"greedy-{tag}-{i}",
            prompt_ids=prompt,
            sampling_params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        outputs.append(segment.token_ids)
    return outputs


def load_weights(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def selected_tests(request: pytest.FixtureRequest) -> list[str]:
    """The names of the run's selected tests in the module of ``request`` (a module fixture's),
    in order: what a fixture that starts engines ahead of its tests will be asked for."""
    module = request.node.nodeid
    return [
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if item.nodeid.startswith(module + "::")
    ]


async def start_engines(*specs: tuple[Path, str, Mapping[str, Any]]) -> list[VLLMEngine]:
    """Engines started together, each ``(model, name, engine arguments)``: two starts take about
    as long as one on the two-core machine (a start waits on its processes' imports and on one
    compile after another more than it computes). If one fails, the others are closed."""
    started = await asyncio.gather(
        *(VLLMEngine.start(model, name=name, **args) for model, name, args in specs),
        return_exceptions=True,
    )
    engines = [engine for engine in started if isinstance(engine, VLLMEngine)]
    if len(engines) < len(started):
        await asyncio.gather(*(engine.aclose() for engine in engines))
        raise next(error for error in started if isinstance(error, BaseException))
    return engines


class SpareEngines:
    """Fresh engines on one model for the tests that kill theirs, all started together on the
    first ``take``. A name taken again (its test run again after a ``LateAction``) gets an engine
    started then. A test closes the engine it took; ``aclose`` closes those never taken."""

    def __init__(self, model: Path, names: Sequence[str], args: Mapping[str, Any]) -> None:
        self._model, self._names, self._args = model, list(names), dict(args)
        self._starting: asyncio.Task[list[VLLMEngine]] | None = None
        self._taken: set[str] = set()

    async def take(self, name: str) -> VLLMEngine:
        if self._starting is None:
            specs = [(self._model, each, self._args) for each in self._names]
            self._starting = asyncio.create_task(start_engines(*specs))
        if name in self._taken or name not in self._names:
            return await VLLMEngine.start(self._model, name=name, **self._args)
        self._taken.add(name)
        return (await self._starting)[self._names.index(name)]

    async def aclose(self) -> None:
        if self._starting is None:
            return
        try:
            engines = await self._starting
        except Exception:  # the tests that took them saw it
            return
        spare = [e for name, e in zip(self._names, engines, strict=True) if name not in self._taken]
        await asyncio.gather(*(engine.aclose() for engine in spare))


def inject_fault(
    engine: VLLMEngine,
    point: FaultPoint,
    **options: Any,
) -> AbstractAsyncContextManager[None]:
    """``asyncroll.testing.faults.inject_fault``, imported on the call (it imports vLLM)."""
    from asyncroll.testing.faults import inject_fault as inject

    return inject(engine, point, **options)




async def until_decoding(
    target: AsyncServerManager | Engine,
    num_requests: int | Sequence[asyncio.Future[Any]] | Callable[[], int],
) -> None:
    """Return once ``num_requests`` requests (routed by ``target``, or sent to it if it is an
    engine) are inside the engine and have each been decoded for several steps. Given the
    requests' tasks instead of a number, it waits for those not done (one that ends meanwhile,
    having run out its tokens, is no longer waited for); given a function, for as many as it
    returns at each look.

    Event-ordered, not timed: a "clock" request sent to an engine after its requests reached
    vLLM finishes only after they were all scheduled (vLLM schedules running requests first,
    in arrival order), so each has tokens by then. A clock sent before the requests arrive, or
    to another engine, proves nothing: a pause in our process (a full garbage collection) or an
    engine that gets less CPU lets the clock finish first.
    """
    while True:
        if isinstance(num_requests, int):
            needed = num_requests
        elif callable(num_requests):
            needed = num_requests()
        else:
            needed = sum(not task.done() for task in num_requests)
        if not needed:
            return
        if isinstance(target, AsyncServerManager):
            counts = target.statistics().in_flight_per_engine
            engines: tuple[Engine, ...] = target.engines
        else:
            counts = {target.name: needed}
            engines = (target,)
        busy = [engine for engine in engines if counts.get(engine.name)]
        if sum(counts.values()) >= needed and all(
            [await _arrived(engine, counts[engine.name]) for engine in busy]
        ):
            break
        await asyncio.sleep(0.005)
    await asyncio.gather(
        *(
            engine.generate(f"clock-{engine.name}", prompt_ids=[9], sampling_params=PROMPT_PARAMS)
            for engine in busy
        )
    )


async def _arrived(engine: Engine, count: int) -> bool:
    """Whether ``count`` requests are inside the engine's vLLM (past our adapter's admission
    gate; for a Ray engine, inside the actor's vLLM: the actor may run calls out of order, and
    the adapter counts a call before it is sent)."""
    return await requests_inside(engine) >= count  # a fake engine decodes what it admitted


async def hold(target: AsyncServerManager | Engine) -> None:
    """Freeze every request inside ``target``'s engines (vLLM's ``keep`` pause): none can finish
    until the update that follows pauses and resumes the engines itself.

    Call it after ``until_decoding`` when a test needs its requests still in flight at the
    update: the update's work before its own pause (a new manager opening its weight channel,
    weights read from disk) is otherwise a race against the requests' token budgets, which a
    fast machine loses (a CI run saw four 400-token requests finish first)."""
    engines = target.engines if isinstance(target, AsyncServerManager) else (target,)
    await asyncio.gather(*(engine.pause("keep") for engine in engines))


@asynccontextmanager
async def steps_held(engine: VLLMEngine) -> AsyncIterator[asyncio.Future[list[Any]]]:
    """The engine's step loop held inside the block: an RPC that waits between two steps
    (``asyncroll_hold_steps``) until the block ends. Yields that RPC (not done while held)."""
    held, release = asyncio.Event(), asyncio.Event()

    async def holder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(4) == b"held"
        held.set()
        await release.wait()
        writer.write(b"go")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(holder, "127.0.0.1", 0)
    hold = asyncio.ensure_future(engine.collective_rpc(
        "asyncroll_hold_steps", args=(server.sockets[0].getsockname()[1],)))
    try:
        await held.wait()
        yield hold
    finally:
        release.set()
        assert await hold == [True]
        server.close()


def free_port() -> int:
    """A TCP port free on this host now (for a torchrun rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
