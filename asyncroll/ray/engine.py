"""``RayEngine``: a ``VLLMEngine`` in a Ray actor, spoken to through the same engine protocols.

The actor (``EngineHost``) hosts an ordinary ``VLLMEngine``, so validation, the admission gate,
pause and resume, version labels and error mapping all run next to vLLM. ``RayEngine`` is the
caller's half: it awaits the actor's methods (``await ref``; never ``ray.get`` in async code) and
mirrors the little state the protocols read synchronously (version, pause, sleep, hold, counts).

Invariants:
- An error the actor's engine raises reaches the caller as itself (``InvalidRequestError``,
  ``EngineGenerateError``, ...), unwrapped from Ray's ``RayTaskError``.
- A dead or unreachable actor is an ``EngineDeadError`` on the call that found it, and the
  engine stays dead (``is_dead``): the manager stops routing to it and resumes its requests on
  the others.
- Cancelling a ``generate`` aborts the request in the actor's engine before re-raising.
- Weight pushes reach the actor's workers as they reach a local engine's: ``attach`` hands the
  sender's config over, and the workers connect to the sender's sockets and shared memory (same
  host) directly; the push's bytes never pass through Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncroll.errors import EngineDeadError, EngineSleepingError
from asyncroll.types import Delivery, EngineStatistics, PauseMode, Segment

__all__ = ["EngineHost", "RayEngine"]

logger = logging.getLogger(__name__)


class EngineHost:
    """The actor's body: one ``VLLMEngine``. Made by ``RayEngine.start``."""

    def __init__(self) -> None:
        self.engine: Any = None

    async def start(self, model_path: str, name: str, global_steps: int | None,
                    engine_args: dict[str, Any]) -> dict[str, Any]:
        from asyncroll.vllm.engine import VLLMEngine

        self.engine = await VLLMEngine.start(model_path, name=name, global_steps=global_steps,
                                             **engine_args)
        engine = self.engine
        return {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                "has_tokenizer": engine.has_tokenizer, "model_path": engine.model_path,
                "num_workers": engine.num_workers, "served_dtype": engine.served_dtype,
                "pid": os.getpid()}

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       sampling_params: Mapping[str, Any] | None) -> Segment:
        segment: Segment = await self.engine.generate(request_id, prompt_ids=prompt_ids,
                                                      sampling_params=sampling_params)
        return segment

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An async method of the engine."""
        return await getattr(self.engine, method)(*args, **kwargs)

    def call_sync(self, method: str, *args: Any) -> Any:
        """A plain method of the engine (``hold``, ``release_hold``, ``statistics``)."""
        return getattr(self.engine, method)(*args)

    async def attach(self, config: dict[str, Any]) -> None:
        await self.engine.attach(config, owner=self)

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()


class RayEngine:
    """An engine in a Ray actor, for ``AsyncServerManager`` like any local one.

    ```python
    ray.init(num_cpus=8)
    async with RayEngine.launch(model_dir, actor_options={"num_cpus": 1}) as remote, \\
            VLLMEngine.launch(model_dir) as local, \\
            AsyncServerManager([local, remote]) as manager:
        ...
    ```
    """

    def __init__(self, actor: Any, info: Mapping[str, Any], *, name: str,
                 global_steps: int | None) -> None:
        self.actor = actor
        self.name = name
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.model_path: str = info["model_path"]
        self.actor_pid: int = info["pid"]
        self._has_tokenizer: bool = info["has_tokenizer"]
        self._num_workers: int = info["num_workers"]
        self._served_dtype: torch.dtype = info["served_dtype"]
        self._global_steps = global_steps
        self._dead: BaseException | None = None
        self._closed = False
        self._paused = False
        self._asleep_weights = False
        self._asleep = False
        self._holding: str | None = None
        self._attached_to: object | None = None
        self._in_flight = 0
        self._num_requests = 0
        self._num_aborted = 0
        self._num_rejected = 0
        self._gate = asyncio.Event()
        """Open while requests may enter (not paused, asleep or holding), as the actor's engine
        gates admission; mirrored here so that ``in_flight`` counts admitted requests."""
        self._gate.set()
        self._pending: set[asyncio.Future[Any]] = set()
        """Fire-and-forget calls (``hold``, aborts of cancelled calls), kept until done."""

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, model_path: str | os.PathLike[str], *, name: str | None = None,
                     global_steps: int | None = 0, actor_options: Mapping[str, Any] | None = None,
                     **engine_args: Any) -> AsyncIterator[RayEngine]:
        """Start a ``RayEngine`` and close it (and its actor) on exit; see ``start``."""
        engine = await cls.start(model_path, name=name, global_steps=global_steps,
                                 actor_options=actor_options, **engine_args)
        try:
            yield engine
        finally:
            await engine.aclose()

    @classmethod
    async def start(cls, model_path: str | os.PathLike[str], *, name: str | None = None,
                    global_steps: int | None = 0, actor_options: Mapping[str, Any] | None = None,
                    **engine_args: Any) -> RayEngine:
        """Start an actor hosting a ``VLLMEngine`` on ``model_path``.

        Args:
            model_path: The model folder, as the actor's node sees it.
            name: A name for logs, routing statistics and the actor.
            global_steps: The trainer step the starting weights belong to.
            actor_options: Ray's ``.options(...)`` for the actor: ``num_cpus``, ``num_gpus``,
                ``resources``, ``scheduling_strategy`` (a placement group bundle, a node).
            **engine_args: vLLM ``AsyncEngineArgs``, as for ``VLLMEngine.launch``.

        Raises:
            EngineStartError: vLLM could not start in the actor (the actor is killed).
            RuntimeError: Ray is not initialised (``ray.init()`` first).
        """
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayEngine needs a Ray cluster: call ray.init() first")
        name = name or f"ray-engine-{os.urandom(3).hex()}"
        options = {"num_cpus": 0, "max_concurrency": 1000, **(actor_options or {})}
        host: Any = ray.remote(EngineHost)
        actor = host.options(**options).remote()
        try:
            info = await _unwrapped(actor.start.remote(str(model_path), name, global_steps,
                                                       dict(engine_args)))
        except BaseException:
            ray.kill(actor)
            raise
        engine = cls(actor, info, name=name, global_steps=global_steps)
        logger.info("started %r", engine)
        return engine

    def __repr__(self) -> str:
        state = "dead" if self.is_dead else "asleep" if self._asleep else (
            "paused" if self._paused else "holding" if self._holding else "running")
        return (f"<RayEngine {self.name} {state} in_flight={self._in_flight} "
                f"global_steps={self._global_steps} actor_pid={self.actor_pid}>")

    # -- what the protocols read synchronously ------------------------------------------------

    @property
    def global_steps(self) -> int | None:
        return self._global_steps

    @property
    def is_dead(self) -> bool:
        return self._closed or self._dead is not None

    @property
    def is_asleep(self) -> bool:
        return self._asleep

    @property
    def has_tokenizer(self) -> bool:
        return self._has_tokenizer

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def served_dtype(self) -> torch.dtype:
        return self._served_dtype

    @property
    def attached_to(self) -> object | None:
        return self._attached_to

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            in_flight=self._in_flight, paused=self._paused, asleep=self._asleep,
            dead=self.is_dead, global_steps=self._global_steps,
            num_requests=self._num_requests, num_aborted=self._num_aborted,
            num_rejected=self._num_rejected, holding=self._holding is not None,
        )

    async def remote_statistics(self) -> EngineStatistics:
        """The actor's engine's own statistics."""
        stats: EngineStatistics = await self._remote(self.actor.call_sync.remote("statistics"))
        return stats

    async def remote_unfinished(self) -> int:
        """Requests the actor's vLLM still tracks (0 once aborts have landed)."""
        count: int = await self._remote(self.actor.call_sync.remote("num_unfinished_in_vllm"))
        return count

    def check_weights_awake(self) -> None:
        self._check_alive()
        if self._asleep_weights:
            raise EngineSleepingError(
                f"{self.name} is asleep: wake_up(['weights']) before pushing weights")

    # -- Engine ----------------------------------------------------------------------------

    async def generate(self, request_id: str, *, prompt_ids: Sequence[int],
                       sampling_params: Mapping[str, Any] | None = None) -> Segment:
        """Generate one segment in the actor's engine (see ``VLLMEngine.generate``)."""
        self._check_alive()
        await self._gate.wait()
        self._check_alive()
        self._in_flight += 1
        self._num_requests += 1
        try:
            ref = self.actor.generate.remote(request_id, prompt_ids, sampling_params)
            try:
                segment: Segment = await self._remote(ref)
            except asyncio.CancelledError:
                await _cancelled(ref)
                raise
        except EngineDeadError:
            raise
        except ValueError:
            self._num_rejected += 1
            raise
        finally:
            self._in_flight -= 1
        if segment.finish_reason == "abort":
            self._num_aborted += 1
        return segment

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids and not self.is_dead:
            await self._remote(self.actor.call.remote("abort", ids))

    async def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = True) -> None:
        self._paused = True
        self._gate.clear()
        await self._remote(self.actor.call.remote("pause", mode, clear_cache=clear_cache))

    async def resume(self) -> None:
        await self._remote(self.actor.call.remote("resume"))
        self._paused = False
        self._open_gate_if_ready()

    async def aclose(self) -> None:
        """Close the actor's engine, then end the actor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.set()  # waiters wake and find the engine closed
        import ray

        if self._dead is None:
            with contextlib.suppress(Exception):
                await _unwrapped(self.actor.aclose.remote())
        ray.kill(self.actor)
        for pending in list(self._pending):
            pending.cancel()
        logger.info("closed %s", self.name)

    # -- UpdatableEngine and ReceivingEngine ---------------------------------------------------

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        self._gate.clear()
        self._asleep = self._asleep_weights = True
        await self._remote(self.actor.call.remote("sleep", level, mode=mode))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._remote(self.actor.call.remote("wake_up", list(tags) if tags else tags))
        stats = await self.remote_statistics()
        self._asleep = stats.asleep
        if tags is None or "weights" in tags:
            self._asleep_weights = False
        self._open_gate_if_ready()

    def hold(self, reason: str) -> None:
        self._holding = reason
        self._gate.clear()
        self._fire(self.actor.call_sync.remote("hold", reason))

    def release_hold(self) -> None:
        self._holding = None
        self._fire(self.actor.call_sync.remote("release_hold"))
        self._open_gate_if_ready()

    async def commit_version(self, global_steps: int | None) -> None:
        await self._remote(self.actor.call.remote("commit_version", global_steps))
        if global_steps is not None:
            self._global_steps = global_steps

    async def reset_prefix_cache(self) -> None:
        await self._remote(self.actor.call.remote("reset_prefix_cache"))

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        await self._remote(self.actor.attach.remote(dict(config)))
        self._attached_to = owner

    async def detach(self) -> None:
        self._attached_to = None
        await self._remote(self.actor.call.remote("detach"))

    async def begin_update(self, *, load: str) -> None:
        await self._remote(self.actor.call.remote("begin_update", load=load))

    async def receive(self, version: int) -> None:
        await self._remote(self.actor.call.remote("receive", version))

    async def end_failed_update(self) -> bool:
        whole: bool = await self._remote(self.actor.call.remote("end_failed_update"))
        return whole

    async def last_delivery(self) -> Delivery | None:
        delivery: Delivery | None = await self._remote(self.actor.call.remote("last_delivery"))
        return delivery

    # -- internals -------------------------------------------------------------------------

    def _open_gate_if_ready(self) -> None:
        if not self._paused and not self._asleep and self._holding is None:
            self._gate.set()

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(f"{self.name} is closed")
        if self._dead is not None:
            raise EngineDeadError(f"{self.name} is dead: its actor is gone") from self._dead

    async def _remote(self, ref: Awaitable[Any]) -> Any:
        self._check_alive()
        try:
            return await _unwrapped(ref)
        except EngineDeadError as exc:
            self._dead = exc
            raise

    def _fire(self, ref: Any) -> None:
        """Send a call whose result nobody awaits; its failure is logged, not lost."""
        future = asyncio.ensure_future(_unwrapped(ref))
        self._pending.add(future)
        future.add_done_callback(self._fired)

    def _fired(self, future: asyncio.Future[Any]) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.warning("%s: a background call failed: %r", self.name, future.exception())


async def _cancelled(ref: Any) -> None:
    """Cancel an actor call (its engine aborts the request) and wait until it has ended, so
    its request id is free again when the caller's cancellation goes on."""
    import ray

    ray.cancel(ref)
    ended = asyncio.ensure_future(_settled(ref))
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(ended)


async def _settled(ref: Any) -> None:
    with contextlib.suppress(Exception):
        await ref


async def _unwrapped(ref: Awaitable[Any]) -> Any:
    """Await an actor call; the engine's own error comes back as itself, a lost actor as
    ``EngineDeadError``."""
    import ray.exceptions

    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, Exception):
            raise cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        raise EngineDeadError(f"the engine's Ray actor is gone: {exc}") from exc
