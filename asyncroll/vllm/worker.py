"""Inside each vLLM worker: asyncroll's transport as a backend of vLLM's weight-update protocol.

vLLM imports this module in every worker process (it is the ``worker_extension_cls`` module)
before the model loads, so the ``asyncroll`` backend is registered by the time the worker asks
``WeightTransferEngineFactory`` for it. The protocol runs as vLLM defines it:
``init_weight_transfer_engine`` (connect a ``WeightReceiver``), then per update
``start_weight_update`` (layerwise reload, which also works on the CPU build where a plain
``load_weights`` after start-up fails), ``update_weights`` (one whole double-buffered push),
``finish_weight_update``.

vLLM 0.24 runs the same protocol with the lifecycle in the worker: it starts and finishes the
layerwise reload itself and calls ``receive_weights(info, load_weights=...)``; it builds the
engine without its configs (``asyncroll_bind_weight_transfer_engine`` supplies them) and has no
call to shut the engine down (``asyncroll_shutdown_weight_transfer_engine``). Both are detected
by feature, not by version number.

Invariants:
- No loader of vLLM keeps a staging-buffer view past the bucket it came in: tensors that vLLM's
  layerwise loader buffers across a bucket boundary are copied first. (The load plan keeps
  views of the staging buffers to replay later pushes from them, never of a one-copy push's
  storages, and drops them before the receiver closes.)
- A receive runs outside vLLM's ``torch.device`` mode; everything of vLLM's that runs within
  it (the model's loaders, a rollback) runs under the mode again.
- A push that fails leaves the previous weights in force when a backup was taken (the default
  on CPU), and the model in a consistent state otherwise (the adapter then admits no request
  until a push succeeds: see ``asyncroll.weights``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._device import DeviceContext
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import layerwise

from asyncroll.adapters import LAYOUTS_KEPT, Placement, placements
from asyncroll.errors import PieceNotPlannedError, WeightSyncError
from asyncroll.receive.adapter import AdapterTake, Landing, Landings
from asyncroll.receive.assembly import Assembly
from asyncroll.receive.check import PushCheck, check_delivered
from asyncroll.receive.landing import LandedPush, WeightLanding
from asyncroll.receive.load_plan import LoadPlan, PlanStatistics
from asyncroll.receive.rollback import Rollback
from asyncroll.transport import WeightReceiver
from asyncroll.transport.broadcast import BroadcastReceiver, BroadcastReceivers
from asyncroll.transport.plan import Part
from asyncroll.transport.receiver import PlaceFn, ReceiveReport
from asyncroll.vllm.compat import (
    direct_load_refusal,
    repacking_experts,
    worker_runs_the_session,
)
from asyncroll.vllm.lora import store_of

__all__ = [
    "BACKEND_NAME",
    "AsyncrollWeightTransferEngine",
    "AsyncrollWorkerExtension",
    "SampleCounter",
    "delivery_of",
    "reload_weights",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "asyncroll"


@dataclass
class InitInfo(WeightTransferInitInfo):
    address: str
    nonce: str
    secret: str
    timeout_ms: int
    name: str = "engine"
    backup: bool = True
    load: str = "layerwise"
    """``layerwise``: vLLM's layerwise reload (portable; the CPU build needs it, since it repacks
    weights for its kernels). ``direct``: ``model.load_weights`` into the served parameters in
    place, as verl and slime do on GPU; several times faster, for unquantized models on GPU."""
    plan: bool = True
    """With ``direct``: replay a compiled load plan (``asyncroll.receive.load_plan``) instead
    of running the model's loaders on every push (they run once per name, watched, to learn the
    plan)."""
    transport: str = "staged"
    """``staged``: shared staging buffers on this host (``address`` is the sender's socket).
    ``broadcast``: a process group with the trainer, any host (``asyncroll.transport.broadcast``;
    the fields below say where it meets)."""
    senders: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """A trainer of several ranks (``asyncroll.DistributedWeightPusher``): every rank's sender
    config; the worker ``i = rank_offset + rank`` (counted over all engines) is served by
    ``senders[i % len(senders)]`` (the rank on its GPU, when engines are placed in the
    trainer's rank order): ``staged``, it connects there instead of ``address``;
    ``broadcast``, it joins that rank's push group, as its rank ``1 + i // len(senders)``."""
    host: str = ""
    port: int = 0
    world_size: int = 0
    rank_offset: int = 0
    """This engine's first rank in the group; a worker adds its rank within the engine."""
    fan_in: bool = False
    """``broadcast`` with ``senders``: the worker joins every rank's group (as its rank
    ``1 + rank_offset + rank`` in each) and takes a push from each, in rank order: each rank's
    own rows of the sharded tensors (put together here where the loader takes only whole
    tensors: ``asyncroll.receive.assembly``)."""
    timeout: float = 120.0
    buffers: int = 2
    bucket_bytes: int = 0


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    version: int = 0
    push: int = 0
    """The sender's id of the push to take: earlier pushes' messages are stale (0: the next)."""
    landed: bool = False
    """The push landed already (``open_landing``): load it from there, not the receiver."""


class AsyncrollWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    """Receives asyncroll pushes and loads them with vLLM's layerwise reload."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM 0.24 passes (config, parallel_config, model) only; the worker binds the rest.
        self.model_config: Any = getattr(self, "model_config", None)
        self.device: Any = getattr(self, "device", None)
        self._receiver: WeightReceiver | BroadcastReceiver | BroadcastReceivers | None = None
        self._device_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )
        """Puts vLLM's ``torch.device`` mode back while the model's loaders run (a receive
        runs outside it: ``_outside_device_context``)."""
        self.last_report: ReceiveReport | None = None
        self.entered = 0.0
        """When vLLM called ``receive_weights`` last (``time.perf_counter()``; with the
        report's ``began``: what preparing the receive cost)."""
        self._push_id = 0
        """The push the current receive takes (``UpdateInfo.push``)."""
        self.called = 0.0
        self.returned = 0.0
        """When the last ``asyncroll_take_update`` that succeeded began and ended in this worker
        (a failed one, or a push through vLLM's own ``update_weights``, leaves them): with
        ``entered`` and the report, what vLLM's start of the update and the worker's work
        after the receive cost, apart from the RPC's way in and out (benchmarks)."""
        self.stamps: dict[str, float] = {}
        """The last receive's points on this host's clock (a landed push's: ``entered``,
        ``loaded``, ``checked``; benchmarks)."""
        self.check = PushCheck()
        """The check of what each push loaded (``asyncroll.receive.check``)."""
        self.rollback = Rollback()
        """What undoing a failed push needs (``asyncroll.receive.rollback``)."""
        self._info: InitInfo | None = None
        self._finalized = False
        """The update in progress has finished its layerwise reload (in the receive)."""
        self._plan: LoadPlan | None = None
        self._repacking: tuple[torch.nn.Module, list[str]] | None = None
        self._planning = False
        """The last push loaded through the plan."""
        self._landing: WeightLanding | None = None
        self._receiver_info: InitInfo | None = None
        self._landing_info: InitInfo | None = None
        """How the pushes of the worker's own receiver, and of its landing thread, load: each
        sender told its own (``InitInfo``); ``_info`` is the one of the push in progress
        (``select``)."""

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        self.shutdown()
        rank = self.parallel_config.rank
        self._info = self._receiver_info = init_info
        if init_info.transport == "broadcast":  # blocks until the whole group has joined
            device = torch.device(self.device) if self.device is not None else torch.device("cpu")
            group, at = dataclasses.asdict(init_info), init_info.rank_offset + rank
            if init_info.senders and init_info.fan_in:  # every rank's group, in rank order
                joined: list[BroadcastReceiver] = []
                try:
                    for sender in init_info.senders:
                        joined.append(BroadcastReceiver.join(sender, rank=1 + at, device=device))
                except BaseException:
                    for receiver in joined:
                        receiver.close()
                    raise
                self._receiver = BroadcastReceivers(joined)
                return
            if init_info.senders:  # a trainer of several ranks: the group of ours
                index, senders = at, init_info.senders
                group, at = senders[index % len(senders)], 1 + index // len(senders)
            self._receiver = BroadcastReceiver.join(group, rank=at, device=device)
            return
        config: dict[str, Any] = {
            "address": init_info.address,
            "secret": init_info.secret,
            "nonce": init_info.nonce,
            "timeout_ms": init_info.timeout_ms,
        }
        if init_info.senders:
            config = init_info.senders[(init_info.rank_offset + rank) % len(init_info.senders)]
        self._receiver = WeightReceiver.from_config(config, name=f"{init_info.name}-rank{rank}")
        self._receiver.connect()

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.24; asyncroll's trainer side is ``asyncroll.WeightPusher``."""
        raise NotImplementedError("asyncroll pushes with asyncroll.weights.WeightPusher")

    @property
    def direct(self) -> bool:
        return self._info is not None and self._info.load == "direct"

    def start_weight_update(self) -> None:
        assert self._info is not None, "init_weight_transfer_engine first"
        self._begin()
        if not self.direct:
            layerwise.initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version synchronises torch.accelerator, which the CPU build lacks.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(
        self,
        update_info: UpdateInfo,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ) -> None:
        """Receive one push. ``load_weights`` is given by vLLM 0.24, whose worker has already
        started the layerwise reload (and will finish it) around this call, or, for a
        ``direct`` load (``start_weight_update(is_checkpoint_format=False)``), started nothing:
        its loader copies kernel-format names, so the model's own loader is used instead."""
        assert self._info is not None, "init_weight_transfer_engine or open_landing first"
        self._push_id = update_info.push
        self.entered = time.perf_counter()
        self.stamps = {"entered": self.entered}
        self.select(landed=update_info.landed)
        landed: LandedPush | None = None
        if update_info.landed:
            if self._landing is None:
                raise WeightSyncError("no landing thread in this worker (open_landing)")
            landed = self._landing.take(update_info.push)
            if landed is None:
                raise WeightSyncError(
                    f"push {update_info.push} did not land in this worker ({self._landing!r})"
                )
        self.check.begin()
        with _outside_device_context() as self._device_context:
            try:
                self._receive(load_weights, landed)
            finally:
                self._device_context = contextlib.nullcontext

    def select(self, *, landed: bool) -> None:
        """Load the push that comes next as its sender said: the landing thread's
        (``landed``), or the worker's own receiver's."""
        info = self._landing_info if landed else self._receiver_info
        if info is not None:
            self._info = info

    def holds_landed(self, push: int) -> bool:
        """Push ``push`` has landed here and waits for its take."""
        return self._landing is not None and self._landing.holds(push)

    def open_landing(self, config: Mapping[str, Any]) -> None:
        """Receive pushes from the sender ``config`` describes on a thread of this worker's
        own, while the engine steps (``asyncroll.receive.landing``); an update whose
        ``UpdateInfo.landed`` is set then loads the push landed there, as ``config`` says
        (``InitInfo``: backup, load, plan)."""
        self.close_landing()
        known = {field.name for field in dataclasses.fields(InitInfo)}
        self._landing_info = InitInfo(**{k: v for k, v in config.items() if k in known})
        rank = self.parallel_config.rank
        receiver = WeightReceiver.from_config(
            {key: config[key] for key in ("address", "secret", "nonce", "timeout_ms")},
            name=f"{config.get('name', 'engine')}-rank{rank}-landing",
        )
        receiver.connect()
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._landing = WeightLanding(
            receiver, device, prepare=self._prepare_backup, name=f"asyncroll-landing-rank{rank}"
        )

    def close_landing(self) -> None:
        """Stop the landing thread, if any (``open_landing``)."""
        landing, self._landing = self._landing, None
        if landing is not None:
            if self._plan is not None:  # it keeps views of the landed tensors
                self._plan.forget_sources()
            landing.close()

    def _prepare_backup(self) -> None:
        """The backup of the served weights, taken ahead of the commit (on the landing's
        thread and stream: ``Rollback.prepare``), where a direct load keeps one."""
        info = self._landing_info
        if info is not None and info.backup and info.load == "direct" and not self.rollback.active:
            with torch.no_grad():  # (an update in progress keeps the backup it took)
                self.rollback.prepare(self.model)

    def _receive(
        self,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None,
        landed: LandedPush | None = None,
    ) -> None:
        """``receive_weights`` outside vLLM's ``torch.device`` mode: every tensor op of the
        hot path (slot views, the plan's copies, its checks) would otherwise run through a
        Python ``__torch_function__`` (three times slower an op; on a 7B push most of the
        receiver's time). The model's own loaders run inside it again (``_under_device``), as
        vLLM calls them."""
        assert self._info is not None and (self._receiver is not None or landed is not None)
        worker_driven = load_weights is not None
        direct = self.direct
        loader: Callable[[list[tuple[str, torch.Tensor]]], Any] = (
            self.model.load_weights  # type: ignore[assignment]
            if direct or load_weights is None
            else load_weights
        )
        load_batch: Callable[[list[tuple[str, torch.Tensor]]], Any] = functools.partial(
            self._under_device, loader
        )
        self._planning = direct and self._info.plan
        if self._planning:
            if self._plan is None or self._plan.model is not self.model:
                self._plan = LoadPlan(
                    self.model,
                    functools.partial(self._under_device, self.model.load_weights),  # type: ignore[arg-type]
                )
            # The check of the parameters waits for a one-copy push's replay to be queued:
            # it then overlaps the copies (the receive syncs the device before we end the
            # push, which a replay into moved parameters needs; vLLM moves parameters only by
            # replacing them, whose old storage the replay keeps alive).
            self._plan.begin_push(check_late=True)
            load_batch = self._plan.load
        if worker_driven:
            self._begin()
        self.stamps["began"] = time.perf_counter()
        rollback = self.rollback
        keep = rollback.keeps_copies
        received: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        handed: set[str] = set()
        """Names that arrived, and names that reached the model's loader (or their place):
        a push where they differ loaded less than it delivered, and fails loudly."""

        assembly = Assembly() if self._info.fan_in else None
        """Fed by every trainer rank: pieces the loader cannot take as they are, put together."""

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            parts: dict[str, Part] = getattr(batch, "parts", None) or {}
            persist = bool(getattr(batch, "sources_persist", False))
            whole_push = bool(getattr(batch, "whole_push", False))
            if parts and assembly is not None:
                plan = self._plan if self._planning else None
                batch, parts, skipped = assembly.take(
                    batch, parts, route=plan.piece_route if plan is not None else None
                )
                for name, dtype, whole in skipped:  # another rank's rows: delivered, not read
                    received[name] = (dtype, whole)
                    handed.add(name)
                persist = persist and not parts
            arrived = batch
            if parts and not self._planning:
                raise PieceNotPlannedError(
                    f"pieces of tensors ({next(iter(parts))!r}, ...) need the direct load with a"
                    " load plan"
                )
            if not direct:  # what arrived, for the tensors no longer whole once loaded
                self.check.note_arrived(arrived)
            self.before_load(batch)
            batch = self.to_load(batch)
            rollback.loading()
            self.stamps.setdefault("loading", time.perf_counter())  # the first batch's
            try:
                if batch and parts:
                    assert self._plan is not None
                    try:
                        self._plan.load(batch, parts=parts, sources_persist=persist)
                    except PieceNotPlannedError:
                        if assembly is None:
                            raise
                        # Its pieces are each one the plan loads (routed above): a whole
                        # tensor that loads only with its batch refused them together. Never
                        # put them together now: their other pieces were loaded or skipped.
                        self._plan.load_apart(batch, parts=parts, sources_persist=persist)
                elif batch:
                    load_batch(batch)
            except PieceNotPlannedError:
                raise
            except Exception as exc:  # name the tensors: vLLM's loaders often say nothing
                names = ", ".join(name for name, _ in batch[:4])
                raise RuntimeError(f"loading [{names}]: {type(exc).__name__}: {exc}") from exc
            received.update(  # after the loads: the device starts on them sooner
                (name, (t.dtype, parts[name].whole if name in parts else tuple(t.shape)))
                for name, t in arrived
            )
            self.stamps["queued"] = time.perf_counter()  # the last batch's copies
            handed.update(name for name, _ in batch)
            rollback.loaded(batch)
            if not direct:
                _detach_pending_views()
            if whole_push:  # one copy: nothing more of the push to load
                self._read_prints_early(received)

        place: PlaceFn | None = None
        if self._planning and self._plan is not None and not keep:
            plan = self._plan

            def place(
                name: str, dtype: torch.dtype, shape: tuple[int, ...], part: Part | None
            ) -> torch.Tensor | None:
                """A tensor larger than a bucket (an embedding) goes straight where the plan
                says, piece by piece, with no reassembly and no second copy."""
                target = plan.destination(name, dtype, shape, part)
                if target is not None:
                    received[name] = (dtype, tuple(shape) if part is None else part.whole)
                    self.before_load([(name, target)])
                    if not self.to_load([(name, target)]):
                        return torch.empty(0, dtype=torch.uint8)  # dropped: counted below
                    handed.add(name)
                    rollback.placed(name)
                return target

        def check(report: ReceiveReport) -> None:
            """What was loaded, checked (in a broadcast, before the group's verdict)."""
            self.last_report = report
            if assembly is not None and assembly.incomplete:
                raise WeightSyncError(
                    f"push {report.push}: pieces of {', '.join(assembly.incomplete[:3])}"
                    " arrived, not all of them"
                )
            check_delivered(report, set(received), handed)
            if not direct:
                self._complete_partial_layers(load_batch)
            self.after_load()
            if not direct and not worker_driven:
                # Finish the layerwise reload here, not in finish_weight_update, so that the
                # weights are in place to be verified, and a failure still rolls back.
                with self._device_context():
                    layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
                        self.model, self.model_config
                    )
                self._finalized = True
            if direct or not worker_driven:  # (vLLM 0.24 finalizes a layerwise load later)
                self.check.verify(self.model, self._active_plan(), report, received)

        try:
            if landed is not None:
                report = landed.replay(load)
                self.stamps["loaded"] = time.perf_counter()
                check(report)
                self.stamps["checked"] = time.perf_counter()
            elif isinstance(self._receiver, BroadcastReceiver | BroadcastReceivers):
                self._receiver.receive(load, place=place, after=check)
            else:
                assert self._receiver is not None
                check(self._receiver.receive(load, place=place, push=self._push_id))
        except BaseException:
            with self._device_context():  # a rollback reloads through vLLM, as it expects
                self.abort_update()
            raise
        finally:
            if self._planning and self._plan is not None:
                self._plan.end_push()  # the last push's unused copies: their sources may be gone
        if worker_driven:  # 0.24 finishes the reload itself and never calls our finish
            self._commit()

    def receive_adapter(
        self, push: int, layout: tuple[Placement, ...], landing: Landing | None = None
    ) -> AdapterTake:
        """Receive one adapter push (packed as ``layout`` says) into memory of its own (into
        ``landing`` where given), checked (``AdapterTake``); the served weights are not
        touched."""
        assert self._receiver is not None, "init_weight_transfer_engine first"
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        take = AdapterTake(device, layout, landing)
        with _outside_device_context():
            if isinstance(self._receiver, BroadcastReceiver | BroadcastReceivers):
                self.last_report = self._receiver.receive(take.load, after=take.check)
            else:
                self.last_report = self._receiver.receive(take.load, push=push)
                take.check(self.last_report)
        return take

    def _active_plan(self) -> LoadPlan | None:
        """The load plan, where the push in progress loads through it."""
        return self._plan if self._planning else None

    def _read_prints_early(
        self, received: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> None:
        """Queue the check's read of the loaded tensors early (``PushCheck.read_early``),
        unless something may change them between the loads and the check (an ``after_load``
        of a subclass, or an injected fault)."""
        if "after_load" in vars(self) or (
            type(self).after_load is not AsyncrollWeightTransferEngine.after_load
        ):
            return
        self.check.read_early(self._active_plan(), received)

    def _under_device(
        self, loader: Callable[[list[tuple[str, torch.Tensor]]], Any], batch: list[Any]
    ) -> Any:
        """The model's own loader, under the ``torch.device`` mode vLLM calls it in."""
        with self._device_context():
            return loader(batch)

    def drop_plan(self) -> None:
        if self._plan is not None:
            self._plan.forget_sources()
        self._plan = None

    def read_ranges(self) -> dict[str, tuple[int, ...]] | None:
        """The element range of each pushed tensor that this worker's load reads
        (``LoadPlan.read_ranges``); None without a load plan."""
        if not self._planning or self._plan is None:
            return None
        return self._plan.read_ranges()

    @property
    def plan_statistics(self) -> PlanStatistics | None:
        """What the load plan did in the last push (None: no plan, e.g. a layerwise load)."""
        return self._plan.statistics() if self._plan is not None and self._planning else None

    def before_load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Called before each batch goes to the model's loader (an extension point:
        ``asyncroll.testing.faults`` injects failures here). A tensor the load plan places
        piece by piece as it arrives comes alone, before its first piece, with its
        destination as the tensor."""

    def to_load(self, batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The part of a received batch that goes to the model's loader: all of it (an
        extension point: ``asyncroll.testing.faults`` drops tensors here, as a loader that
        silently skips names would; the push then fails, naming them)."""
        return batch

    def after_load(self) -> None:
        """Called once every tensor of a push is loaded, before the push is acknowledged (an
        extension point, as ``before_load``)."""

    def finish_weight_update(self) -> None:
        if not self.direct and not self._finalized:
            layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
                self.model, self.model_config
            )
        self._commit()

    def abort_update(self) -> bool:
        """End an update in progress, if any: restore the previous weights where a backup
        exists. Returns whether the weights served now are whole (previous, or untouched)."""
        self.check.discard()
        if self.direct:
            whole = self.rollback.abort(self.model)
            if torch.cuda.is_available() and self.device is not None and (
                torch.device(self.device).type == "cuda"
            ):  # the restore is done before a landing thread's next backup reads them
                torch.cuda.synchronize(self.device)
            return whole
        return self.rollback.abort(
            self.model,
            end=functools.partial(_end_layerwise_reload, self.model, self.model_config),
            restore=functools.partial(reload_weights, self.model, self.model_config),
        )

    def shutdown(self) -> None:
        """Close the receiver (vLLM's ``shutdown_weight_transfer_engine``, and a detach). A
        landing thread is another sender's: it stops on its own call (``close_landing``)."""
        if self._plan is not None:  # it holds views of the receiver's buffers
            self._plan.forget_sources()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    # -- internals -------------------------------------------------------------------------

    def _begin(self) -> None:
        """Start an update: take what a rollback needs (``Rollback.begin``)."""
        assert self._info is not None
        self._finalized = False
        repacking = self._repacking_experts()
        if repacking and self.direct:  # (the sender refuses it first: VLLMWeightPort)
            raise WeightSyncError(direct_load_refusal(repacking))
        self.rollback.begin(
            self.model,
            backup=self._info.backup,
            direct=self.direct,
            checkpoint=functools.partial(_read_checkpoint, self.model_config),
        )

    def _repacking_experts(self) -> list[str]:
        """``compat.repacking_experts`` of the served model, found (and fixed) once."""
        if self._repacking is None or self._repacking[0] is not self.model:
            self._repacking = (self.model, repacking_experts(self.model))
        return self._repacking[1]

    def can_roll_back(self) -> bool:
        """Whether a push that fails now can be undone (``Rollback.can_roll_back``)."""
        if self._info is None:
            return False
        return self.rollback.can_roll_back(backup=self._info.backup, direct=self.direct)

    def _commit(self) -> None:
        self.rollback.commit(functools.partial(_covers_checkpoint, self.model_config))

    def _complete_partial_layers(
        self, load_batch: Callable[[list[tuple[str, torch.Tensor]]], Any]
    ) -> None:
        """A layer the push touched but did not fill (one member of a fused q/k/v, say) would
        be processed with undefined values: fill it from the shadow, or fail."""
        partial = _partially_loaded_layers(self.model)
        if not partial:
            return
        shadow, pending = self.rollback.shadow, self.rollback.pending
        if shadow is None:
            names = _checkpoint_names(self.model_config)
            if not names or names <= pending.keys():
                return  # padding (vLLM finishes such layers itself), or nothing to tell by
            raise RuntimeError(
                f"a partial update touched {partial[:3]} without filling them; on the layerwise "
                "load path that needs a backup (WeightPusher(backup=True)) to fill in the rest"
            )
        rest = [(n, t) for n, t in shadow.items() if n not in pending]
        load_batch(rest)  # completed or untouched layers reload unchanged values

_BURIED_LOGGED = False


@contextlib.contextmanager
def _outside_device_context() -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """Pop the ``torch.device`` modes on top of the torch-function mode stack (vLLM 0.24's
    worker calls ``receive_weights`` under one) for the block; yields a context manager that
    puts them back while it is entered (for the model's loaders)."""
    popped: list[Any] = []
    while torch._C._len_torch_function_stack() and isinstance(
        torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1), DeviceContext
    ):
        popped.append(torch._C._pop_torch_function_stack())
    if not popped and any(
        isinstance(torch._C._get_function_stack_at(i), DeviceContext)
        for i in range(torch._C._len_torch_function_stack())
    ):
        global _BURIED_LOGGED
        if not _BURIED_LOGGED:  # the receive still works, at the slower speed
            _BURIED_LOGGED = True
            logger.info("a torch.device mode lies under another mode: receiving under it")

    @contextlib.contextmanager
    def restored() -> Iterator[None]:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)
        try:
            yield
        finally:
            for _ in popped:
                torch._C._pop_torch_function_stack()

    try:
        yield restored
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def delivery_of(engine: object) -> dict[str, Any] | None:
    """What the worker took in its last push (the port's ``take`` sums the workers')."""
    report = getattr(engine, "last_report", None)
    if report is None:
        return None
    check = getattr(engine, "check", None)
    verified = check.verified if isinstance(check, PushCheck) else (0, 0)
    return {"version": report.version, "tensors": report.tensors, "bytes": report.bytes,
            "verified": list(verified)}


