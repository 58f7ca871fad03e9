"""A ``VLLMEngine``'s adapter port (``engine.adapters``): LoRA revisions pushed by asyncroll.

The engine's half of an adapter update (``asyncroll.adapters``): what its LoRA serves
(``layout``), take a pushed revision (one RPC the EngineCore runs between two steps: the
engine is never paused), drop one. The worker's half is ``asyncroll.vllm.lora``. The port
keeps which revisions the engine holds, so a request never names one it does not.

A later revision of the layout and config last taken can land instead (``lands``): the
workers' landing threads receive it while the engine steps (``landings``, a sender's
receivers), and ``register`` queues its registration on the EngineCore's input, which runs
it between two steps ahead of every request sent after it. The push then waits for no step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncroll.adapters import (
    LAYOUTS_SENT,
    AdapterLayout,
    AdapterRevision,
    Placement,
    decoder_shapes,
    layout_key,
)
from asyncroll.errors import InvalidRequestError, WeightSyncError
from asyncroll.interfaces import Delivery
from asyncroll.update_check import read_checkpoint_schema
from asyncroll.vllm.deliveries import summed


class _Engine(Protocol):
    """What the port needs of its ``VLLMEngine`` (which imports this module)."""

    name: str
    model_path: str

    @property
    def is_dead(self) -> bool: ...

    @property
    def weights(self) -> Any: ...

    async def collective_rpc(
        self, method: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]: ...

    async def rpc_sent(
        self, method: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> asyncio.Future[list[Any]]: ...


__all__ = ["VLLMAdapterPort"]

logger = logging.getLogger(__name__)


class _LandingsPort:
    """The workers' landing threads, as a sender's receivers (``asyncroll.weights``'s
    ``LandingChannel`` attaches them as it attaches ``engine.weights``)."""

    def __init__(
        self, engine: _Engine, workers: Callable[[], int], expected: Callable[[], str]
    ) -> None:
        self._engine = engine
        self._workers = workers
        self._expected = expected
        """The key of the layout the landing threads are to expect (``lands``)."""
        self._attached_to: object | None = None

    @property
    def num_workers(self) -> int:
        return self._workers()

    @property
    def attached_to(self) -> object | None:
        return self._attached_to

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        """Start every worker's landing thread on the sender ``config`` describes."""
        await self._engine.collective_rpc(
            "asyncroll_open_landings",
            kwargs={"config": {**config, "name": self._engine.name},
                    "layout_key": self._expected()},
        )
        self._attached_to = owner

    async def detach(self) -> None:
        """Stop the landing threads (their receivers release their mappings)."""
        self._attached_to = None
        await self._engine.collective_rpc("asyncroll_close_landings")


