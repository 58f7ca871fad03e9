"""Trainer side of a weight update: one push, broadcast to every engine, versioned.

``WeightPusher`` owns one ``WeightSender`` whose receivers are the workers of every attached
engine (vLLM's native protocol: ``init_weight_transfer_engine`` once, then per update
``start_weight_update``, ``update_weights``, ``finish_weight_update(weight_version=...)``).

Invariants:
- An update is checked before any engine pauses: ``global_steps`` (a non-negative int within
  vLLM's range, never lower than an engine's), the names, shapes and dtypes against the
  checkpoint each engine was started from, and finite values (``asyncroll.update_check``). A bad
  update raises ``InvalidRequestError`` and touches nothing.
- A push never reaches an engine whose weights are asleep, and versions never go backwards.
- An engine's version label changes only when its push succeeded. Once an update has started in
  the workers, any failure or cancellation ends it there (``asyncroll_abort_weight_update``):
  each engine serves its previous weights (a backup was restored) or holds, admitting nothing
  until a push succeeds; ``WeightSyncError`` says which. Never a mix.
- Every wait is bounded by ``timeout``: a worker that dies mid-push fails the update, not hangs it.
- After the new weights are in, the prefix cache is reset and the reset is checked: no KV
  computed with old weights is served as a cache hit.
- Engines paused here are resumed here, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from asyncroll.errors import InvalidRequestError, WeightSyncError
from asyncroll.transport import CudaIpcBackend, PushReport, ShmBackend, WeightSender
from asyncroll.transport.sender import open_weight_sender
from asyncroll.update_check import Schema, check_update, read_checkpoint_schema

if TYPE_CHECKING:
    from asyncroll.engine import VLLMEngine

__all__ = ["MAX_GLOBAL_STEPS", "UpdateReport", "WeightPusher", "check_global_steps"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_BUCKET_BYTES = {"shm": 64 << 20, "cuda_ipc": 512 << 20}
"""Staging-buffer size by backend: 64 MiB saturates a CPU memcpy; on a GPU a bucket has a fixed
cost of about half a millisecond (a round trip with Python on both ends), so buckets are larger
(docs/benchmarks.md: 512 MiB reaches 1.5-3x the rate of 128 MiB on an H100)."""


MAX_GLOBAL_STEPS = 2**63 - 1
"""Versions travel as signed 64-bit integers (msgpack to the workers)."""


def check_global_steps(global_steps: object) -> int | None:
    """Return ``global_steps`` if it is None or a non-negative int vLLM can carry, else raise."""
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int):
        raise InvalidRequestError(
            f"global_steps must be an int or None, not {type(global_steps).__name__} "
            f"({global_steps!r})"
        )
    if not 0 <= global_steps <= MAX_GLOBAL_STEPS:
        raise InvalidRequestError(
            f"global_steps must be in [0, 2**63 - 1], got {global_steps}"
        )
    return global_steps


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """Where the time of one weight update went (seconds), pause to resume."""

    global_steps: int | None
    engines: int
    seconds: float
    pause_seconds: float
    push_seconds: float
    finish_seconds: float
    cache_reset_seconds: float
    resume_seconds: float
    push: PushReport | None


class WeightPusher:
    """Pushes a trainer's named tensors into a set of vLLM engines at once."""

    def __init__(
        self,
        engines: Sequence[VLLMEngine],
        *,
        bucket_bytes: int | None = None,
        backend: Literal["auto", "shm", "cuda_ipc"] = "auto",
        backup: bool | None = None,
        timeout: float = 120.0,
        fail_on: str = "",
        load: Literal["auto", "layerwise", "direct"] = "auto",
        check_finite: bool = True,
        strict_dtype: bool = False,
    ) -> None:
        """Args:
            engines: Engines launched with asyncroll's weight-transfer backend (the default).
            bucket_bytes: Size of each of the two staging buffers (default by backend:
                ``DEFAULT_BUCKET_BYTES``).
            backend: ``shm`` (CPU tensors), ``cuda_ipc`` (GPU tensors), or by the tensors.
            backup: Keep a copy of the weights during a push so a failed push restores them
                (default: on for CPU machines, off with CUDA where it would double memory).
            timeout: Bound on every wait for a peer.
            fail_on: Test hook: the workers fail loading the tensor of this name.
            load: How workers load: ``layerwise`` (vLLM's layerwise reload: any model, and the
                only way on the CPU build) or ``direct`` (``model.load_weights`` in place, as
                verl and slime do on GPU: unquantized models on GPU). ``auto``: direct with
                CUDA, layerwise without.
            check_finite: Refuse tensors holding NaN or inf before any engine pauses (one
                reduction a tensor; ``bench/check_cost.py`` measures it).
            strict_dtype: Refuse any tensor whose dtype is not the dtype the engines serve
                (by default a floating tensor of another width is cast, as vLLM's loaders do).
        """
        if backend not in ("auto", "shm", "cuda_ipc"):
            raise InvalidRequestError(f"backend must be auto, shm or cuda_ipc, not {backend!r}")
        if load not in ("auto", "layerwise", "direct"):
            raise InvalidRequestError(f"load must be auto, layerwise or direct, not {load!r}")
        self._engines = list(engines)
        self._bucket_bytes = bucket_bytes
        self._backend_name = backend
        self._backup = backup
        self._timeout = timeout
        self._fail_on = fail_on
        self._load = load
        self._check_finite = check_finite
        self._strict_dtype = strict_dtype
        self._schemas: dict[str, Schema | None] = {}
        if load == "auto":
            self._load = "direct" if torch.cuda.is_available() else "layerwise"
        self._stack: contextlib.AsyncExitStack | None = None
        self._sender: WeightSender | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<WeightPusher engines={[e.name for e in self._engines]} sender={self._sender!r}>"

    @property
    def sender(self) -> WeightSender | None:
        return self._sender

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        global_steps: int | None,
        mode: Literal["abort", "keep"] = "abort",
    ) -> UpdateReport:
        """Pause, push to every engine at once, label ``global_steps``, reset caches, resume.

        Raises:
            EngineSleepingError: an engine's weights are asleep; nothing was pushed.
            InvalidRequestError: ``global_steps`` is lower than an engine's current one.
            WeightSyncError: the push failed; every engine keeps its previous version.
        """
        global_steps = check_global_steps(global_steps)
        tensors = _materialize(named_tensors)
        async with self._lock:
            self._check(global_steps)
            await self._check_tensors(tensors)
            started = time.perf_counter()
            marks = [started]
            pausable = [engine for engine in self._engines if not engine.is_asleep]
            try:
                paused = await asyncio.gather(
                    *(e.pause(mode, clear_cache=True) for e in pausable), return_exceptions=True
                )
                for outcome in paused:
                    if isinstance(outcome, BaseException):
                        raise outcome
                marks.append(time.perf_counter())
                push = await self._push(tensors, global_steps)
                marks.append(time.perf_counter())
                # The new weights are in: label them and reset the caches even if our caller
                # is cancelled meanwhile (new weights under the old label would be a lie).
                await _shielded(self._commit(global_steps, marks))
            finally:
                await asyncio.gather(*(e.resume() for e in pausable), return_exceptions=True)
            marks.append(time.perf_counter())
        steps = [b - a for a, b in itertools.pairwise(marks)]
        return UpdateReport(
            global_steps=global_steps,
            engines=len(self._engines),
            seconds=marks[-1] - started,
            pause_seconds=steps[0],
            push_seconds=steps[1],
            finish_seconds=steps[2],
            cache_reset_seconds=steps[3],
            resume_seconds=steps[4],
            push=push,
        )

    async def aclose(self) -> None:
        """Close the sender (receivers release their mappings first). Idempotent."""
        stack, self._stack, self._sender = self._stack, None, None
        if stack is None:
            return
        # The workers' receivers say goodbye (releasing their mappings) while the sender waits;
        # engines that another pusher attached to since are that pusher's to release.
        live = [e for e in self._engines if not e.is_dead and e._attached_pusher is self]
        await asyncio.gather(
            stack.aclose(),
            *(_shutdown_receivers(engine) for engine in live),
            return_exceptions=True,
        )

    # -- internals -------------------------------------------------------------------------

    async def _commit(self, global_steps: int | None, marks: list[float]) -> None:
        for engine in self._engines:
            engine._release_hold()
        await asyncio.gather(*(_finish(e, global_steps) for e in self._engines))
        for engine in self._engines:
            if global_steps is not None:
                engine._set_global_steps(global_steps)
            await engine._mark_version_boundary(engine.global_steps)
        marks.append(time.perf_counter())
        await asyncio.gather(*(_reset_prefix_cache(e) for e in self._engines))
        marks.append(time.perf_counter())

    async def _check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Names, shapes, dtypes and finite values, against every engine's checkpoint (in a
        thread: the finite check reads every byte)."""
        for engine in self._engines:
            if engine.model_path not in self._schemas:
                self._schemas[engine.model_path] = read_checkpoint_schema(engine.model_path)
        served = {e.model_path: _served_dtype(e) for e in self._engines}
        for index, (path, schema) in enumerate(self._schemas.items()):
            if path in served:
                await asyncio.to_thread(
                    check_update,
                    tensors,
                    schema,
                    served_dtype=served[path],
                    strict_dtype=self._strict_dtype,
                    check_finite=self._check_finite and index == 0,
                )

    def _check(self, global_steps: int | None) -> None:
        for engine in self._engines:
            engine.check_weights_awake()
            current = engine.global_steps
            if global_steps is not None and current is not None and global_steps < current:
                raise InvalidRequestError(
                    f"global_steps {global_steps} is lower than {engine.name}'s {current}: "
                    "versions never go backwards"
                )

    async def _push(self, tensors: dict[str, torch.Tensor], global_steps: int | None) -> PushReport:
        sender = await self._connected(tensors)
        version = global_steps if global_steps is not None else -1
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info={"version": version})
        try:
            await asyncio.gather(*(self._start(e) for e in self._engines))
            return await self._transfer(sender, tensors, version, request)
        except BaseException as exc:
            held = await _shielded(self._abort_all())
            outcome = (
                "every engine serves its previous weights"
                if not held
                else f"{', '.join(held)} hold partly loaded weights (no backup) and take no "
                "requests until a push succeeds; any other engine serves its previous weights"
            )
            error = WeightSyncError(
                f"weight push (global_steps={global_steps}) failed; {outcome}: "
                f"{_describe([exc])}"
            )
            for engine in self._engines:
                if engine.name in held:
                    engine._hold(str(error))
            if not isinstance(exc, Exception):
                raise  # cancelled: every engine is whole or holding, as above
            raise error from exc

    async def _transfer(
        self, sender: WeightSender, tensors: dict[str, torch.Tensor], version: int, request: Any
    ) -> PushReport:
        """The push and every engine's receive, failing as soon as any of them fails (a dead
        worker's engine fails its call long before the sender's ack deadline)."""
        push = asyncio.ensure_future(sender.push(tensors, version=version))
        loads = [asyncio.ensure_future(e.llm.update_weights(request)) for e in self._engines]
        tasks = [push, *loads]
        try:
            async with asyncio.timeout(self._timeout * 2):
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in done if not t.cancelled() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()  # type: ignore[misc]
            return push.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _abort_all(self) -> list[str]:
        """End the update in every engine's workers; the names of engines left holding."""
        async def abort(engine: VLLMEngine) -> bool:
            if engine.is_dead:
                return True  # nothing to serve from
            try:
                async with asyncio.timeout(self._timeout):
                    whole = await engine.llm.collective_rpc("asyncroll_abort_weight_update")
                return all(whole)
            except Exception:
                logger.exception("%s: could not end the failed update", engine.name)
                return False

        whole = await asyncio.gather(*(abort(e) for e in self._engines))
        return [e.name for e, ok in zip(self._engines, whole, strict=True) if not ok]

    async def _connected(self, tensors: Mapping[str, torch.Tensor]) -> WeightSender:
        """The sender, attached to every engine's workers. An engine holds one receiver: if
        another pusher attached to it since, this one closes its sender and attaches again."""
        if self._sender is not None:
            if all(engine._attached_pusher is self for engine in self._engines):
                return self._sender
            stack, self._stack, self._sender = self._stack, None, None
            if stack is not None:
                await stack.aclose()
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        on_gpu = any(t.is_cuda for t in tensors.values())
        use_cuda = self._backend_name == "cuda_ipc" or (self._backend_name == "auto" and on_gpu)
        backend = CudaIpcBackend(next(iter(tensors.values())).device) if use_cuda else ShmBackend()
        workers = sum(_world_size(e) for e in self._engines)
        stack = contextlib.AsyncExitStack()
        sender = await stack.enter_async_context(
            open_weight_sender(
                backend=backend,
                bucket_bytes=self._bucket_bytes or DEFAULT_BUCKET_BYTES[backend.name],
                receivers=workers,
                connect_timeout=self._timeout,
                ack_timeout=self._timeout,
            )
        )
        try:
            config = sender.receiver_config()
            backup = (not torch.cuda.is_available()) if self._backup is None else self._backup
            await asyncio.gather(*(_bind(e) for e in self._engines))
            await asyncio.gather(
                sender.wait_receivers(workers),
                *(
                    e.llm.init_weight_transfer_engine(
                        WeightTransferInitRequest(
                            init_info={
                                **config,
                                "name": e.name,
                                "backup": backup,
                                "fail_on": self._fail_on,
                                "load": self._load,
                            }
                        )
                    )
                    for e in self._engines
                ),
            )
        except BaseException as exc:
            await stack.aclose()
            if isinstance(exc, Exception):
                raise WeightSyncError(f"engines could not attach to the sender: {exc}") from exc
            raise
        self._stack, self._sender = stack, sender
        for engine in self._engines:
            engine._attached_pusher = self
        return sender

    async def _start(self, engine: VLLMEngine) -> None:
        if not _worker_runs_the_session():  # the weight-transfer engine runs it (0.32+)
            await engine.llm.start_weight_update()
        else:  # vLLM 0.24's worker starts the layerwise reload itself unless told otherwise
            start: Any = engine.llm.start_weight_update
            await start(is_checkpoint_format=self._load == "layerwise")