def _read_checkpoint(model_config: Any) -> dict[str, torch.Tensor] | None:
    """The checkpoint the engine loaded at start-up, or None (no safetensors files: e.g. an
    engine started with ``load_format="dummy"`` serves weights no file holds)."""
    from safetensors.torch import load_file

    if model_config is None or getattr(model_config, "load_format", "auto") == "dummy":
        return None
    files = sorted(Path(str(model_config.model)).glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors or None


def _checkpoint_names(model_config: Any) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(str(model_config.model)).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            names.update(handle.keys())
    return names


def _covers_checkpoint(model_config: Any, tensors: Mapping[str, torch.Tensor]) -> bool:
    names = _checkpoint_names(model_config)
    return bool(names) and names <= tensors.keys()


def _partially_loaded_layers(model: torch.nn.Module) -> list[str]:
    partial = []
    for name, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None and info.can_load() and 0 < info.load_numel < (
            info.load_numel_total or 0
        ):
            partial.append(name)
    return partial


def _end_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """Close a layerwise reload that failed part-way, whatever state its layers are in."""
    try:
        layerwise.finalize_layerwise_reload(  # type: ignore[no-untyped-call]
            model, model_config
        )
    except Exception:  # a layer buffered a bad load: put every pending layer's tensors back
        logger.exception("finalizing a failed reload failed; restoring the kernel tensors")
        place = getattr(layerwise, "_place_kernel_tensors", None)
        for module in model.modules():
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue
            if place is not None and info.kernel_tensors is not None:
                place(module, info)
            info.reset()  # type: ignore[no-untyped-call]


def reload_weights(
    model: torch.nn.Module, model_config: Any, tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Load checkpoint-format tensors through vLLM's layerwise reload (any model, any build)."""
    layerwise.initialize_layerwise_reload(model)
    model.load_weights(list(tensors))  # type: ignore[operator]
    layerwise.finalize_layerwise_reload(model, model_config)  # type: ignore[no-untyped-call]


def _detach_pending_views() -> None:
    """Copy tensors the layerwise loader still holds: they view a staging buffer."""
    for info in list(layerwise.LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor):
                    bound.arguments[key] = value.clone()


class AsyncrollWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); reachable by ``collective_rpc``."""

    def asyncroll_bind_weight_transfer_engine(self) -> None:
        """Give the weight-transfer engine the configs vLLM 0.24 builds it without."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and getattr(engine, "model_config", None) is None:
            engine.model_config = self.model_config  # type: ignore[attr-defined]
            engine.device = self.device  # type: ignore[attr-defined]

    def asyncroll_prepacked_experts(self) -> list[str]:
        """The served model's expert layers kept in a layout of their own
        (``compat.repacking_experts``): a ``load="direct"`` push cannot reach them."""
        return repacking_experts(self.get_model())  # type: ignore[attr-defined]

    def asyncroll_rendezvous(self) -> str | None:
        """Where this worker's process group met (``distributed_init_method``): vLLM 0.32's
        single-node engines meet in a ``file://`` store in the temp directory, which vLLM never
        removes; the engine removes it when it closes."""
        return getattr(self, "distributed_init_method", None)

    def asyncroll_count_samples(self) -> bool:
        """Count, from now on, the tokens each request has had sampled (``SampleCounter``):
        an update committed between two steps (``inflight``) reports where each request's
        tokens switch weights. Idempotent. False where the count would be wrong: a
        speculative decoder samples several tokens a step."""
        worker: Any = self
        if getattr(worker, "_asyncroll_samples", None) is not None:
            return True
        if getattr(worker.vllm_config, "speculative_config", None) is not None:
            return False
        runner = worker.model_runner
        batch = getattr(runner, "input_batch", None)
        if not hasattr(runner, "discard_request_mask") or not hasattr(batch, "req_id_to_index"):
            return False  # another model runner than the one counted here (vLLM's v2)
        worker._asyncroll_samples = SampleCounter(runner)
        return True

    def asyncroll_take_update(
        self,
        update_info: dict[str, Any],
        layerwise: bool,
        finish: bool = False,
        inflight: bool = False,
    ) -> str | dict[str, Any] | None:
        """vLLM's ``start_weight_update`` then ``update_weights``, in one RPC (the weight
        port's ``take``): the workers join a push one round trip sooner.
        ``finish``: then ``finish_weight_update`` too, in the same RPC (the delivery then says
        ``finished``): the engine's commit needs no RPC to the workers of its own.

        Returns why this worker failed the push, or what it took (``delivery_of``; None with
        another weight-transfer engine than asyncroll's): the
        engine's report of the update needs no RPC of its own, which a busy engine would
        answer only between two steps. It does not raise: when one worker of several raises
        in an RPC, vLLM's executor raises at the first error and leaves the other workers'
        answers queued, where the next RPC (the rollback) reads them.

        ``inflight``: the engine was not paused; this RPC runs between two of its steps (vLLM's
        EngineCore answers RPCs there), so no forward pass sees part of the push. It finishes
        the update itself, rolls a failed push back before returning (the next step must not
        run on a torn model), and its delivery says, under ``sampled``, how many tokens each
        running request had sampled by forward passes queued before it (``SampleCounter``):
        those came from the old weights, every later one from the new."""
        called = time.perf_counter()
        worker: Any = self
        counter: SampleCounter | None = getattr(worker, "_asyncroll_samples", None)
        if inflight and (counter is None or counter.broken):
            return "the engine counts no samples (asyncroll_count_samples): no inflight update"
        engine = getattr(worker, "weight_transfer_engine", None)
        landed = bool(update_info.get("landed"))
        if isinstance(engine, AsyncrollWeightTransferEngine):
            engine.select(landed=landed)  # (before vLLM's start: it takes the backup)
            if landed and not engine.holds_landed(int(update_info.get("push", 0))):
                return (f"push {update_info.get('push')} did not land in this worker"
                        f" ({engine._landing!r})")
        if inflight and isinstance(engine, AsyncrollWeightTransferEngine):
            if not engine.can_roll_back():
                return ("no inflight update: this worker could not undo a failed push before the"
                        " next step (no backup, or an earlier push without one left no copy)")
        try:
            if worker_runs_the_session():  # vLLM 0.24
                worker.start_weight_update(is_checkpoint_format=layerwise)
            else:
                worker.start_weight_update()
            worker.update_weights(update_info)
            engine = getattr(worker, "weight_transfer_engine", None)
            if not isinstance(engine, AsyncrollWeightTransferEngine):
                return None  # not finished here: the adapter sends the finish RPC
            engine.stamps["updated"] = time.perf_counter()
            delivered = delivery_of(engine)
            if delivered is None:
                return None  # (likewise)
            if finish or inflight:
                worker.finish_weight_update()
                engine.stamps["finished"] = time.perf_counter()
            delivered["finished"] = finish or inflight  # else the adapter finishes
            if counter is not None and inflight:
                delivered["sampled"] = counter.report()
            engine.called, engine.returned = called, time.perf_counter()
            return delivered
        except Exception as exc:
            logger.warning("rank %s failed the push: %r", getattr(worker, "rank", "?"), exc)
            why = f"{type(exc).__name__}: {exc}"
            if inflight and not self.asyncroll_abort_weight_update():
                why += " (and no backup to restore: the weights are torn)"
            return why

    def asyncroll_open_weight_landing(self, config: dict[str, Any]) -> None:
        """Receive full-weight pushes from the sender ``config`` describes on a thread of this
        worker's own, while the engine steps (``AsyncrollWeightTransferEngine.open_landing``);
        ``config`` also says how they load (``InitInfo``: backup, load, plan), kept apart from
        what the worker's own receiver was told."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AsyncrollWeightTransferEngine):
            raise RuntimeError("the engine was started without asyncroll's weight transfer")
        engine.open_landing(config)

    def asyncroll_close_weight_landing(self) -> None:
        """Stop the landing thread, if any (``asyncroll_open_weight_landing``)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, AsyncrollWeightTransferEngine):
            engine.close_landing()

    def asyncroll_abort_weight_update(self) -> bool:
        """End a weight update that did not finish (the trainer failed or was cancelled after
        ``start_weight_update``): roll back, close vLLM's session so the next update can
        start. Idempotent. Returns whether the served weights are whole."""
        engine = getattr(self, "weight_transfer_engine", None)
        whole = engine.abort_update() if isinstance(engine, AsyncrollWeightTransferEngine) else True
        if getattr(self, "_weight_update_active", False):
            self._weight_update_active = False
            reset = getattr(engine, "reset_weight_update_target", None)
            if reset is not None:
                reset()
        return bool(whole)

    def asyncroll_adapter_layout(self) -> dict[str, Any] | None:
        """What this worker's LoRA serves (``asyncroll.vllm.lora``); None: LoRA is off."""
        store = store_of(self)
        return None if store is None else store.layout()

    def asyncroll_take_adapter(
        self,
        update_info: dict[str, Any],
        revision: int,
        config: dict[str, Any],
        drop: list[int] | None = None,
        layout_key: str = "",
        layout: list[Any] | None = None,
    ) -> str | dict[str, Any]:
        """Forget the revisions in ``drop``, then receive an adapter push (packed as the layout
        named ``layout_key`` says: ``layout`` the first time, kept after) and register it as
        LoRA ``revision`` (the adapter port's ``take``).
        It runs between two engine steps; nothing served changes but the set of revisions.
        Returns what the worker took, or why it failed (as ``asyncroll_take_update``, it
        does not raise)."""
        engine = getattr(self, "weight_transfer_engine", None)
        store = store_of(self)
        try:
            if store is None:
                return "the engine was started without LoRA (enable_lora=True)"
            called = time.perf_counter()
            for gone in drop or ():
                store.drop(gone)
            landings: Landings | None = self.__dict__.get("_asyncroll_landings")
            if landings is not None:  # (their registrations, queued before, have run)
                landings.expect(None)
                landings.release_all()
            if not isinstance(engine, AsyncrollWeightTransferEngine):
                return "no asyncroll weight-transfer engine in this worker"
            dropped = time.perf_counter()
            layouts: dict[str, tuple[Placement, ...]] = self.__dict__.setdefault(
                "_asyncroll_layouts", {})
            known = placements(layout) if layout is not None else layouts.pop(layout_key, None)
            if known is None:
                return f"unknown adapter layout {layout_key!r}: send it with the push"
            layouts.pop(layout_key, None)
            layouts[layout_key] = known  # the most recently named last
            while len(layouts) > LAYOUTS_KEPT:
                layouts.pop(next(iter(layouts)))
            landing = store.landing(known)  # a dropped revision's memory, its views made
            try:
                take = engine.receive_adapter(int(update_info.get("push", 0)), known, landing)
                received = time.perf_counter()
                how = store.add(revision, take, config)
            except BaseException:
                store.release(landing)  # (``add`` holds nothing of a revision it refused)
                raise
            registered = time.perf_counter()
            if landings is not None:
                landings.expect(known)  # the layout the landing thread's next pushes are of
            report = engine.last_report
            assert report is not None
            first = report.timeline[0] if report.timeline else None
            return {"version": report.version, "tensors": len(take.layout),
                    "bytes": report.bytes, "verified": list(take.verified), "registered": how,
                    "seconds": {"drop": dropped - called, "receive": received - dropped,
                                "of which check": take.check_seconds,
                                **{f"check: {k}": v for k, v in take.seconds.items()},
                                **{f"register: {k}": v for k, v in store.seconds.items()},
                                "register": registered - received},
                    # ``time.perf_counter()``: one clock for every process of the host
                    "stamps": {"called": called, "receive began": report.began,
                               "first arrived": first.arrived if first else 0.0,
                               "first received": first.received if first else 0.0,
                               "first acked": first.acked if first else 0.0,
                               "checked": received, "registered": registered}}
        except Exception as exc:
            logger.warning("rank %s failed the adapter push: %r", getattr(self, "rank", "?"), exc,
                           exc_info=True)
            return f"{type(exc).__name__}: {exc}"

    def asyncroll_open_landings(self, config: dict[str, Any], layout_key: str = "") -> None:
        """Receive adapter pushes from the sender ``config`` describes on a thread of this
        worker's own, while the engine steps (``asyncroll.receive.adapter.Landings``); they
        are of the layout named ``layout_key`` (then of the one each later
        ``asyncroll_take_adapter`` takes; none: they fail until one does)."""
        store = store_of(self)
        if store is None:
            raise RuntimeError("the engine was started without LoRA (enable_lora=True)")
        self.asyncroll_close_landings()
        rank = getattr(self, "rank", 0)
        receiver = WeightReceiver.from_config(
            {key: config[key] for key in ("address", "secret", "nonce", "timeout_ms")},
            name=f"{config.get('name', 'engine')}-rank{rank}-landings",
        )
        receiver.connect()
        device = getattr(self, "device", None)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        landings = Landings(receiver, device, store.landing, store.release,
                            name=f"asyncroll-landings-rank{rank}")
        layouts: dict[str, tuple[Placement, ...]] = self.__dict__.get("_asyncroll_layouts", {})
        if layout_key in layouts:
            landings.expect(layouts[layout_key])
        self._asyncroll_landings = landings

    def asyncroll_close_landings(self) -> None:
        """Stop the landing thread, if any (``asyncroll_open_landings``)."""
        landings: Landings | None = self.__dict__.pop("_asyncroll_landings", None)
        if landings is not None:
            landings.close()

    def asyncroll_register_adapter(
        self, revision: int, push: int, config: dict[str, Any], drop: list[int] | None = None
    ) -> str | dict[str, Any]:
        """Forget the revisions in ``drop``, then register as LoRA ``revision`` the adapter
        push ``push`` the landing thread received and checked. Runs between two engine steps,
        queued ahead of every request sent after it. Should the registration fail, the
        revision is still kept as it landed: vLLM builds it when a step first needs it.
        Returns how it was registered, or why not (it does not raise)."""
        store = store_of(self)
        landings: Landings | None = self.__dict__.get("_asyncroll_landings")
        try:
            if store is None or landings is None:
                return "no landing thread in this worker (asyncroll_open_landings)"
            called = time.perf_counter()
            for gone in drop or ():
                try:
                    store.drop(gone)
                except Exception:  # the registration still goes on
                    logger.warning("rank %s: dropping adapter revision %s failed",
                                   getattr(self, "rank", "?"), gone, exc_info=True)
            take = landings.take(push)
            if take is None:
                return f"push {push} did not land in this worker ({landings!r})"
            dropped = time.perf_counter()
            try:
                how = store.add(revision, take, config, keep_on_failure=True)
            except Exception as exc:
                logger.warning("rank %s: registering adapter revision %s failed (vLLM loads it"
                               " when a step needs it): %r", getattr(self, "rank", "?"),
                               revision, exc, exc_info=True)
                how = f"held ({type(exc).__name__}: {exc})"
            registered = time.perf_counter()
            return {"registered": how, "verified": list(take.verified),
                    "seconds": {"drop": dropped - called, "register": registered - dropped,
                                **{f"register: {k}": v for k, v in store.seconds.items()}},
                    "stamps": {"called": called, "registered": registered}}
        except Exception as exc:
            logger.warning("rank %s failed to register adapter revision %s: %r",
                           getattr(self, "rank", "?"), revision, exc, exc_info=True)
            return f"{type(exc).__name__}: {exc}"

    def asyncroll_drop_adapter(self, revision: int) -> bool:
        """Forget adapter revision ``revision``; True if this worker held it."""
        store = store_of(self)
        return store is not None and store.drop(revision)

    def asyncroll_shutdown_weight_transfer_engine(self) -> None:
        """Release the receiver's mappings (vLLM 0.24 has no call for it)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()

    def asyncroll_read_ranges(self) -> dict[str, tuple[int, ...]] | None:
        """What of each pushed tensor this worker reads (``LoadPlan.read_ranges``): a
        sharded trainer pushes a worker only its rows where it holds them."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AsyncrollWeightTransferEngine):
            return None
        return engine.read_ranges()


