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
- Weight pushes reach the actor's workers as they reach a local engine's: the weight port's
  ``attach`` (``RayWeightPort``) hands the
  sender's config over, and the workers connect to the sender's sockets and shared memory (same
  host), or join its broadcast group (any host: ``WeightPusher(backend="broadcast")``)
  directly; the push's bytes never pass through Ray. A broadcast push ends in a verdict every
  rank shares, so the actor labels it as its receive returns (no round trip for the label).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncroll.admission import AdmissionGate, aborted_segment
from asyncroll.errors import (
    EngineDeadError,
    EngineSleepingError,
    EngineStartError,
    InvalidRequestError,
)
from asyncroll.interfaces import INFLIGHT_MODES, ResumeMode
from asyncroll.types import Delivery, EngineStatistics, PauseMode, Segment
from asyncroll.validation import (
    ENGINE_REQUEST_ID_LEN,
    check_commit,
    check_request_id,
    check_take,
    claimed,
    refuse_live,
)

__all__ = ["CANCEL_WAIT_S", "EngineHost", "RayEngine", "RayWeightPort"]

CANCEL_WAIT_S = 30.0
"""How long a cancelled call waits for the actor to confirm the call ended (a process
boundary's deadline; past it the cancellation goes on regardless)."""

logger = logging.getLogger(__name__)


