"""AsyncServerManager: routes generate calls to engines and resumes them across weight updates.

Invariants:
- Every ``generate`` call resolves exactly once, in its caller's task (no background tasks):
  a complete ``TokenOutput``, or an error; never an "aborted" output unless resuming is off.
- Bad input is rejected before any engine sees it.
- A resumed request is charged against its original budget: the continuation asks for
  ``max_tokens - generated`` more tokens, with prompt + generated tokens as its prompt.
- ``global_steps`` per token is what the engine that produced the token had in force; it never
  decreases along an output. The manager publishes a new ``global_steps`` only after every
  engine took the new weights.
- New calls made while weights update wait at the manager's gate instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncroll.adapters import (
    AdapterConfig,
    AdapterPlans,
    AdapterReport,
    AdapterRevision,
    PackedAdapter,
    Revisions,
    check_adapter_name,
)
from asyncroll.errors import (
    EngineDeadError,
    InvalidRequestError,
    ManagerClosedError,
    NoEngineAvailableError,
    WeightSyncError,
)
from asyncroll.interfaces import (
    INFLIGHT_MODES,
    Engine,
    ReceivingEngine,
    ResumeMode,
    UpdateReport,
    WeightUpdater,
)
from asyncroll.metrics import STALENESS_BOUNDS, Histogram, UpdateMetrics, staleness_runs
from asyncroll.routing import EngineLoad, StickyTable, choose_engine
from asyncroll.transport.aio import shielded
from asyncroll.transport.plan import ALIGN
from asyncroll.types import (
    FinishReason,
    ManagerStatistics,
    Segment,
    TokenOutput,
)
from asyncroll.validation import (
    check_global_steps,
    check_prompt,
    check_request_id,
    check_resume_mode,
    claimed,
    refuse_live,
    resolve_sampling_params,
)
from asyncroll.weights import LandingChannel, WeightPusher, materialize

__all__ = ["AdapterClient", "AsyncServerManager", "Engine", "ResumeMode", "WeightUpdater"]

logger = logging.getLogger(__name__)

RECENT_UPDATES = 32
"""Update reports ``statistics()`` keeps (the last ones)."""

class _Trajectory:
    """The accumulating state of one generate call (owned by its caller's task)."""

    __slots__ = ("engines", "global_steps", "log_probs", "num_cached", "preempted", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.global_steps: list[int | None] = []
        self.engines: list[str] = []
        self.preempted = 0
        self.num_cached = 0

    def last_version(self) -> int | None:
        return next((s for s in reversed(self.global_steps) if s is not None), None)

    def add(self, segment: Segment, engine: str) -> None:
        self.token_ids += segment.token_ids
        self.log_probs += segment.log_probs
        self.global_steps += segment.global_steps
        self.num_cached += segment.num_cached_tokens
        if not self.engines or self.engines[-1] != engine:
            self.engines.append(engine)


class AsyncServerManager:
    """Routes ``generate`` calls over engines; updates their weights without losing requests.

    ```python
    async with AsyncServerManager(engines) as manager:
        out = await manager.generate(rid, prompt_ids=ids, sampling_params={"max_tokens": 256})
        report = await manager.update_weights(model.named_parameters(), global_steps=step)
    ```
    """

    land_adapters = True
    """A later revision of an adapter lands in the engines' workers on threads of their own,
    while the engines step, and its registration is queued between two of their steps
    (``asyncroll.weights.LandingChannel``): ``update_adapter`` waits for no engine step.
    False: every revision goes in one RPC that runs between two steps, as the first revision
    of each layout and config does (benchmarks compare the two)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        resume_mode: ResumeMode = "abort",
        partial_rollout: bool = True,
        sticky_margin: int = 4,
        weights: WeightUpdater | Callable[[list[Engine]], WeightUpdater] | None = None,
        global_steps: int | None = None,
        rolling: int = 0,
    ) -> None:
        """Args:
            engines: The engines to route over (started by the caller, who also closes them).
            resume_mode: How in-flight requests live through a weight update: ``abort`` ends
                them and resubmits prompt + partial output (the new weights compute their KV
                again), ``keep`` freezes them in their engine and goes on from the KV the old
                weights computed (the cheapest), ``recompute`` freezes them and has the new
                weights compute their KV again in the engine, ``inflight`` pauses nothing: each
                engine commits the update between two of its steps and new calls go on
                meanwhile, ``inflight-recompute`` likewise, then has the new weights compute
                the running requests' KV again (``ResumeMode``; in both the default pusher
                keeps a backup of the weights on the engines' devices, to undo a push that
                fails midway).
            partial_rollout: If False, interrupted requests come back with
                ``finish_reason="abort"`` instead of being resumed.
            sticky_margin: How much busier than the least-loaded engine a session's engine may
                be and still get the session's next call.
            weights: Pushes weights into the engines; by default a ``WeightPusher`` over the live
                engines, made on the first update (VLLMEngine only). With ``rolling``, a
                function that makes one for a group of engines (one ``WeightPusher`` a group
                by default).
            global_steps: The published version; by default the engines' own.
            rolling: Update this many engines at a time, group after group, instead of all
                at once (0). The manager's gate stays open: the other engines go on serving,
                no call goes to an engine its update has paused while another can serve it,
                and once a group has the new weights, new calls go to the engines that have
                them. Every token stays labelled. The published version (``global_steps``)
                moves when every live engine has it; two engines are at most one update
                apart while every update succeeds.
        """
        if not engines:
            raise InvalidRequestError("AsyncServerManager needs at least one engine")
        check_resume_mode(resume_mode, what="resume_mode")
        if isinstance(rolling, bool) or not isinstance(rolling, int) or rolling < 0:
            raise InvalidRequestError(f"rolling must be an int >= 0, got {rolling!r}")
        if rolling and weights is not None and hasattr(weights, "update"):
            raise InvalidRequestError(
                "with rolling, weights must be a function that makes a WeightUpdater for a"
                " group of engines, not one updater for them all"
            )
        if not rolling and weights is not None and not hasattr(weights, "update"):
            raise InvalidRequestError("weights must be a WeightUpdater (a function: rolling)")
        self.rolling = rolling
        self._make_updater: Callable[[list[Engine]], WeightUpdater] | None = (
            None if weights is None or not rolling else weights  # type: ignore[assignment]
        )
        self._group_updaters: dict[tuple[str, ...], WeightUpdater] = {}
        """A rolling update's, one a group of engines (``rolling``), made on first use."""
        self._updating: set[str] = set()
        """Engines a rolling update has paused: no call is routed to them."""
        self._rolling_to: int | None = None
        """A rolling update's version, once some engine has it: new calls go to those that
        do."""
        self._rolling = False
        """A rolling update is under way."""
        self._roll_moved = asyncio.Event()
        """Set (and replaced) each time a group's update ends: a call that found no engine
        to serve it while engines were paused looks again."""
        self._engines: list[Engine] = list(engines)
        self._in_flight: dict[str, int] = {engine.name: 0 for engine in self._engines}
        self.resume_mode: ResumeMode = resume_mode
        self.partial_rollout = partial_rollout
        self._margin = sticky_margin
        self._weights: WeightUpdater | None = None if rolling else weights  # type: ignore[assignment]
        self._owns_weights = weights is None
        self._retired: list[WeightUpdater] = []
        self._sticky = StickyTable()
        self._rotation = itertools.count()
        self._gate = asyncio.Event()
        self._gate.set()
        self._update_lock = asyncio.Lock()
        self._global_steps = global_steps if global_steps is not None else max(
            (e.global_steps for e in self._engines if e.global_steps is not None), default=None
        )
        self._num_requests = 0
        self._num_preempted = 0
        self._num_failovers = 0
        self._num_updates = 0
        self._reprefill_tokens = 0
        self._num_rejected = 0
        self._busy: dict[str, float] = {}
        """Seconds each engine had at least one of our requests in flight (ended spells)."""
        self._busy_since: dict[str, float] = {}
        self._num_failed_updates = 0
        self._recent_updates: deque[UpdateReport] = deque(maxlen=RECENT_UPDATES)
        self._update_metrics = UpdateMetrics()
        self._staleness = Histogram(STALENESS_BOUNDS)
        self._revisions = Revisions()
        """LoRA adapters' revisions held by the engines, and the calls pinned to each."""
        self._adapter_plans = AdapterPlans()
        """The adapter layouts pushed lately: their checks, and each one's kept pack."""
        self._adapter_pusher: WeightPusher | None = None
        """Pushes adapters where no ``WeightPusher`` of the manager's can (``rolling``)."""
        self._landing_channel: LandingChannel | None = None
        """Pushes adapter revisions to the engines' landing threads (``land_adapters``)."""
        self._closed = False
        self._live: set[str] = set()

    async def __aenter__(self) -> AsyncServerManager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"<AsyncServerManager engines={len(self._engines)} in_flight={self._total()} "
            f"global_steps={self._global_steps} resume_mode={self.resume_mode}>"
        )

    @property
    def engines(self) -> tuple[Engine, ...]:
        return tuple(self._engines)

    @property
    def global_steps(self) -> int | None:
        """The last version every engine took."""
        return self._global_steps

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(
            in_flight=self._total(),
            in_flight_per_engine=dict(self._in_flight),
            alive_engines=sum(not engine.is_dead for engine in self._engines),
            global_steps=self._global_steps,
            updating=not self._gate.is_set() or self._rolling,
            num_requests=self._num_requests,
            num_preempted=self._num_preempted,
            num_engine_failovers=self._num_failovers,
            num_updates=self._num_updates,
            sticky_sessions=len(self._sticky),
            num_reprefill_tokens=self._reprefill_tokens,
            num_rejected=self._num_rejected,
            num_failed_updates=self._num_failed_updates,
            recent_updates=tuple(self._recent_updates),
            update_seconds={k: h.snapshot() for k, h in self._update_metrics.seconds.items()},
            pushed_bytes=self._update_metrics.pushed_bytes,
            verified_tensors=self._update_metrics.verified_tensors,
            token_staleness=self._staleness.snapshot(),
            busy_seconds=self._busy_seconds(),
        )

    def _busy_seconds(self) -> dict[str, float]:
        now = time.perf_counter()
        return {
            name: self._busy.get(name, 0.0) + (
                now - self._busy_since[name] if name in self._busy_since else 0.0
            )
            for name in self._in_flight
        }

    def add_engine(self, engine: Engine) -> None:
        """Put an engine (new, or restarted) into rotation."""
        if engine.name in self._in_flight:
            raise InvalidRequestError(f"an engine named {engine.name!r} is already managed")
        self._engines.append(engine)
        self._in_flight[engine.name] = 0
        if self._owns_weights and self._weights is not None:
            self._retired.append(self._weights)  # the next update attaches the new set
            self._weights = None
        self._retired += self._group_updaters.values()  # the groups change
        self._group_updaters.clear()

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        session_key: str | None = None,
        adapter: str | None = None,
    ) -> TokenOutput:
        """Generate one complete output, resuming it across weight updates and engine deaths.

        Args:
            request_id: The caller's id for this call: a non-empty printable str of at most
                ``validation.MAX_REQUEST_ID_LEN`` characters, not live in another call. Each
                segment reaches its engine as ``<request_id>@<attempt>`` (attempt from 0).
            prompt_ids: Token ids of the prompt.
            sampling_params: vLLM sampling arguments (``validation.SAMPLING_KEYS``); never
                mutated.
            session_key: Calls sharing a key go to the same engine while it is not much busier
                than the others, so its prefix cache hits. Pass one per conversation. Without
                one, only the segments of this call stick together.
            adapter: A LoRA adapter pushed with ``update_adapter``: the call runs under its
                newest revision and keeps it to the end, through resumes; its tokens carry
                that revision's ``global_steps``.

        Raises:
            InvalidRequestError: bad input (an adapter never pushed, too); no engine saw it.
            NoEngineAvailableError: every engine is dead.
            ManagerClosedError: the manager was closed.
        """
        self._check_open()
        try:
            check_request_id(request_id)
            prompt, params = self._validate(prompt_ids, sampling_params)
            refuse_live(request_id, self._live)
        except InvalidRequestError:
            self._num_rejected += 1
            raise
        with claimed(self._live, request_id), self._pinned(adapter) as revision:
            try:
                output = await self._generate(request_id, prompt, params, session_key, revision)
            except InvalidRequestError:  # an engine's own check refused it
                self._num_rejected += 1
                raise
        if revision is None:
            self._count_staleness(output.global_steps, self._global_steps)
        else:
            newest = self._revisions.newest(revision.adapter)
            self._count_staleness(
                output.global_steps, newest.global_steps if newest is not None else None
            )
        return output

    def _pinned(
        self, adapter: str | None
    ) -> contextlib.AbstractContextManager[AdapterRevision | None]:
        if adapter is None:
            return contextlib.nullcontext()
        try:
            return self._revisions.pinned(adapter)
        except InvalidRequestError:
            self._num_rejected += 1
            raise

    def _count_staleness(self, steps: tuple[int | None, ...], published: int | None) -> None:
        if published is None or not steps:
            return
        first = steps[0]
        if first is not None and first == steps[-1] and None not in steps:
            self._staleness.observe(max(published - first, 0), len(steps))  # one version
            return
        for staleness, tokens in staleness_runs(steps, published):
            self._staleness.observe(staleness, tokens)

    async def _generate(
        self,
        request_id: str,
        prompt: list[int],
        params: dict[str, Any],
        session_key: str | None,
        revision: AdapterRevision | None = None,
    ) -> TokenOutput:
        budget: int = params["max_tokens"]
        min_tokens = int(params.get("min_tokens") or 0)
        trajectory = _Trajectory()
        last: int | None = None
        self._num_requests += 1
        for attempt in itertools.count():
            await self._gate.wait()
            last = await self._route_when_able(
                session_key, last, trajectory.last_version(), revision
            )
            engine = self._engines[last]
            remaining = budget - len(trajectory.token_ids)
            if attempt:  # a resubmission prefills the prompt and the output so far again
                self._reprefill_tokens += len(prompt) + len(trajectory.token_ids)
            segment_params = {**params, "max_tokens": remaining}
            if min_tokens:
                segment_params["min_tokens"] = max(0, min_tokens - len(trajectory.token_ids))
            try:
                segment = await self._dispatch(
                    engine,
                    # Always suffixed, so no caller's id (say "x@1") equals a segment's id.
                    f"{request_id}@{attempt}",
                    prompt + trajectory.token_ids,
                    segment_params,
                    revision,
                )
            except EngineDeadError:
                self._num_failovers += 1
                await asyncio.sleep(0)  # let the engine's death be observed before re-routing
                logger.warning("%s died; resuming %r on another engine", engine.name, request_id)
                continue
            trajectory.add(segment, engine.name)
            reason = self._finish_reason(segment, len(trajectory.token_ids), budget)
            if reason is not None:
                return self._output(request_id, trajectory, reason, len(prompt))
            trajectory.preempted += 1
            self._num_preempted += 1
        raise AssertionError("unreachable")

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        global_steps: int | None,
        changed: bool = False,
    ) -> UpdateReport:
        """Push new weights to every live engine; in-flight requests resume transparently.

        Pauses every engine (in ``resume_mode``; none in the inflight modes), pushes to all of
        them at once, labels the weights ``global_steps`` and publishes it once every engine
        succeeded, then resumes. With ``rolling=k``, the same group after group (``k`` engines
        each) while the others serve.
        ``changed=True``: warn (``UnchangedWeightsWarning``) if the tensors equal the previous
        update's (``VersionedUpdater.update``).

        Raises:
            InvalidRequestError: bad input, found before any engine paused: ``global_steps``
                not a non-negative int or lower than the published one; a tensor with an
                unknown name, a wrong shape or dtype, or non-finite values.
            WeightSyncError: a push failed; the published version stays the old one, and each
                engine serves its previous weights or holds (the error says which).
            ManagerClosedError: the manager was closed.
        """
        self._check_open()
        global_steps = check_global_steps(global_steps)
        async with self._update_lock:
            if (
                global_steps is not None
                and self._global_steps is not None
                and global_steps < self._global_steps
            ):
                raise InvalidRequestError(
                    f"global_steps {global_steps} is lower than the published {self._global_steps}"
                )
            while self._retired:
                await self._retired.pop().aclose()
            if self.rolling:
                return await self._update_rolling(named_tensors, global_steps, changed)
            if self._weights is None:  # an engine that dies later is skipped by the pusher
                backup = True if self.resume_mode in INFLIGHT_MODES else None
                self._weights = WeightPusher(_receiving(self._engines), backup=backup)
            if self.resume_mode not in INFLIGHT_MODES:  # new calls wait for the new weights
                self._gate.clear()
            labels = {e.name: getattr(e, "global_steps", None) for e in self._engines}
            try:
                report = await self._weights.update(
                    named_tensors,
                    global_steps=global_steps,
                    mode=self.resume_mode,
                    changed=changed,
                )
            except WeightSyncError:
                self._num_failed_updates += 1
                raise
            except asyncio.CancelledError:  # perhaps after the engines took the new label
                self._adopt_committed(global_steps, labels)
                raise
            finally:
                self._gate.set()
            if global_steps is not None:
                self._global_steps = global_steps
            self._num_updates += 1
            self._recent_updates.append(report)
            self._update_metrics.observe(report)
            return report

    async def _update_rolling(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        global_steps: int | None,
        changed: bool,
    ) -> UpdateReport:
        """``update_weights`` group after group (``rolling``), engines behind first. Whatever
        can be refused is refused before the first group pauses: the tensors' names, and a
        ``global_steps`` below any engine's (a failed roll leaves some engines ahead)."""
        tensors = materialize(named_tensors)  # every group gets the same tensors
        ahead = [
            f"{e.name}'s {e.global_steps}" for e in self._engines
            if not e.is_dead and None not in (global_steps, e.global_steps)
            and e.global_steps > global_steps  # type: ignore[operator]
        ]
        if ahead:
            raise InvalidRequestError(
                f"global_steps {global_steps} is lower than {', '.join(ahead)}: versions never"
                " go backwards"
            )
        groups = [
            self._engines[i:i + self.rolling] for i in range(0, len(self._engines), self.rolling)
        ]
        groups = [g for g in groups if any(not e.is_dead for e in g)]
        if not groups:
            raise WeightSyncError("no live engine to update")
        groups.sort(key=lambda g: min(_version(e) for e in g if not e.is_dead))
        pausing = self.resume_mode not in INFLIGHT_MODES
        labels = {e.name: getattr(e, "global_steps", None) for e in self._engines}
        started = time.perf_counter()
        reports: list[UpdateReport] = []
        took: list[str] = []
        values_read = False  # a group before read every tensor for NaN and inf
        self._rolling = True
        try:
            for group in groups:
                self._check_open()  # closed meanwhile: no updater is made after its close
                if all(e.is_dead for e in group):
                    continue  # died before its turn
                names = {e.name for e in group}
                if pausing:
                    self._updating |= names
                try:
                    updater = self._group_updater(group)
                    # Once a group's updater has read the tensors for NaN and inf, ours do
                    # not read every byte again for the groups after it.
                    again = ({"prechecked": True} if values_read and _takes_prechecked(updater)
                             else {})
                    reports.append(await updater.update(
                        tensors, global_steps=global_steps, mode=self.resume_mode,
                        changed=changed and not reports, **again,
                    ))
                    values_read = values_read or bool(getattr(updater, "values_read", False))
                except InvalidRequestError:
                    if took:  # (the same tensors passed the checks of the groups before)
                        self._num_failed_updates += 1
                    raise  # refused before the first group paused: bad input, nothing moved
                except Exception as exc:
                    self._num_failed_updates += 1
                    raise WeightSyncError(
                        f"rolling update to global_steps={global_steps}: {sorted(names)} failed"
                        f" ({type(exc).__name__}: {exc}); {took or 'no engine'} took it, the"
                        " others keep their weights"
                    ) from exc
                finally:
                    self._updating -= names
                    self._roll_moved.set()  # calls waiting for an engine look again
                    self._roll_moved = asyncio.Event()
                took += sorted(names)
                self._rolling_to = global_steps
        except asyncio.CancelledError:
            self._adopt_committed(global_steps, labels)
            raise
        finally:
            self._rolling_to = None
            self._rolling = False
        if not reports:
            raise WeightSyncError("no live engine to update")
        live = [e for e in self._engines if not e.is_dead]
        if global_steps is not None and all(e.global_steps == global_steps for e in live):
            self._global_steps = global_steps  # (an engine added meanwhile has not got it)
        report = UpdateReport(
            global_steps=global_steps,
            engines=sum(r.engines for r in reports),
            seconds=time.perf_counter() - started,
            pause_seconds=sum(r.pause_seconds for r in reports),
            push_seconds=sum(r.push_seconds for r in reports),
            finish_seconds=sum(r.finish_seconds for r in reports),
            resume_seconds=sum(r.resume_seconds for r in reports),
            push=reports[-1].push,
            tensors=reports[0].tensors,
            bytes=reports[0].bytes,
            deliveries={k: v for r in reports for k, v in r.deliveries.items()},
            group_seconds=tuple(r.seconds for r in reports),
        )
        self._num_updates += 1
        self._recent_updates.append(report)
        self._update_metrics.observe(report)
        return report

    async def update_adapter(
        self,
        adapter: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        config: AdapterConfig,
        global_steps: int | None,
    ) -> AdapterReport:
        """Push a new revision of LoRA ``adapter`` into every live engine; no engine pauses.

        The tensors go through asyncroll's transport straight into each engine's LoRA (no
        file), as a new revision beside those in use (``asyncroll.adapters``). Calls made
        with ``adapter=`` from then on start on it; calls already running keep the revision
        they started on. Superseded revisions no call uses are dropped first; where every
        revision that could go is still in use and the engines hold no more
        (``max_cpu_loras``), the update waits for a call to end (``waited_seconds``).

        Args:
            adapter: The adapter's name (calls name it in ``generate``).
            named_tensors: ``lora_A``/``lora_B`` tensors under PEFT's names
                (``base_model.model.<module>.lora_A.weight``; the prefix is optional).
            config: The adapter's rank and alpha.
            global_steps: The trainer step of these tensors: it labels every token sampled
                under the revision; at least the adapter's previous revision's.

        Raises:
            InvalidRequestError: before anything is sent: a bad name, tensors that are not a
                LoRA of ``config``'s rank over modules the engines' LoRA covers at their
                shapes, an engine started without LoRA, engines that hold too few revisions
                for one per adapter and one more, a ``global_steps`` below the previous
                revision's. A value that is not finite: before any of the tensors' bytes
                are sent (for a layout pushed before from a GPU, or of under a MiB, once
                the takes have left, which it calls off: no engine registers anything; the
                superseded revisions no call used are dropped all the same, and where every
                revision that could go was in use the refusal comes after the wait for
                room). One-copy pushes of tensors not on a GPU.
            WeightSyncError: the push failed; no engine keeps the new revision, and every
                revision in use serves on.
        """
        started = time.perf_counter()
        self._check_open()
        adapter = check_adapter_name(adapter)
        global_steps = check_global_steps(global_steps)
        if not isinstance(config, AdapterConfig):
            raise InvalidRequestError(f"config must be an AdapterConfig, not {config!r}")
        # The names, order and layout of an adapter seen lately are not worked out again.
        plan, values = self._adapter_plans.plan(named_tensors)
        entered = time.perf_counter()
        async with self._update_lock:
            locked = time.perf_counter()
            previous = self._revisions.newest(adapter)
            if (
                previous is not None and previous.global_steps is not None
                and global_steps is not None and global_steps < previous.global_steps
            ):
                raise InvalidRequestError(
                    f"global_steps {global_steps} is lower than adapter {adapter!r}'s last"
                    f" revision's ({previous.global_steps})"
                )
            engines = [engine for engine in self._engines if not engine.is_dead]
            if not engines:
                raise WeightSyncError("no live engine to push the adapter to")
            missing = [e.name for e in engines if getattr(e, "adapters", None) is None]
            if missing:
                raise InvalidRequestError(f"engines {missing} take no LoRA adapters")
            # (Known after the first push: no turn of the loop, which under load can be a
            # long one, before the take leaves.)
            layouts = [e.adapters.known_layout for e in engines]  # type: ignore[attr-defined]
            if any(layout is None for layout in layouts):
                layouts = await asyncio.gather(*(e.adapters.layout() for e in engines))  # type: ignore[attr-defined]
            for engine, layout in zip(engines, layouts, strict=True):
                plan.check(values, config, layout, engine=engine.name)
                if layout.slots < layout.resident:
                    raise InvalidRequestError(
                        f"{engine.name} holds {layout.resident} LoRA revisions but runs"
                        f" {layout.slots} in a step: start it with max_loras = max_cpu_loras,"
                        " or calls pinned to older revisions wait behind the newest's"
                    )
            resident = min(layout.resident for layout in layouts)
            needed = len(self._revisions.adapters() | {adapter}) + 1
            if resident < needed:
                raise InvalidRequestError(
                    f"the engines hold {resident} LoRA revisions (max_cpu_loras); {needed} are"
                    " needed: one per adapter, and one more for the next revision to arrive"
                    " while calls finish on the last"
                )
            checked = time.perf_counter()
            # One flat tensor a dtype travels (``pack_adapter``), the same one every push of
            # this layout (the last push is over), its every value checked finite. A layout's
            # first push packs here, off the loop. A later one writes the kept pack once the
            # takes have left (``fill``), while they travel to the workers, where that runs
            # on the loop (``fills_on_loop``): a value that is not finite then calls them off
            # before any byte is sent. (Checking the 392 tensors of a 7B rank-64 adapter one
            # by one before the takes left cost 2.2 ms on an H200; the pack's check, with its
            # copy, 1.1.) Shielded: a cancelled call holds the lock until its pack is
            # written, so the next push of the layout never writes the same pack at once.
            fill: Callable[[], Any] | None = None
            if plan.kept and plan.kept[0].fills_on_loop:
                packed = plan.kept[0]
                fill = functools.partial(plan.pack_finite, values, keep=True)
            else:
                packed = await shielded(
                    asyncio.to_thread(functools.partial(plan.pack_finite, keep=True), values)
                )
            packed_at = time.perf_counter()
            channel = self._adapter_channel(engines)
            dropped, waited = await self._make_room(resident)
            revision = AdapterRevision.next(adapter, global_steps)
            pushed = time.perf_counter()
            stamps: dict[str, float] = {"checked": checked}
            if fill is None:
                stamps["packed"] = packed_at
            peft = config.peft_config(plan.modules)
            channel = self._landing(engines, packed, peft) or channel
            try:
                push = await channel.push_adapter(
                    engines, packed, revision, peft, drop=dropped, fill=fill, stamps=stamps
                )
            except BaseException as exc:
                await shielded(self._forget(engines, [revision, *dropped]))
                if not isinstance(exc, Exception) or isinstance(exc, InvalidRequestError):
                    raise  # (a value that is not finite, found as the pack was written)
                raise WeightSyncError(
                    f"adapter {adapter!r} push (global_steps={global_steps}) failed; every"
                    f" engine serves its previous revisions: {exc}"
                ) from exc
            self._revisions.add(revision)
            ended = time.perf_counter()
            return AdapterReport(
                revision=revision,
                engines=len(engines),
                seconds=(entered - started) + (ended - locked),  # not another's wait for the lock
                waited_seconds=waited,
                push_seconds=ended - pushed,
                check_seconds=checked - locked,
                pack_seconds=packed_at - checked + stamps.get("filled", 0.0)
                - stamps.get("filling", 0.0),
                dropped=tuple(r.revision for r in dropped),
                tensors=len(plan.names),
                bytes=packed.nbytes,
                push=push,
                deliveries=channel.deliveries(),
                stamps=stamps,
            )

    async def remove_adapter(self, adapter: str) -> list[AdapterRevision]:
        """Retire ``adapter`` (a task or tenant done with): calls made from now on may not
        name it; calls running on it finish on their revision. Its revisions no call uses
        leave every engine now; the others once their calls have ended, at the next
        ``update_adapter`` or ``remove_adapter`` (as any superseded revision). Returns those
        that left.

        Raises:
            InvalidRequestError: a bad name, or an adapter with no revision.
        """
        self._check_open()
        adapter = check_adapter_name(adapter)
        async with self._update_lock:
            if self._revisions.newest(adapter) is None:
                known = sorted(self._revisions.adapters()) or "none"
                raise InvalidRequestError(f"adapter {adapter!r} has no revision; known: {known}")
            self._revisions.retire(adapter)
            live = self._revisions.adapters()  # (and those of adapters retired before)
            gone = [r for r in self._revisions.droppable() if r.adapter not in live]
            for revision in gone:
                self._revisions.drop(revision)
            engines = [engine for engine in self._engines if not engine.is_dead]
            await shielded(self._forget(engines, gone))
            return gone

    def with_adapter(self, adapter: str) -> AdapterClient:
        """A view of this manager whose ``generate`` runs every call under ``adapter`` (what
        an agent loop or a recipe's rollouts take as their ``ServerManager``).

        Raises:
            InvalidRequestError: a bad adapter name.
        """
        return AdapterClient(self, check_adapter_name(adapter))

    @property
    def adapters(self) -> dict[str, AdapterRevision]:
        """Each adapter's newest revision (the one new calls start on)."""
        return {name: self._revisions.newest(name) for name in self._revisions.adapters()}  # type: ignore[misc]

    async def _make_room(self, resident: int) -> tuple[list[AdapterRevision], float]:
        """The superseded revisions no call uses (the engines drop them as they take the
        next); first, while those would leave no room for one more of ``resident``, wait for
        calls to end."""
        waited = 0.0
        while True:
            dropped = self._revisions.droppable()
            if len(self._revisions) - len(dropped) < resident:
                for revision in dropped:
                    self._revisions.drop(revision)
                return dropped, waited
            began = time.perf_counter()
            logger.info("adapter update waits: every revision that could go is in use")
            await self._revisions.unpinned()
            waited += time.perf_counter() - began

    async def _forget(
        self, engines: Sequence[Engine], revisions: Sequence[AdapterRevision]
    ) -> None:
        async def drop(engine: Any) -> None:
            for revision in revisions:
                try:
                    await engine.adapters.drop(revision)
                except Exception:  # a dead engine holds nothing
                    logger.warning("%s: could not drop %s", engine.name, revision.lora_name,
                                   exc_info=True)

        await asyncio.gather(*(drop(e) for e in engines if not e.is_dead))

    def _landing(
        self, engines: Sequence[Engine], packed: PackedAdapter, peft: Mapping[str, Any]
    ) -> LandingChannel | None:
        """The channel to the engines' landing threads, where this push can land there
        (``land_adapters``; each engine took this layout and config last, through a
        ``WeightPusher``'s channel of a staged ZeroMQ push); None: it takes the step loop's
        way."""
        if not self.land_adapters:
            return None
        ports = [getattr(e, "adapters", None) for e in engines]
        if not all(hasattr(port, "landings") for port in ports):
            return None
        channel = self._adapter_channel(engines)
        if channel.backend_name == "broadcast" or channel.one_copy:
            return None
        if not all(port.lands(packed.layout, peft) for port in ports):  # type: ignore[union-attr]
            return None
        if self._landing_channel is None:
            self._landing_channel = LandingChannel(
                _receiving(list(engines)),
                # One bucket a push, of the adapter's size (the staging is the sender's GPU
                # memory): pushes of a larger layout go in several.
                bucket_bytes=max(ALIGN, -(-packed.nbytes // ALIGN) * ALIGN),
                buffers=1, backend=channel.backend_name, verify=channel.verify,
                timeout=channel.timeout,
            )
        return self._landing_channel

    def _adapter_channel(self, engines: Sequence[Engine]) -> Any:
        """The manager's pusher's channel (one receiver an engine: a second pusher would
        attach again at each switch), or an adapter pusher of its own (``rolling``, or a
        pusher whose full-weight pushes land first: its sender feeds the landing threads)."""
        if isinstance(self._weights, WeightPusher) and not self._weights.channel.lands:
            return self._weights.channel  # (a landing one attaches the landing threads)
        if self._weights is None and not self.rolling:
            backup = True if self.resume_mode in INFLIGHT_MODES else None
            self._weights = WeightPusher(_receiving(self._engines), backup=backup)
            return self._weights.channel
        if self._adapter_pusher is None:
            self._adapter_pusher = WeightPusher(_receiving(list(engines)))
        return self._adapter_pusher.channel

    def _group_updater(self, group: list[Engine]) -> WeightUpdater:
        key = tuple(e.name for e in group)
        updater = self._group_updaters.get(key)
        if updater is None:
            if self._make_updater is not None:
                updater = self._make_updater(group)
            else:
                backup = True if self.resume_mode in INFLIGHT_MODES else None
                updater = WeightPusher(_receiving(group), backup=backup)
            self._group_updaters[key] = updater
        return updater

    def _adopt_committed(
        self, global_steps: int | None, before: Mapping[str, int | None]
    ) -> None:
        """An update cancelled once every live engine had labelled its weights ``global_steps``
        (the label is applied shielded, so a cancellation there lets it finish) is published
        all the same: the manager's version never disagrees with what its engines serve.
        ``before``: each engine's label before the update (one that did not move took
        nothing)."""
        live = [e for e in self._engines if not e.is_dead]
        if global_steps is None or not live:
            return
        labels = [getattr(e, "global_steps", None) for e in live]
        moved = any(before.get(e.name) != label for e, label in zip(live, labels, strict=True))
        if moved and all(label == global_steps for label in labels):
            self._global_steps = global_steps
            self._num_updates += 1

    async def aclose(self) -> None:
        """Release the weight pusher. Idempotent; engines stay the caller's to close."""
        if self._closed:
            return
        self._closed = True
        self._adapter_plans.clear()  # (their kept packs: an adapter's size each)
        updaters = [*self._retired, self._weights, *self._group_updaters.values()]
        for updater in [*updaters, self._adapter_pusher, self._landing_channel]:
            if updater is not None:
                await updater.aclose()

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the AsyncServerManager is closed")

    def _total(self) -> int:
        return sum(self._in_flight.values())

    def _validate(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None
    ) -> tuple[list[int], dict[str, Any]]:
        """What every engine accepts: a request may be resumed on any of them."""
        vocab_size = min(engine.vocab_size for engine in self._engines)
        max_model_len = min(engine.max_model_len for engine in self._engines)
        prompt = check_prompt(prompt_ids, vocab_size=vocab_size)
        params = resolve_sampling_params(
            sampling_params,
            prompt_len=len(prompt),
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            has_tokenizer=all(engine.has_tokenizer for engine in self._engines),
        )
        del params["logprobs"]  # the engine sets its own
        return prompt, params

    async def _route_when_able(
        self,
        session_key: str | None,
        last: int | None,
        floor: int | None,
        revision: AdapterRevision | None = None,
    ) -> int:
        """``_route``, waiting while no engine can serve the call only because a rolling
        update has paused those that could (they have the weights it needs, or will)."""
        while True:
            try:
                return self._route(session_key, last, floor=floor, revision=revision)
            except NoEngineAvailableError:
                if not self._updating:
                    raise
                await self._roll_moved.wait()

    def _route(
        self,
        session_key: str | None,
        last: int | None,
        *,
        floor: int | None,
        revision: AdapterRevision | None = None,
    ) -> int:
        """Pick an engine index. Sticky to the session's engine (or, without a session key, to
        the engine of this request's previous segment). Engines behind ``floor`` (the version
        of the output's last token) are skipped, so an output never moves to older weights;
        with an adapter ``revision``, engines that do not hold it (added since it was pushed)."""
        if revision is None:
            alive = [_can_serve(engine, floor) for engine in self._engines]
        else:
            alive = [not e.is_dead and _holds(e, revision) for e in self._engines]
        # A rolling update: not to an engine it paused, and to one that has the new weights
        # once one does, where any such can serve (else as without the roll).
        for keep in (
            [e.name not in self._updating for e in self._engines],
            [self._rolling_to is None or _version(e) >= self._rolling_to for e in self._engines],
        ):
            narrowed = [a and k for a, k in zip(alive, keep, strict=True)]
            if any(narrowed):
                alive = narrowed
        loads = [
            EngineLoad(self._in_flight[engine.name], alive=serves)
            for engine, serves in zip(self._engines, alive, strict=True)
        ]
        sticky = self._sticky.get(session_key) if session_key is not None else last
        index = choose_engine(
            loads, sticky=sticky, margin=self._margin, rotation=next(self._rotation)
        )
        if session_key is not None:
            self._sticky.set(session_key, index)
        return index

    async def _dispatch(
        self,
        engine: Engine,
        request_id: str,
        prompt: list[int],
        params: dict[str, Any],
        revision: AdapterRevision | None = None,
    ) -> Segment:
        if not self._in_flight[engine.name]:
            self._busy_since[engine.name] = time.perf_counter()
        self._in_flight[engine.name] += 1
        try:
            if revision is not None:
                segment: Segment = await engine.generate(  # type: ignore[call-arg]
                    request_id, prompt_ids=prompt, sampling_params=params, adapter=revision
                )
                return segment
            return await engine.generate(request_id, prompt_ids=prompt, sampling_params=params)
        finally:
            self._in_flight[engine.name] -= 1
            if not self._in_flight[engine.name]:
                began = self._busy_since.pop(engine.name)
                self._busy[engine.name] = self._busy.get(engine.name, 0.0) + (
                    time.perf_counter() - began
                )

    def _finish_reason(self, segment: Segment, generated: int, budget: int) -> FinishReason | None:
        """The output's finish reason, or None if the request must be resumed."""
        if segment.finish_reason != "abort":
            return segment.finish_reason
        if generated >= budget:
            return "length"
        if not self.partial_rollout:
            return "abort"
        return None

    @staticmethod
    def _output(
        request_id: str, trajectory: _Trajectory, reason: FinishReason, num_prompt_tokens: int
    ) -> TokenOutput:
        return TokenOutput(
            request_id=request_id,
            token_ids=tuple(trajectory.token_ids),
            log_probs=tuple(trajectory.log_probs),
            global_steps=tuple(trajectory.global_steps),
            finish_reason=reason,
            num_preempted=trajectory.preempted,
            engines=tuple(trajectory.engines),
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=trajectory.num_cached,
        )


class AdapterClient:
    """``AsyncServerManager.with_adapter``: the manager's ``generate``, under one adapter."""

    def __init__(self, manager: AsyncServerManager, adapter: str) -> None:
        self.manager = manager
        self.adapter = adapter

    def __repr__(self) -> str:
        return f"<AdapterClient {self.adapter!r} of {self.manager!r}>"

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        session_key: str | None = None,
    ) -> TokenOutput:
        return await self.manager.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
            session_key=session_key, adapter=self.adapter,
        )