class SampleCounter:
    """How many tokens each request of a model runner has had sampled by the forward passes
    queued so far (not those whose outputs came back: with async scheduling one step is still
    on the device when the EngineCore answers an RPC).

    It wraps the runner's ``execute_model``: after each step that ran the model, every
    scheduled request whose sample the runner keeps (``discard_request_mask`` is clear: its
    prompt is not cut mid-way) counts one token; requests finished since the last step are
    forgotten. One token a step a request: no speculative decoding (``asyncroll_count_samples``
    refuses it)."""

    ENDED_KEPT = 65536
    """How many finished requests' counts are kept for the next inflight update's report."""

    def __init__(self, runner: Any) -> None:
        self.sampled: dict[str, int] = {}
        self.ended: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Counts of requests finished since the last report (``report``): one that ended
        just before a commit may still be waiting in the client for the commit's answer."""
        self.started: collections.deque[float] = collections.deque(maxlen=65536)
        """When each recent step began (``time.perf_counter``: the host's monotonic clock,
        the same in every process; benchmarks read the engine's stalls off it)."""
        self.spans: collections.deque[list[float]] = collections.deque(maxlen=65536)
        """Each recent step's start and end: its forward pass and, where the runner samples
        in a call of its own (``sample_tokens``), its sampling (benchmarks split a gap
        between two steps into the steps' work and what the engine did between them)."""
        self.broken = False
        """Counting failed once (a runner unlike the one this reads): inflight updates are
        refused from then on; the engine's steps go on."""
        self._runner = runner
        self._execute = runner.execute_model
        runner.execute_model = self._counted
        self._sample = getattr(runner, "sample_tokens", None)
        if self._sample is not None:
            runner.sample_tokens = self._sampled

    def _counted(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        self.started.append(began)
        span = [began, began]
        self.spans.append(span)
        try:
            result = self._execute(scheduler_output, *args, **kwargs)
        finally:
            span[1] = time.perf_counter()
        if not self.broken:
            try:
                self.count(scheduler_output)
            except Exception:
                self.broken = True
                logger.exception("counting samples failed: no inflight update from now on")
        return result

    def _sampled(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._sample(*args, **kwargs)  # type: ignore[misc]
        finally:
            if self.spans:
                self.spans[-1][1] = time.perf_counter()

    def report(self) -> dict[str, int]:
        """Every request's count, live or ended since the last report."""
        counts = {**self.ended, **self.sampled}
        self.ended.clear()
        return counts

    def count(self, scheduler_output: Any) -> None:
        ended = self.ended
        for request_id in scheduler_output.finished_req_ids:
            if (count := self.sampled.pop(request_id, None)) is not None:
                ended[request_id] = count
        while len(ended) > self.ENDED_KEPT:
            ended.popitem(last=False)
        if not scheduler_output.total_num_scheduled_tokens:
            return  # the runner returned before preparing a batch: its batch is the last one
        index = self._runner.input_batch.req_id_to_index
        discard = self._runner.discard_request_mask.np
        sampled = self.sampled
        for request_id in scheduler_output.num_scheduled_tokens:
            row = index.get(request_id)
            if row is not None and not discard[row]:
                sampled[request_id] = sampled.get(request_id, 0) + 1


def _register() -> None:
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, AsyncrollWeightTransferEngine)


_register()