class EngineHost:
    """The actor's body: one ``VLLMEngine``. Made by ``RayEngine.start``."""

    def __init__(self) -> None:
        self.engine: Any = None
        self._closed = asyncio.Event()
        self._labelling: asyncio.Future[None] | None = None
        """A label begun in ``take_update``: it runs to its end even if that call is
        cancelled, and every later call waits for it."""

    async def start(self, model_path: str, name: str, global_steps: int | None,
                    engine_args: dict[str, Any]) -> dict[str, Any]:
        from asyncroll.vllm.engine import VLLMEngine

        self.engine = await VLLMEngine.start(model_path, name=name, global_steps=global_steps,
                                             **engine_args)
        engine = self.engine
        return {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                "has_tokenizer": engine.has_tokenizer, "model_path": engine.model_path,
                "num_workers": engine.weights.num_workers,
                "served_dtype": engine.weights.served_dtype,
                "pid": os.getpid()}

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       sampling_params: Mapping[str, Any] | None) -> Segment:
        segment: Segment = await self.engine.generate(request_id, prompt_ids=prompt_ids,
                                                      sampling_params=sampling_params)
        return segment

    async def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """An async method of the engine (``weights.commit``: of its weight port); its result
        and the engine's state after it."""
        await self._labelled()
        started = time.perf_counter()
        return await _method(self.engine, method)(*args, **kwargs), self.state(started)

    def call_sync(self, method: str, *args: Any) -> tuple[Any, dict[str, Any]]:
        """A plain method of the engine (``weights.hold``, ``statistics``)."""
        started = time.perf_counter()
        return _method(self.engine, method)(*args), self.state(started)

    async def attach(self, config: dict[str, Any]) -> tuple[None, dict[str, Any]]:
        await self._labelled()
        started = time.perf_counter()
        await self.engine.weights.attach(config, owner=self)
        return None, self.state(started)

    async def take_update(self, version: int, label: bool, push: int = 0
                          ) -> tuple[Delivery | None, dict[str, Any]]:
        """The engine's ``weights.take``. With ``label`` (a broadcast push, whose take returns
        only once every rank of the group took its part: the push's verdict), also its
        ``weights.commit``, saving the round trip the label would take."""
        await self._labelled()
        started = time.perf_counter()
        delivery = await self.engine.weights.take(version, push=push)
        if label:
            global_steps = None if version < 0 else version
            self._labelling = asyncio.ensure_future(self.engine.weights.commit(global_steps))
            await asyncio.shield(self._labelling)
        return delivery, self.state(started)

    async def _labelled(self) -> None:
        labelling, self._labelling = self._labelling, None
        if labelling is not None:
            with contextlib.suppress(Exception):  # (take_update raised it)
                await labelling

    def state(self, started: float | None = None) -> dict[str, Any]:
        """What the proxy mirrors, read from the engine; with ``started``, also how long the
        call took in here (``actor_s``)."""
        actor_s = time.perf_counter() - started if started is not None else None
        engine = self.engine
        stats = engine.statistics()
        try:
            engine.check_weights_awake()
            weights_asleep = False
        except Exception:
            weights_asleep = True
        return {"paused": stats.paused, "asleep": stats.asleep, "holding": stats.holding,
                "weights_asleep": weights_asleep, "global_steps": engine.global_steps,
                "dead": engine.is_dead, "actor_s": actor_s}

    async def wait_closed(self) -> None:
        """Returns when the engine is closed; the proxy keeps one pending to see the actor
        die (the call then fails with Ray's actor error)."""
        await self._closed.wait()

    async def aclose(self) -> None:
        self._closed.set()
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
        self._global_steps = global_steps
        self._dead: BaseException | None = None
        self._closed = False
        self._paused = False
        self._asleep_weights = False
        self._asleep = False
        self._holding: str | None = None
        self._weights = RayWeightPort(self, num_workers=info["num_workers"],
                                      served_dtype=info["served_dtype"])
        self._in_flight = 0
        self._num_requests = 0
        self._num_aborted = 0
        self._num_rejected = 0
        self._live: set[str] = set()
        """Request ids of calls running here, registered at a call's first step (before any
        await), as ``VLLMEngine`` does: a duplicate is refused here, whatever order the two
        calls reach the actor in."""
        self._actor_gone = False
        self._watch: asyncio.Future[None] | None = None
        self._gate = AdmissionGate()
        """Open while requests may enter (not paused, asleep or holding), as the actor's engine
        gates admission; mirrored here so that ``in_flight`` counts admitted requests."""
        self._pending: set[asyncio.Future[Any]] = set()
        """Fire-and-forget calls (``weights.hold``), kept until done."""
        self.call_times: dict[str, tuple[float, float]] = {}
        """The last call of each kind to the actor's engine (``"weights.commit"``,
        ``"take_update"``, ...): seconds the round trip took here, and seconds of it in the
        actor; the difference is what Ray (and the actor's event loop) cost."""

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
            EngineStartError: also where Ray is not initialised (``ray.init()`` first).
        """
        import ray

        if not ray.is_initialized():
            raise EngineStartError("RayEngine needs a Ray cluster: call ray.init() first")
        name = name or f"ray-engine-{os.urandom(3).hex()}"
        options = {"num_cpus": 0, "max_concurrency": 100_000, **(actor_options or {})}
        host: Any = ray.remote(EngineHost)
        actor = host.options(**options).remote()
        try:
            info = await _unwrapped(actor.start.remote(str(model_path), name, global_steps,
                                                       dict(engine_args)))
        except BaseException:
            ray.kill(actor)
            raise
        engine = cls(actor, info, name=name, global_steps=global_steps)
        engine._watch = asyncio.ensure_future(engine._watch_actor())
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
    def weights(self) -> RayWeightPort:
        """The engine's update surface (``asyncroll.interfaces.ReceivingPort``)."""
        return self._weights

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            in_flight=self._in_flight, paused=self._paused, asleep=self._asleep,
            dead=self.is_dead, global_steps=self._global_steps,
            num_requests=self._num_requests, num_aborted=self._num_aborted,
            num_rejected=self._num_rejected, holding=self._holding is not None,
            waiting=self._gate.waiting,
        )

    async def remote_statistics(self) -> EngineStatistics:
        """The actor's engine's own statistics."""
        stats: EngineStatistics = await self._call_sync("statistics")
        return stats

    async def remote_unfinished(self) -> int:
        """Requests the actor's vLLM still tracks (0 once aborts have landed)."""
        count: int = await self._call_sync("num_unfinished_in_vllm")
        return count

    async def wait_dead(self) -> None:
        """Return once the actor is gone (killed, its node lost) or the engine closed; the
        engine notices a death this way even while no call is running."""
        if self._watch is not None:
            await asyncio.shield(self._watch)

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
        try:
            check_request_id(request_id, max_len=ENGINE_REQUEST_ID_LEN)
            refuse_live(request_id, self._live)
        except InvalidRequestError:
            self._num_rejected += 1
            raise
        with claimed(self._live, request_id):
            segment = await self._generate_in_actor(request_id, prompt_ids, sampling_params)
        if segment.finish_reason == "abort":
            self._num_aborted += 1
        return segment

    async def _generate_in_actor(self, request_id: str, prompt_ids: Sequence[int],
                                 sampling_params: Mapping[str, Any] | None) -> Segment:
        """Once admitted here (the proxy's gate mirrors the actor's), the actor's call."""
        if not await self._gate.admit(request_id):
            self._num_requests += 1  # (and one aborted: ``generate`` counts it)
            return aborted_segment(request_id, len(prompt_ids))
        self._check_alive()
        self._in_flight += 1
        self._num_requests += 1
        try:
            await self._sent()
            segment: Segment = await self._await(
                self.actor.generate.remote(request_id, prompt_ids, sampling_params))
        except EngineDeadError:
            raise
        except ValueError:
            self._num_rejected += 1
            raise
        finally:
            self._in_flight -= 1
        return segment

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        # Waiting here: they end here, the actor never sees them. (One that passed this gate and
        # whose call is still on its way to the actor can miss the actor's abort, as before.)
        ids = self._gate.abort(ids)
        if ids and not self.is_dead:
            await self._call("abort", ids)

    async def pause(
        self, mode: PauseMode = "abort", *, clear_cache: bool | None = None
    ) -> None:
        self._check_alive()
        await self._call("pause", mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._call("resume")

    async def aclose(self) -> None:
        """Close the actor's engine, then end the actor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.set()  # waiters wake and find the engine closed
        import ray

        try:
            if not self._actor_gone:
                with contextlib.suppress(Exception):
                    await _unwrapped(self.actor.aclose.remote())
        finally:
            ray.kill(self.actor)
            for pending in [*self._pending, *([self._watch] if self._watch else [])]:
                pending.cancel()
            logger.info("closed %s", self.name)

    # -- UpdatableEngine and ReceivingEngine ---------------------------------------------------

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        self._check_alive()
        await self._call("sleep", level, mode=mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._call("wake_up", list(tags) if tags is not None else None)

    # -- internals -------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An async method of the actor's engine, after every call sent before it; the
        mirrored state follows the engine's, whether the call succeeded or not."""
        return await self._invoke(self.actor.call, method, *args, timed_as=method, **kwargs)

    async def _invoke(self, actor_method: Any, *args: Any, timed_as: str | None = None,
                      sent: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """``actor_method`` (returning its result and the engine's state), as ``_call``;
        timed in ``call_times`` under ``timed_as``; ``sent()`` once the call has left."""
        await self._sent()
        started = time.perf_counter()
        try:
            ref = actor_method.remote(*args, **kwargs)
            if sent is not None:
                sent()
            reply = await self._await(ref)
        except EngineDeadError:
            raise
        except Exception:
            await self._resync()
            raise
        actor_s = reply[1]["actor_s"]
        if timed_as is not None and actor_s is not None:
            self.call_times[timed_as] = (time.perf_counter() - started, actor_s)
        return self._mirror(reply)

    async def _call_sync(self, method: str, *args: Any) -> Any:
        await self._sent()
        return self._mirror(await self._await(self.actor.call_sync.remote(method, *args)))

    def _mirror(self, reply: tuple[Any, dict[str, Any]]) -> Any:
        result, state = reply
        self._paused = state["paused"]
        self._asleep = state["asleep"]
        self._asleep_weights = state["weights_asleep"]
        self._global_steps = state["global_steps"]
        if not state["holding"]:
            self._holding = None
        elif self._holding is None:
            self._holding = "held in the actor"
        if state["dead"]:
            self._died(EngineDeadError(f"{self.name}: the actor's engine is dead"))
        if self._gate.is_set() and (self._paused or self._asleep or self._holding):
            self._gate.clear()
        self._open_gate_if_ready()
        return result

    async def _resync(self) -> None:
        """After a failed call: read the engine's state again (best effort)."""
        with contextlib.suppress(Exception):
            self._mirror((None, await self._await(self.actor.state.remote())))

    async def _sent(self) -> None:
        """Wait for the fire-and-forget calls (``weights.hold``) sent before: Ray
        may run an async actor's calls out of order, so a later call must not overtake them."""
        while self._pending:
            await asyncio.wait(list(self._pending))

    async def _await(self, ref: Any) -> Any:
        """Await an actor call; cancelling the caller cancels the call in the actor."""
        self._check_alive()
        try:
            return await _unwrapped(ref)
        except asyncio.CancelledError:
            await _cancelled(ref)
            raise
        except EngineDeadError as exc:
            self._died(exc)
            raise

    def _died(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
            logger.warning("%s is dead: %s", self.name, exc)
        self._gate.set()  # waiters wake and find the engine dead

    def _fire(self, method: str, *args: Any) -> None:
        """Send a call whose result nobody awaits; later calls wait for it (``_sent``), and so
        does a later fire: Ray may run an async actor's calls out of order."""
        earlier = list(self._pending)
        future = asyncio.ensure_future(
            self._fire_after(earlier, method, args) if earlier
            else self._await(self.actor.call_sync.remote(method, *args))
        )
        self._pending.add(future)
        future.add_done_callback(self._fired)

    async def _fire_after(self, earlier: list[asyncio.Future[Any]], method: str,
                          args: tuple[Any, ...]) -> Any:
        await asyncio.wait(earlier)
        return await self._await(self.actor.call_sync.remote(method, *args))

    def _fired(self, future: asyncio.Future[Any]) -> None:
        self._pending.discard(future)
        if future.cancelled() or future.exception() is None:
            if not future.cancelled():
                self._mirror(future.result())
            return
        logger.warning("%s: a background call failed: %r", self.name, future.exception())

    async def _watch_actor(self) -> None:
        """Pending for the actor's life: its death marks the engine dead even while idle."""
        with contextlib.suppress(EngineDeadError):
            await _unwrapped(self.actor.wait_closed.remote())
        if not self._closed:
            self._actor_gone = True
            self._died(EngineDeadError(f"{self.name}: its Ray actor is gone"))

    def _open_gate_if_ready(self) -> None:
        if not self._paused and not self._asleep and self._holding is None:
            self._gate.set()

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(f"{self.name} is closed")
        if self._dead is not None:
            raise EngineDeadError(f"{self.name} is dead: its actor is gone") from self._dead


class RayWeightPort:
    """A ``RayEngine``'s update surface (``asyncroll.interfaces.ReceivingPort``): the actor's
    engine's weight port, one actor call a verb. The workers connect to the sender directly;
    the bytes never pass through Ray.

    Its state between two calls: the version a take labelled in the actor (a broadcast push),
    which its ``commit`` then finds done.
    """

    def __init__(self, engine: RayEngine, *, num_workers: int, served_dtype: torch.dtype) -> None:
        self._engine = engine
        self._num_workers = num_workers
        self._served_dtype = served_dtype
        self._attached_to: object | None = None
        self._verdicts = False
        """Attached to a broadcast push group: a take that returns means every rank took the
        push (``EngineHost.take_update`` labels it then)."""
        self._labelled: int | None = None
        """The version the last take labelled in the actor, until committed."""

    def __repr__(self) -> str:
        return f"<RayWeightPort {self._engine.name} attached_to={self._attached_to!r}>"

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def served_dtype(self) -> torch.dtype:
        return self._served_dtype

    @property
    def attached_to(self) -> object | None:
        return self._attached_to

    def hold(self, reason: str) -> None:
        engine = self._engine
        engine._holding = reason
        engine._gate.clear()
        engine._fire("weights.hold", reason)

    async def commit(self, global_steps: int | None) -> None:
        """Ends the hold here at once, and labels in the actor unless its take did."""
        engine = self._engine
        global_steps = check_commit(global_steps, engine.global_steps, engine=engine.name)
        engine._holding = None
        engine._open_gate_if_ready()
        labelled, self._labelled = self._labelled, None
        if labelled is not None and labelled == (-1 if global_steps is None else global_steps):
            return  # labelled in the actor as the push ended (``take_update``)
        await engine._call("weights.commit", global_steps)

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        engine = self._engine
        await engine._sent()
        engine._mirror(await engine._await(engine.actor.attach.remote(dict(config))))
        self._attached_to = owner
        self._verdicts = config.get("transport") == "broadcast"

    async def detach(self) -> None:
        self._attached_to = None
        await self._engine._call("weights.detach")

    async def take(
        self,
        version: int,
        *,
        push: int = 0,
        mode: ResumeMode = "keep",
        sent: Callable[[], None] | None = None,
    ) -> Delivery | None:
        engine = self._engine
        if check_take(version, push, mode) in INFLIGHT_MODES:
            raise InvalidRequestError(f"{engine.name}: a Ray engine cannot commit an update"
                                      " between two steps (no inflight update)")
        engine._check_alive()
        self._labelled = None
        delivery: Delivery | None = await engine._invoke(
            engine.actor.take_update, version, self._verdicts, push, timed_as="take_update",
            sent=sent,
        )
        if self._verdicts:
            self._labelled = version
        return delivery

    async def abort(self) -> bool:
        self._labelled = None
        whole: bool = await self._engine._call("weights.abort")
        return whole

    async def read_ranges(self) -> list[dict[str, tuple[int, ...]] | None]:
        ranges: list[dict[str, tuple[int, ...]] | None] = await self._engine._call(
            "weights.read_ranges"
        )
        return ranges


def _method(engine: Any, name: str) -> Any:
    """``engine``'s method ``name``; a dotted name reaches into its parts (``weights.take``)."""
    return functools.reduce(getattr, name.split("."), engine)


async def _cancelled(ref: Any) -> None:
    """Cancel an actor call (a generate's engine aborts its request) and wait, a bounded
    time, until it has ended, so its request id is free again when the cancellation goes on.
    Never raises: the caller re-raises its ``CancelledError``."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref)
    ended = asyncio.ensure_future(_settled(ref))
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        await asyncio.wait_for(asyncio.shield(ended), CANCEL_WAIT_S)


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