class VLLMAdapterPort:
    """Adapter revisions in one ``VLLMEngine`` (see the module doc)."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._layout: AdapterLayout | None = None
        self._held: dict[int, AdapterRevision] = {}
        self.last_seconds: dict[str, float] = {}
        """Where the first worker's last take went (drop, receive, register; benchmarks)."""
        self._layouts_sent: dict[str, None] = {}
        """Layouts every worker keeps (``asyncroll_take_adapter``), the most recently used
        last (at most ``LAYOUTS_SENT``): a push names them by key alone."""
        self._last_layout: tuple[tuple[Placement, ...], str] = ((), "")
        self.last_stamps: dict[str, float] = {}
        """When the first worker's last take reached each point (``time.perf_counter()``,
        one clock for the host's processes; benchmarks line it up with the sender's)."""
        self.last_registration = ""
        """How the first worker registered the last revision: ``replayed`` (its tensors
        written straight into a LoRA slot, as vLLM wrote an earlier revision there) or
        ``vllm`` (vLLM's own ``LoRAModel`` and activation)."""
        self.landings = _LandingsPort(engine, lambda: int(engine.weights.num_workers),
                                      self._expected_key)
        """The workers' landing threads (``lands``)."""
        self._lands_as: tuple[tuple[Placement, ...], dict[str, Any]] | None = None
        """The layout and config of the last revision taken or registered: what the landing
        threads expect next."""
        self._registering: asyncio.Future[list[Any]] | None = None
        """The last ``register``'s RPC (its answer is logged and kept as it comes)."""
        self.registered = 0
        """Registrations answered, and those that failed (``registration_failures``)."""
        self.registration_failures: list[str] = []

    def __repr__(self) -> str:
        return f"<VLLMAdapterPort {self._engine.name} held={sorted(self._held)}>"

    @property
    def held(self) -> tuple[AdapterRevision, ...]:
        return tuple(self._held.values())

    def holds(self, revision: AdapterRevision) -> bool:
        return self._held.get(revision.revision) == revision

    @property
    def known_layout(self) -> AdapterLayout | None:
        """``layout()``'s answer once it has been asked (None before)."""
        return self._layout

    async def layout(self) -> AdapterLayout:
        """What the engine's LoRA serves (asked once).

        Raises:
            InvalidRequestError: the engine was started without LoRA.
        """
        if self._layout is not None:
            return self._layout
        engine = self._engine
        answers = await engine.collective_rpc("asyncroll_adapter_layout")
        found = answers[0] if answers else None
        if found is None:
            raise InvalidRequestError(
                f"{engine.name} was started without LoRA: start it with enable_lora=True"
                " (and max_lora_rank, max_loras, max_cpu_loras)"
            )
        modules = frozenset(found["modules"])
        schema = await asyncio.to_thread(read_checkpoint_schema, engine.model_path)
        shapes: dict[str, tuple[int, int]] = {}
        for name, spec in (schema.tensors.items() if schema is not None else ()):
            module = name.removesuffix(".weight")
            if module != name and len(spec.shape) == 2 and module.rsplit(".", 1)[-1] in modules:
                shapes[module] = (int(spec.shape[0]), int(spec.shape[1]))
        if not shapes:  # no checkpoint (load_format="dummy"): the config's decoder shapes
            config = Path(engine.model_path) / "config.json"
            if config.is_file():
                shapes = {
                    module: shape
                    for module, shape in decoder_shapes(json.loads(config.read_text())).items()
                    if module.rsplit(".", 1)[-1] in modules
                }
        self._layout = AdapterLayout(
            max_rank=int(found["max_rank"]),
            slots=int(found["slots"]),
            resident=int(found["resident"]),
            modules=modules,
            shapes=shapes,
        )
        return self._layout

    async def take(
        self,
        revision: AdapterRevision,
        config: Mapping[str, Any],
        *,
        push: int = 0,
        sent: Callable[[], None] | None = None,
        drop: Sequence[AdapterRevision] = (),
        layout: Sequence[Placement] = (),
    ) -> Delivery | None:
        """Take a push as ``revision``: every worker receives it, checks it and registers it,
        in one RPC that runs between two engine steps. ``sent()`` once the RPC has left.
        ``drop``: revisions no request uses any more, forgotten first in the same RPC (they
        are gone whether the push succeeds or not). ``layout``: where each tensor lies in the
        pushed chunks (``asyncroll.adapters.pack_adapter``).

        Raises:
            WeightSyncError: a worker failed (it registered nothing; what the engine held and
                served is unchanged).
        """
        engine = self._engine
        key = self._key_of(tuple(layout))
        kwargs: dict[str, Any] = {
            "update_info": {"version": _version(revision), "push": push},
            "revision": revision.revision,
            "config": dict(config),
            "drop": [r.revision for r in drop],
            "layout_key": key,
        }
        if key not in self._layouts_sent:  # the workers keep it from then on
            kwargs["layout"] = [list(place) for place in layout]
        for gone in drop:
            self._held.pop(gone.revision, None)
        rpc = asyncio.ensure_future(engine.collective_rpc("asyncroll_take_adapter", kwargs=kwargs))
        try:
            if sent is not None:
                # The RPC's task, then the call it makes into vLLM, then that call's first
                # step, which hands it to vLLM's socket: three loop turns see it out.
                for _ in range(3):
                    await asyncio.sleep(0)
                sent()
            answers = await rpc
        finally:
            if not rpc.done():
                rpc.cancel()
        failed = [(rank, why) for rank, why in enumerate(answers) if isinstance(why, str)]
        if failed:
            self._lands_as = None  # the next revision goes this way again, to every worker
            self._layouts_sent.pop(key, None)  # sent again with the next push
            await self._forget(revision)  # a worker that took it must not keep it alone
            rank, why = failed[0]
            raise WeightSyncError(
                f"{engine.name}: the adapter push failed in {len(failed)} of {len(answers)}"
                f" workers; rank {rank}: {why}"
            )
        self._layouts_sent.pop(key, None)
        self._layouts_sent[key] = None
        while len(self._layouts_sent) > LAYOUTS_SENT:
            self._layouts_sent.pop(next(iter(self._layouts_sent)))
        self._held[revision.revision] = revision
        self._lands_as = (tuple(layout), dict(config))
        self.last_seconds = answers[0].get("seconds", {})
        self.last_stamps = answers[0].get("stamps", {})
        self.last_registration = answers[0].get("registered", "")
        return summed(answers)

    def lands(self, layout: Sequence[Placement], config: Mapping[str, Any]) -> bool:
        """Whether a revision of ``layout`` and ``config`` can land (``register``): the
        landing threads expect that layout, and the workers took that config before (the
        last take, which succeeded in every worker)."""
        return self._lands_as == (tuple(layout), dict(config))

    def landing_failed(self) -> None:
        """A landed push failed: the next revision goes the step loop's way (``take``),
        which tells every worker's landing thread the layout again."""
        self._lands_as = None

    def _expected_key(self) -> str:
        return self._key_of(self._lands_as[0]) if self._lands_as is not None else ""

    async def register(
        self,
        revision: AdapterRevision,
        config: Mapping[str, Any],
        *,
        push: int,
        drop: Sequence[AdapterRevision] = (),
    ) -> None:
        """Register the revision the landing threads took as push ``push``: returns once the
        RPC has left, queued on the EngineCore's input ahead of every request sent later,
        which therefore may name the revision at once. ``drop``: forgotten first, in the
        same RPC. A registration that fails keeps the revision as it landed (the worker then
        builds it when a step first needs it); it is logged, and counted in
        ``registration_failures``."""
        engine = self._engine
        kwargs = {"revision": revision.revision, "push": push, "config": dict(config),
                  "drop": [r.revision for r in drop]}
        for gone in drop:
            self._held.pop(gone.revision, None)
        called = time.perf_counter()
        rpc = await engine.rpc_sent("asyncroll_register_adapter", kwargs=kwargs)
        rpc.add_done_callback(functools.partial(self._registered, revision, called))
        self._registering = rpc
        self._held[revision.revision] = revision

    async def registered_last(self) -> list[Any]:
        """The last registration's answers, once they came (tests, benchmarks)."""
        if self._registering is None:
            return []
        return await asyncio.shield(self._registering)

    def _registered(
        self, revision: AdapterRevision, called: float, rpc: asyncio.Future[list[Any]]
    ) -> None:
        if rpc.cancelled():
            return
        error = rpc.exception()
        answers = rpc.result() if error is None else [f"{type(error).__name__}: {error}"]
        self.registered += 1
        lost = [why for why in answers if isinstance(why, str)]
        held = [a["registered"] for a in answers if isinstance(a, dict)]
        failed = lost + [how for how in held if how.startswith("held")]
        if lost:  # a worker does not hold it: no call sent from now on may name it
            self._held.pop(revision.revision, None)
            self._lands_as = None
        if failed:
            self.registration_failures.append(failed[0])
            logger.error("%s: registering %s: %s", self._engine.name, revision.lora_name,
                         failed[0])
        if answers and isinstance(answers[0], dict):
            self.last_registration = answers[0]["registered"]
            self.last_seconds = answers[0].get("seconds", {})
            self.last_stamps = {"register called": called, **answers[0].get("stamps", {}),
                                "register answered": time.perf_counter()}

    def _key_of(self, layout: tuple[Placement, ...]) -> str:
        """``layout_key``, worked out again only when the layout changes."""
        if layout != self._last_layout[0]:
            self._last_layout = (layout, layout_key(layout))
        return self._last_layout[1]

    async def drop(self, revision: AdapterRevision) -> None:
        """Forget ``revision`` (no request may be using it)."""
        self._held.pop(revision.revision, None)
        await self._forget(revision)

    async def _forget(self, revision: AdapterRevision) -> None:
        if not self._engine.is_dead:
            await self._engine.collective_rpc("asyncroll_drop_adapter", args=(revision.revision,))


def _version(revision: AdapterRevision) -> int:
    return revision.global_steps if revision.global_steps is not None else -1