@functools.cache
def _worker_runs_the_session() -> bool:
    """vLLM 0.24: the worker starts and finishes updates; 0.32+ leave it to the engine."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return not hasattr(WeightTransferEngine, "start_weight_update")


async def _finish(engine: VLLMEngine, global_steps: int | None) -> None:
    if engine.native_versions:
        label = None if global_steps is None else str(global_steps)
        await engine.llm.finish_weight_update(weight_version=label)
    else:  # vLLM 0.24 labels nothing; the adapter does (see asyncroll.engine)
        await engine.llm.finish_weight_update()


async def _bind(engine: VLLMEngine) -> None:
    """vLLM 0.24 builds weight-transfer engines without the configs a rollback needs; the RPC
    supplies them where they are missing (the worker checks, not a version guess here)."""
    await engine.llm.collective_rpc("asyncroll_bind_weight_transfer_engine")


async def _shutdown_receivers(engine: VLLMEngine) -> None:
    shutdown = getattr(engine.llm, "shutdown_weight_transfer_engine", None)
    if shutdown is not None:
        await shutdown()
    else:  # vLLM 0.24 has no such call: our worker extension does it
        await engine.llm.collective_rpc("asyncroll_shutdown_weight_transfer_engine")


async def _reset_prefix_cache(engine: VLLMEngine) -> None:
    if not await engine.llm.reset_prefix_cache():
        raise WeightSyncError(
            f"{engine.name}: the prefix cache could not be reset after the weight update; "
            "cached KV of the old weights could be served"
        )


def _materialize(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if name in tensors:
            raise InvalidRequestError(f"tensor {name!r} is given twice")
        tensors[name] = tensor.detach()
    if not tensors:
        raise InvalidRequestError("no tensors to push")
    return tensors


async def _shielded(awaitable: Awaitable[_T]) -> _T:
    """Run ``awaitable`` to completion even if our caller is cancelled meanwhile; then let the
    cancellation propagate."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


def _served_dtype(engine: VLLMEngine) -> torch.dtype:
    dtype = engine.llm.model_config.dtype  # resolved to a torch.dtype once vLLM started
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"{engine.name}: vLLM reports no served dtype ({dtype!r})")
    return dtype


def _world_size(engine: VLLMEngine) -> int:
    parallel: Any = engine.llm.vllm_config.parallel_config
    return int(parallel.world_size)


def _describe(failures: Sequence[BaseException]) -> str:
    return "; ".join(f"{type(f).__name__}: {f}" for f in failures[:3])