def _holds(engine: Engine, revision: AdapterRevision) -> bool:
    adapters = getattr(engine, "adapters", None)
    return adapters is not None and bool(adapters.holds(revision))


def _can_serve(engine: Engine, floor: int | None) -> bool:
    steps = engine.global_steps
    return not engine.is_dead and (floor is None or steps is None or steps >= floor)


def _version(engine: Engine) -> int:
    return -1 if engine.global_steps is None else engine.global_steps


def _receiving(engines: Sequence[Engine]) -> list[ReceivingEngine]:
    """The engines, if every one can take a push from asyncroll's sender."""
    receiving = [engine for engine in engines if isinstance(engine, ReceivingEngine)]
    if len(receiving) != len(engines):
        others = [engine.name for engine in engines if not isinstance(engine, ReceivingEngine)]
        raise WeightSyncError(
            f"engines {others} cannot take a push from asyncroll's sender: "
            "give the manager a WeightUpdater for them (weights=...)"
        )
    return receiving


def _takes_prechecked(updater: WeightUpdater) -> bool:
    """Whether ``updater.update`` names a ``prechecked`` keyword (``VersionedUpdater``'s, and
    wrappers that say so); an updater of one's own need not, and one that only passes
    ``**kwargs`` on is not sent it (what it passes them to may not take it)."""
    try:
        parameters = inspect.signature(updater.update).parameters
    except (TypeError, ValueError):
        return False
    return "prechecked" in parameters
