"""Trainer side of a weight update: the update sequence, once, over ``UpdatableEngine``.

``VersionedUpdater`` runs the sequence (check, pause, push, commit, resume) for any engines and
any ``WeightChannel``. ``WeightPusher`` is that sequence with a ``SenderChannel``: one
``WeightSender`` whose receivers are the workers of every engine, reached through each engine's
weight port (``engine.weights``: ``attach``, ``take``, ``commit``, ``abort``, ``detach``; for vLLM
the port maps them onto vLLM's weight-update protocol: ``asyncroll.vllm``).
``testing.FakeWeightUpdater`` is the same sequence with a channel that moves nothing. No vLLM
import here, and no engine internals.

Invariants:
- An update is checked before any engine pauses: ``global_steps`` (a non-negative int within
  vLLM's range, never lower than an engine's), the names, shapes and dtypes against the
  checkpoint each engine was started from, and finite values (``asyncroll.update_check``). A bad
  update raises ``InvalidRequestError`` and touches nothing.
- A push never reaches an engine whose weights are asleep, and versions never go backwards.
- An engine's version label changes only when its push succeeded. Once an update has started in
  the workers, any failure or cancellation ends it there (``weights.abort``):
  each engine serves its previous weights (a backup was restored) or holds, admitting nothing
  until a push succeeds; ``WeightSyncError`` says which. Never a mix.
- Every wait is bounded by ``timeout``: a worker that dies mid-push fails the update, not hangs it.
- No request admitted after an update is served KV the old weights computed: the engines move
  to a new prefix-cache epoch (``VLLMEngine`` salts each request's cache key with it), and the
  ``abort`` and ``recompute`` pauses clear vLLM's cache as well. Only ``keep`` leaves the
  requests that came before the update on the old weights' KV, by design (``ResumeMode``).
- Engines paused here are resumed here, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from asyncroll.errors import (
    InvalidRequestError,
    ReceiverFailedError,
    UnchangedWeightsWarning,
    WeightSyncError,
)
from asyncroll.experts import FUSED_EXPERTS, unfused_experts
from asyncroll.fingerprints import Fingerprinter, fingerprints, packed_fingerprints
from asyncroll.interfaces import (
    INFLIGHT_MODES,
    Delivery,
    ReceivingEngine,
    ResumeMode,
    UpdatableEngine,
    UpdateReport,
    WeightChannel,
)
from asyncroll.transport import (
    CudaIpcBackend,
    LazyTensor,
    Piece,
    PushReport,
    ShmBackend,
    WeightSender,
)
from asyncroll.transport.aio import shielded
from asyncroll.transport.broadcast import (
    FAILED_ELSEWHERE,
    BroadcastSender,
    open_broadcast_sender,
)
from asyncroll.transport.defaults import DEFAULT_BUCKET_BYTES
from asyncroll.transport.plan import ALIGN
from asyncroll.transport.pushes import Prints
from asyncroll.transport.sender import open_weight_sender
from asyncroll.types import PauseMode
from asyncroll.update_check import Schema, check_update, read_checkpoint_schema
from asyncroll.validation import check_global_steps, check_resume_mode

if TYPE_CHECKING:
    from asyncroll.adapters import AdapterRevision, PackedAdapter

__all__ = [
    "SenderChannel",
    "UpdateReport",
    "VersionedUpdater",
    "WeightPusher",
    "default_buffers",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


DEFAULT_BUFFERS = {"shm": 2, "cuda_ipc": 3, "broadcast": 2, "broadcast_cpu": 2}
"""Staging buffers of a staged push, by backend. With CUDA IPC a third buffer keeps the device
copying while a bucket's signal and ack cross between the processes: a 7B update took 10-23%
less time with 3 x 512 MiB than with 2 on an H200 (six runs, one median each), between 8% less
and 8% more on an H100, and the transport alone moved 4-6 points more of the copy limit (H100
78-79% against 74%, H200 74% against 68%), for 512 MiB more GPU memory (sessions 13-15; the
history in docs/benchmarks.md). Shared memory packs in a thread, where a third buffer did not
help (1 MiB buckets on the CPU machine: 0.72 GB/s against 0.86). See ``default_buffers``."""


def default_buffers(backend: str, *, one_copy: bool = False) -> int:
    """The staging buffers a pusher opens when not told: ``DEFAULT_BUFFERS[backend]``, or two
    for a one-copy pusher, whose pushes never pack a bucket (its buffers only keep the
    receivers' handshake; a third would be 512 MiB of GPU memory for nothing)."""
    return 2 if one_copy else DEFAULT_BUFFERS[backend]


class VersionedUpdater:
    """The update sequence, over any ``UpdatableEngine``; ``channel`` moves the bytes.

    Per update: check ``global_steps`` and the tensors, pause the live engines that are awake,
    push, then (shielded from cancellation) release holds, label every engine, move them to a
    new cache epoch;
    resume whatever happened. A failed push ends the update in every engine through the
    channel, and engines left without whole weights hold.
    """

    def __init__(self, engines: Sequence[UpdatableEngine], channel: WeightChannel) -> None:
        self._engines = list(engines)
        self._channel = channel
        self._lock = asyncio.Lock()
        self._fingerprints: dict[str, bytes] | None = None
        """The last update's, when it was fingerprinted (``changed=True``)."""
        self.values_read = False
        """The last update's checks read every tensor for NaN and inf (a rolling update's
        later groups then need not: ``prechecked``)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} engines={[e.name for e in self._engines]}>"

    @property
    def engines(self) -> list[UpdatableEngine]:
        return list(self._engines)

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        global_steps: int | None,
        mode: ResumeMode = "abort",
        changed: bool = False,
        prechecked: bool = False,
    ) -> UpdateReport:
        """Pause, push to every live engine at once, label ``global_steps``, move to a new
        prefix-cache epoch, resume.

        ``prechecked=True`` says these very tensors passed an update's checks a moment ago
        (the manager says it to a rolling update's later groups): their values are not read
        again for NaN and inf; names, shapes and dtypes are still checked against these
        engines. It is the caller's word: tensors never read are not checked.

        ``changed=True`` says the weights differ from the previous update's: each tensor is
        fingerprinted (64 sampled elements, its shape and dtype; a gather and one copy to the
        host, before the pause), and if every fingerprint equals the previous update's, the
        push still goes through but ``UnchangedWeightsWarning`` is issued and logged: a
        trainer pushing stale weights looks like a bad hyperparameter for weeks otherwise.

        Raises:
            EngineSleepingError: an engine's weights are asleep; nothing was pushed.
            InvalidRequestError: bad ``global_steps`` (not a non-negative int, or lower than an
                engine's) or tensors the channel refuses; nothing paused.
            WeightSyncError: no live engine, or the push failed: every engine keeps its
                previous label and serves its previous weights or holds (the error says which).
        """
        global_steps = check_global_steps(global_steps)
        mode = check_resume_mode(mode)
        tensors = materialize(named_tensors)
        # A channel may also rename a trainer's tensors as the engines' checkpoints name them
        # (``SenderChannel.checkpoint_named``: fused experts); optional, so that a channel of
        # one's own (``WeightChannel``) needs nothing more.
        checkpoint_named = getattr(self._channel, "checkpoint_named", None)
        if checkpoint_named is not None:
            tensors = checkpoint_named(tensors)
        if changed and any(isinstance(t, LazyTensor | Piece) for t in tensors.values()):
            raise InvalidRequestError(
                "changed=True compares fingerprints taken before the pause: whole tensors only,"
                " not lazy ones"
            )
        prints = fingerprints(tensors) if changed else None
        async with self._lock:
            engines = [engine for engine in self._engines if not engine.is_dead]
            if not engines:
                raise WeightSyncError("no live engine to update")
            _check_versions(engines, global_steps)
            if mode in INFLIGHT_MODES:
                _check_inflight(engines, self._channel, recompute=mode == "inflight-recompute")
            self.values_read = False
            if prechecked and isinstance(self._channel, SenderChannel):
                await self._channel.check(tensors, finite=False)
            else:
                await self._channel.check(tensors)
            self.values_read = bool(getattr(self._channel, "values_read", False))
            # Kept for the next ``changed=True``: this update's fingerprints, or the channel's
            # own (taken to verify the push) where ``changed`` was not asked for.
            recorded = prints if changed else _channel_fingerprints(self._channel)
            started = time.perf_counter()
            marks = [started]
            pausable = [engine for engine in engines if not engine.is_asleep]
            # ``recompute`` is vLLM's ``keep`` with its caches cleared: the kept requests are
            # preempted, so their KV is computed again, by the new weights, when they resume.
            # ``abort`` and ``keep`` leave vLLM's cache alone: its clear walks the whole block
            # pool (0.6-1.1 s a pause for the tiny model at vLLM's default share of an H200,
            # tens of milliseconds for a 0.5B; docs/performance.md), and
            # the new cache epoch (``_commit``) already puts the old KV out of reach of every
            # request admitted after the update. An abort pause ends every request that came
            # before it: the engine lets requests admitted before the gate closed reach vLLM
            # first (``VLLMEngine.pause``). ``keep`` keeps the old weights' KV for the requests
            # that came before the update (see ``ResumeMode``).
            pause_mode: PauseMode = "abort" if mode == "abort" else "keep"
            if mode in INFLIGHT_MODES:
                pausable = []  # the engines commit between two steps (``ResumeMode``)
            try:
                paused = await asyncio.gather(
                    *(e.pause(pause_mode, clear_cache=mode == "recompute") for e in pausable),
                    return_exceptions=True,
                )
                for outcome in paused:
                    if isinstance(outcome, BaseException):
                        raise outcome
                marks.append(time.perf_counter())
                push = await self._push(engines, tensors, global_steps, mode)
                marks.append(time.perf_counter())
                # The new weights are in: label them and start a new cache epoch even if our caller
                # is cancelled meanwhile (new weights under the old label would be a lie).
                await shielded(_commit(engines, global_steps, marks))
            finally:
                # Shielded: a caller cancelled in the resume must not leave an engine paused.
                await shielded(
                    asyncio.gather(*(e.resume() for e in pausable), return_exceptions=True)
                )
            marks.append(time.perf_counter())
            if changed and prints is not None and prints == self._fingerprints:
                message = (
                    f"the update to global_steps={global_steps} was said to change the weights,"
                    f" but all {len(prints)} tensors pushed equal the previous update's"
                    " (fingerprints): stale weights?"
                )
                logger.warning(message)
                warnings.warn(UnchangedWeightsWarning(message), stacklevel=2)
            self._fingerprints = recorded
            deliveries = self._channel.deliveries()
        steps = [b - a for a, b in itertools.pairwise(marks)]
        return UpdateReport(
            global_steps=global_steps,
            engines=len(engines),
            seconds=marks[-1] - started,
            pause_seconds=steps[0],
            push_seconds=steps[1],
            finish_seconds=steps[2],
            resume_seconds=steps[3],
            push=push,
            tensors=len(tensors),
            bytes=sum(_nbytes(t) for t in tensors.values()),
            deliveries=deliveries,
        )

    async def aclose(self) -> None:
        """Close the channel. Idempotent."""
        await self._channel.aclose()

    async def _push(
        self,
        engines: Sequence[UpdatableEngine],
        tensors: dict[str, torch.Tensor],
        global_steps: int | None,
        mode: ResumeMode,
    ) -> PushReport | None:
        version = global_steps if global_steps is not None else -1
        before = {engine.name: engine.global_steps for engine in engines}
        try:
            return await self._channel.push(engines, tensors, version, mode=mode)
        except BaseException as exc:
            held = await shielded(self._channel.abort(engines))
            # An engine that labelled the push as it landed (a Ray engine, once the push's
            # verdict said every rank took it) keeps it: its weights and label agree.
            took = [
                e.name for e in engines
                if global_steps is not None and e.global_steps != before[e.name]
                and e.name not in held
            ]
            parts = []
            if held:
                parts.append(
                    f"{', '.join(held)} hold partly loaded weights (no backup) and take no "
                    "requests until a push succeeds"
                )
            if took:
                parts.append(f"{', '.join(took)} took the new weights, labelled {global_steps}")
            parts.append(
                f"{'any other' if parts else 'every'} engine serves its previous weights"
            )
            outcome = "; ".join(parts)
            error = WeightSyncError(
                f"weight push (global_steps={global_steps}) failed; {outcome}: "
                f"{_describe([exc])}"
            )
            for engine in engines:
                if engine.name in held:
                    engine.weights.hold(str(error))
            if not isinstance(exc, Exception):
                raise  # cancelled: every engine is whole or holding, as above
            raise error from exc


class SenderChannel:
    """Pushes through one ``WeightSender`` whose receivers are the workers of every engine.

    The checks before any pause: names, shapes and dtypes against the checkpoint each engine
    started from, finite values (``asyncroll.update_check``). The sender is attached to the
    engines it last pushed into; a different set (an engine died, another pusher attached to
    one since) attaches again.
    """

    _receivers_first = True
    """The order of an update's transfer (``_transfer``); False: the sender first, as before
    2026-11-27 (``bench/update_phases.py`` measures both)."""

    def __init__(
        self,
        engines: Sequence[ReceivingEngine],
        *,
        bucket_bytes: int | None = None,
        buffers: int | None = None,
        backend: Literal["auto", "shm", "cuda_ipc", "broadcast"] = "auto",
        backup: bool | None = None,
        timeout: float = 120.0,
        load: Literal["auto", "layerwise", "direct"] = "auto",
        load_plan: bool = True,
        one_copy: bool = False,
        check_finite: bool = True,
        strict_dtype: bool = False,
        verify: bool = True,
        land: bool = False,
    ) -> None:
        if backend not in ("auto", "shm", "cuda_ipc", "broadcast"):
            raise InvalidRequestError(
                f"backend must be auto, shm, cuda_ipc or broadcast, not {backend!r}"
            )
        if backend == "broadcast" and one_copy:
            raise InvalidRequestError("one_copy=True reads through CUDA IPC: not with broadcast")
        if load not in ("auto", "layerwise", "direct"):
            raise InvalidRequestError(f"load must be auto, layerwise or direct, not {load!r}")
        if backend == "broadcast" and land:
            raise InvalidRequestError("land=True receives through CUDA IPC or shm: not broadcast")
        for option, value in (
            ("load_plan", load_plan), ("one_copy", one_copy), ("verify", verify), ("land", land)
        ):
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{option} must be True or False, not {value!r}")
        if buffers is not None and (
            not isinstance(buffers, int) or isinstance(buffers, bool) or buffers < 1
        ):
            raise InvalidRequestError(f"buffers must be an int of at least 1, not {buffers!r}")
        if bucket_bytes is not None and (
            not isinstance(bucket_bytes, int)
            or isinstance(bucket_bytes, bool)
            or bucket_bytes < ALIGN
            or bucket_bytes % ALIGN
        ):
            raise InvalidRequestError(
                f"bucket_bytes must be a positive multiple of {ALIGN}, not {bucket_bytes!r}"
            )
        self._engines = list(engines)
        self._bucket_bytes = bucket_bytes
        self._buffers = buffers
        self._backend_name = backend
        self._backup = backup
        self._timeout = timeout
        self._load: str = load
        if load == "auto":
            self._load = "direct" if torch.cuda.is_available() else "layerwise"
        self._load_plan = load_plan
        self._one_copy = one_copy
        self._check_finite = check_finite
        self.values_read = False
        """The last ``check`` read every plain tensor for NaN and inf."""
        self._strict_dtype = strict_dtype
        self._verify = verify
        self._land = land
        self._fingerprinter = Fingerprinter()
        self._lazy_fingerprinter = Fingerprinter()
        self._known_prints: dict[str, bytes] = {}
        """Fingerprints of lazy tensors worked out before the push (``know_fingerprints``)."""
        """For lazy tensors, a bucket's at a time as they are made."""
        self._fingerprints: dict[str, bytes] | None = None
        """Of the tensors last checked: they travel with the push that follows."""
        self._schemas: dict[str, Schema | None] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._sender: WeightSender | BroadcastSender | None = None
        self._attached: list[ReceivingEngine] = []
        self._delivered: dict[str, Delivery] = {}
        """What each engine's take returned in the last push."""

    def __repr__(self) -> str:
        return f"<SenderChannel sender={self._sender!r}>"

    @property
    def sender(self) -> WeightSender | BroadcastSender | None:
        return self._sender

    @property
    def verify(self) -> bool:
        return self._verify

    @verify.setter
    def verify(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidRequestError(f"verify must be True or False, not {value!r}")
        self._verify = value

    @property
    def backend_name(self) -> str:
        return self._backend_name

    @property
    def one_copy(self) -> bool:
        return self._one_copy

    @property
    def lands(self) -> bool:
        """Pushes land in the workers' landing threads first (``land=True``)."""
        return self._land

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def fingerprints(self) -> Mapping[str, bytes] | None:
        """The fingerprints ``check`` took of the last update (None: it took none)."""
        return self._fingerprints

    def checkpoint_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers-5 mixture's fused experts as one view per expert and projection,
        where the engines' checkpoints name them so (``asyncroll.experts``)."""
        if not any(name.endswith(FUSED_EXPERTS) for name in tensors):
            return tensors
        known = self.checkpoint_names()
        return unfused_experts(tensors, known) if known else tensors

    def checkpoint_names(self) -> set[str]:
        """The tensor names of the live engines' checkpoints (empty where none is read)."""
        known: set[str] = set()
        for engine in self._live_engines_read():
            schema = self._schemas[engine.model_path]
            if schema is not None:
                known.update(schema.tensors)
        return known

    def _live_engines_read(self) -> list[Any]:
        """The live engines, each one's checkpoint schema read (once a model path)."""
        engines = [engine for engine in self._engines if not engine.is_dead]
        for engine in engines:
            if engine.model_path not in self._schemas:
                self._schemas[engine.model_path] = read_checkpoint_schema(engine.model_path)
        return engines

    async def check(self, tensors: Mapping[str, torch.Tensor], *, finite: bool = True) -> None:
        """Names, shapes, dtypes and finite values (``finite``: these tensors were not read
        for them already), against every engine's checkpoint. The finite check reads every
        byte, in a thread (on a GPU it waits for the trainer's queued kernels); without it
        the check costs microseconds a tensor and runs on the loop (a thread's answer waits
        for a busy loop's next turn: tens of milliseconds under hundreds of callers)."""
        if not tensors:
            raise InvalidRequestError("no tensors to push")
        plain = {n: t for n, t in tensors.items() if not isinstance(t, LazyTensor | Piece)}
        made_later = {  # lazy tensors and pieces: checked by shape and dtype here, by value
            n: torch.empty(  # as made (a piece by its sender)
                t.whole if isinstance(t, Piece) else t.shape, dtype=t.dtype, device="meta"
            )
            for n, t in tensors.items() if isinstance(t, LazyTensor | Piece)
        }
        for name, tensor in tensors.items():
            if isinstance(tensor, Piece):
                try:
                    tensor.part()
                except ValueError as exc:
                    raise InvalidRequestError(f"{name!r}: {exc}") from None
        if self._one_copy:
            if made_later:
                raise InvalidRequestError(
                    "one_copy=True reads the trainer's tensors in place: not lazy tensors"
                )
            for name, tensor in tensors.items():
                if not tensor.is_cuda or not tensor.is_contiguous():
                    raise InvalidRequestError(
                        f"one_copy=True reads the trainer's tensors in place: {name!r} must be"
                        " a contiguous CUDA tensor (push it staged otherwise)"
                    )
        engines = self._live_engines_read()
        if self._land:  # (the landing threads would refuse them after any pause)
            if made_later:
                raise InvalidRequestError(
                    f"land=True lands whole tensors: not lazy tensors or pieces"
                    f" ({next(iter(made_later))!r}, ...)"
                )
            missing = [e.name for e in engines if getattr(e.weights, "landing", None) is None]
            if missing:
                raise InvalidRequestError(
                    f"{', '.join(missing)} cannot land a push (no landing thread: a VLLMEngine"
                    " can)"
                )
        if self._load == "direct":  # an engine's port may know its workers would refuse it
            for engine in engines:
                refusal = getattr(engine.weights, "direct_load_refusal", None)
                if refusal is not None:
                    raise InvalidRequestError(f"{engine.name}: {refusal}")
        served = {e.model_path: e.weights.served_dtype for e in engines}
        self.values_read = False
        for path, schema in self._schemas.items():
            if path in served:  # (the values once: against the first live engine's model)
                values = finite and self._check_finite and not self.values_read
                self.values_read = self.values_read or (values and bool(plain))
                for part, read in ((plain, values), (made_later, False)):
                    if not part:
                        continue
                    check = functools.partial(
                        check_update, part, schema, served_dtype=served[path],
                        strict_dtype=self._strict_dtype, check_finite=read,
                    )
                    if read:
                        await asyncio.to_thread(check)
                    else:
                        check()
        # Fingerprints for the workers to check what they loaded; before any pause (a lazy
        # tensor's as it is made, bucket by bucket).
        self._fingerprints = None
        if self._verify:
            known = {n: p for n, p in self._known_prints.items() if n in made_later}
            self._fingerprints = self._fingerprinter(plain) | known

    async def push(
        self,
        engines: Sequence[Any],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: ResumeMode = "keep",
    ) -> PushReport:
        """Push ``tensors`` into every engine's workers. The ``INFLIGHT_MODES``: the engines
        are not paused; each commits the push between two of its steps (``ReceivingPort``)."""
        if self._land:
            return await self._landed(engines, tensors, version, mode=mode)
        sender = await self._connected(engines, tensors)
        try:
            return await self._transfer(engines, sender, tensors, version, mode=mode)
        except BaseException:
            if isinstance(sender, BroadcastSender):
                # A collective some rank never joined cannot be called off: close the group
                # (every rank's pending operation fails now) and form it again next push.
                sender.close()
            raise

    async def push_adapter(
        self,
        engines: Sequence[Any],
        packed: PackedAdapter,
        revision: AdapterRevision,
        config: Mapping[str, Any],
        *,
        drop: Sequence[AdapterRevision] = (),
        fill: Callable[[], Any] | None = None,
        stamps: dict[str, float] | None = None,
    ) -> PushReport:
        """Push an adapter (checked: ``asyncroll.adapters.check_adapter``; packed:
        ``pack_adapter``) into every engine as ``revision`` (``VLLMAdapterPort.take``): no
        engine pauses, nothing served is written. Each of its tensors is fingerprinted on its
        own. ``drop``: revisions each engine forgets in the same call. ``fill``: writes the
        revision into ``packed`` (whose memory held the last push's) on the loop, once the
        takes have left and before the sender's first message: it overlaps their way to the
        workers, which wait for it inside their engines' step loops (so only a pack that
        fills on the loop: ``PackedAdapter.fills_on_loop``); an ``InvalidRequestError`` it
        raises calls them off and is raised as is.
        ``stamps``: when the push reached its points (``AdapterReport``)."""
        tensors = packed.chunks
        if self._one_copy and not all(t.is_cuda for t in tensors.values()):
            raise InvalidRequestError(
                "one_copy=True reads the pushed storages in place (for an adapter, its pack"
                " on the tensors' device): the adapter's tensors must be CUDA tensors (push it"
                " staged otherwise)"
            )
        self._fingerprints = None
        stamps = stamps if stamps is not None else {}

        def prepare() -> Prints | None:
            if self._receivers_go_first(sender):
                stamps["take left"] = time.perf_counter()
            _filled(fill, stamps)
            return self._adapter_prints(packed, stamps)

        sender = await self._connected(engines, tensors)
        version = revision.global_steps if revision.global_steps is not None else -1

        async def take(engine: Any, push: int, sent: Callable[[], None]) -> Delivery | None:
            delivery: Delivery | None = await engine.adapters.take(
                revision, config, push=push, sent=sent, drop=drop, layout=packed.layout
            )
            return delivery

        try:
            return await self._transfer(
                engines, sender, tensors, version, take=take,
                prepare=prepare if self._verify or fill is not None else None,
            )
        except BaseException as exc:
            # (A value ``fill`` found not finite: before the group's first collective.)
            if isinstance(sender, BroadcastSender) and not isinstance(exc, InvalidRequestError):
                sender.close()
            raise

    async def abort(self, engines: Sequence[Any]) -> list[str]:
        """End the update in every engine's workers; the names of engines left holding."""

        async def abort(engine: ReceivingEngine) -> bool:
            if engine.is_dead:
                return True  # nothing to serve from
            try:
                async with asyncio.timeout(self._timeout):
                    return await engine.weights.abort()
            except Exception:
                logger.exception("%s: could not end the failed update", engine.name)
                return False

        whole = await asyncio.gather(*(abort(e) for e in engines))
        return [e.name for e, ok in zip(engines, whole, strict=True) if not ok]

    def deliveries(self) -> dict[str, Delivery]:
        """What each engine's workers took in the last push, as their takes returned it."""
        return dict(self._delivered)

    async def aclose(self) -> None:
        """Close the sender (receivers release their mappings first). Idempotent."""
        stack, self._stack, self._sender = self._stack, None, None
        attached, self._attached = self._attached, []
        await self._release(stack, attached)

    async def _release(
        self, stack: contextlib.AsyncExitStack | None, attached: Sequence[ReceivingEngine]
    ) -> None:
        """Close a sender's ``stack`` and detach those of ``attached`` still attached to us."""
        if stack is None:
            return
        # The workers' receivers say goodbye (releasing their mappings) while the sender waits;
        # engines that another pusher attached to since are that pusher's to release.
        live = [e for e in attached if not e.is_dead and self._port(e).attached_to is self]
        await asyncio.gather(
            stack.aclose(), *(self._port(engine).detach() for engine in live),
            return_exceptions=True,
        )

    async def _transfer(
        self,
        engines: Sequence[ReceivingEngine],
        sender: WeightSender | BroadcastSender,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: ResumeMode = "keep",
        take: Callable[[Any, int, Callable[[], None]], Awaitable[Delivery | None]] | None = None,
        prepare: Callable[[], Prints | None] | None = None,
    ) -> PushReport:
        """Every engine's take, then the push, failing as soon as any of them fails (a dead
        worker's engine fails its take long before the sender's ack deadline).

        The takes' requests leave before the sender's first step (each port says so:
        ``sent``): the sender's work before its first message (packing the first buckets;
        for one copy, sharing every storage and sealing one message) then overlaps their way
        into the engines and the workers' preparation. The tensors were checked already
        (``check``); a push that still fails before its first message tells the waiting
        receivers so (``receivers_waiting``). A push group (broadcast) starts first: its
        receivers join a collective, which only the sender can open. ``prepare``: makes the
        tensors ready and returns their fingerprints (or what takes them: ``Prints``), once
        the takes have left (before the sender's first step; a failure there calls the
        receivers off); where the sender goes first, before any take leaves."""
        early = self._fingerprints
        lazy = [n for n, t in tensors.items() if isinstance(t, LazyTensor | Piece)]
        if early is not None and not set(tensors) - set(lazy) <= set(early):
            early = None  # not the tensors last checked
        unknown = early is not None and len(early) < len(tensors)
        prints: Prints | None = early
        fingerprint = self._lazy_fingerprinter if lazy and unknown else None
        options: dict[str, Any] = {"fingerprint": fingerprint} if fingerprint is not None else {}
        # The push's id, read before the push can begin (in either order): the workers skip
        # what earlier pushes left in their sockets (one that ended while they were not
        # receiving). Updates through this channel run one at a time.
        push_id = sender.next_push if isinstance(sender, WeightSender) else 0
        receivers_first = self._receivers_go_first(sender)
        if receivers_first:
            options["receivers_waiting"] = True
        self._delivered = {}
        sent = [asyncio.Event() for _ in engines]
        # Where the receivers wait for the sender, the tensors are made ready once the takes
        # have left (a failure calls the receivers off); else before any take leaves.
        later = prepare if receivers_first else None
        if prepare is not None and later is None:
            prints = prepare()

        async def pushed() -> PushReport:
            nonlocal prints
            if receivers_first:
                assert isinstance(sender, WeightSender)
                try:
                    await asyncio.gather(*(event.wait() for event in sent))
                    if later is not None:
                        prints = later()
                except BaseException as exc:  # cancelled: the receivers wait for this push
                    await sender.call_off(version, exc)
                    raise
            return await sender.push(
                tensors, version=version, one_copy=self._one_copy, fingerprints=prints,
                **options,
            )

        async def taken(engine: ReceivingEngine, left: asyncio.Event) -> None:
            if take is not None:  # an adapter's revision (``push_adapter``)
                delivery = await take(engine, push_id, left.set)
            else:
                delivery = await engine.weights.take(
                    version, push=push_id, mode=mode, sent=left.set
                )
            if delivery is not None:
                self._delivered[engine.name] = delivery

        tasks: list[asyncio.Future[Any]] = []
        if not receivers_first:
            tasks.append(asyncio.ensure_future(pushed()))
        takes = [asyncio.ensure_future(taken(e, s)) for e, s in zip(engines, sent, strict=True)]
        tasks += takes
        if receivers_first:
            tasks.append(asyncio.ensure_future(pushed()))
        push = tasks[0] if not receivers_first else tasks[-1]
        try:
            async with asyncio.timeout(self._timeout * 2):
                try:
                    await _until(None, tasks)
                except ReceiverFailedError:
                    # The failing receivers' engines say why, and say it at once: they
                    # failed before the push's verdict told the sender (and the others).
                    await asyncio.wait(takes)
                    failures = [
                        r.exception() for r in takes
                        if not r.cancelled() and r.exception() is not None
                    ]
                    failures.sort(key=lambda f: FAILED_ELSEWHERE in str(f))
                    if failures:
                        raise failures[0] from None  # type: ignore[misc]
                    raise
            report: PushReport = push.result()
            return report
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _landed(
        self,
        engines: Sequence[Any],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: ResumeMode,
    ) -> PushReport:
        """``land=True``: the push lands in every worker's landing thread while the engines
        step (``asyncroll.receive.landing``), is checked there against the fingerprints, and
        returns once each worker's verdict is in; only then does each engine's take load it
        (``take(landed=True)``): in the inflight modes, between two steps, with no byte left
        to wait for. A push that fails to land anywhere commits nothing anywhere."""
        sender = await self._connected(engines, tensors)
        assert isinstance(sender, WeightSender)
        push_id = sender.next_push
        self._delivered = {}
        report = await sender.push(
            tensors, version=version, one_copy=self._one_copy, fingerprints=self._fingerprints,
            verdicts=True,
        )

        async def taken(engine: Any) -> None:
            delivery = await engine.weights.take(version, push=push_id, mode=mode, landed=True)
            if delivery is not None:
                self._delivered[engine.name] = delivery

        takes = [asyncio.ensure_future(taken(engine)) for engine in engines]
        try:
            async with asyncio.timeout(self._timeout * 2):  # (an engine alive but stuck)
                await _until(None, takes)
        finally:
            for task in takes:
                task.cancel()
            await asyncio.gather(*takes, return_exceptions=True)
        return report

    def _adapter_prints(
        self, packed: PackedAdapter, stamps: dict[str, float]
    ) -> Callable[[], dict[str, bytes]] | None:
        """What takes an adapter push's fingerprints (each tensor's, from the pack, and the
        chunks' own: the transport sends the prints of what it pushes) when the sender calls
        it, once it has signalled the pack's bucket: their reads then overlap the workers'
        copies (``Prints``). None: the channel does not verify."""
        if not self._verify:
            return None

        def fingerprinted() -> dict[str, bytes]:
            chunks = packed.chunks
            self._fingerprints = (
                packed_fingerprints(chunks, packed.layout) | self._fingerprinter(chunks)
            )
            stamps["printed"] = time.perf_counter()
            return self._fingerprints

        return fingerprinted

    def _port(self, engine: Any) -> Any:
        """Where an engine's receivers attach (``ReceivingPort``'s attach, detach,
        ``attached_to``, ``num_workers``): its workers' landing threads with ``land``."""
        return engine.weights.landing if self._land else engine.weights

    def _receivers_go_first(self, sender: WeightSender | BroadcastSender) -> bool:
        """Whether the takes leave before the sender's first step (``_transfer``)."""
        return self._receivers_first and isinstance(sender, WeightSender)

    async def _connected(
        self, engines: Sequence[ReceivingEngine], tensors: Mapping[str, torch.Tensor]
    ) -> WeightSender | BroadcastSender:
        """The sender, attached to the workers of exactly ``engines``. An engine holds one
        receiver: if another channel attached to it since, this one attaches again."""
        if self._sender is not None:
            if self.is_attached(engines):
                return self._sender
            await self.aclose()
        if self._backend_name == "broadcast":
            return await self._joined(engines, tensors)
        on_gpu = any(t.is_cuda for t in tensors.values())
        use_cuda = self._backend_name == "cuda_ipc" or (self._backend_name == "auto" and on_gpu)
        backend = CudaIpcBackend(next(iter(tensors.values())).device) if use_cuda else ShmBackend()
        workers = sum(self._port(e).num_workers for e in engines)
        stack = contextlib.AsyncExitStack()
        sender = await stack.enter_async_context(
            open_weight_sender(
                backend=backend,
                bucket_bytes=self._bucket_bytes or DEFAULT_BUCKET_BYTES[backend.name],
                buffers=self._buffers or default_buffers(backend.name, one_copy=self._one_copy),
                receivers=workers,
                connect_timeout=self._timeout,
                ack_timeout=self._timeout,
            )
        )
        async with _closed_on_failure(stack, "engines could not attach to the sender"):
            config = {**sender.receiver_config(), **self.worker_config()}
            await asyncio.gather(
                sender.wait_receivers(workers),
                *(self._port(e).attach(config, owner=self) for e in engines),
            )
        self._stack, self._sender, self._attached = stack, sender, list(engines)
        return sender

    def know_fingerprints(self, fingerprints: Mapping[str, bytes]) -> None:
        """Fingerprints of lazy tensors of the next push, worked out without making them (a
        sharded trainer's ranks sample their shards: ``asyncroll.distributed``); the push then
        fingerprints nothing as it goes."""
        self._known_prints = dict(fingerprints)

    def inflight_refusal(self) -> str | None:
        """Why this channel cannot commit into running engines, or None (``ResumeMode``)."""
        if not self.worker_config()["backup"]:
            return (
                "an inflight update needs backup=True (the default on CPU): the engines keep"
                " stepping, and a push that fails midway must be undone before their next step"
            )
        return None

    def worker_config(self) -> dict[str, Any]:
        """What the workers are told at attach, beside where the sender is."""
        backup = (not torch.cuda.is_available()) if self._backup is None else self._backup
        return {"backup": backup, "load": self._load, "plan": self._load_plan}

    def is_attached(self, engines: Sequence[ReceivingEngine]) -> bool:
        """Whether the sender is attached to exactly ``engines`` (no attach needed)."""
        if self._sender is None:
            return False
        same = [e.name for e in engines] == [e.name for e in self._attached]
        broken = isinstance(self._sender, BroadcastSender) and self._sender.group.closed
        return same and not broken and all(self._port(e).attached_to is self for e in engines)

    async def adopt(
        self,
        engines: Sequence[ReceivingEngine],
        sender: WeightSender | BroadcastSender,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        """Push through ``sender`` from now on: ``engines`` were attached to it (and to other
        senders: a trainer of several ranks) with ``owner=self``; ``stack`` closes it. The
        old sender closes, and only the engines not attached again are detached: those
        attached again are ours under the same owner, and a detach now would close the
        receivers they just connected (the sender then waits for them in vain)."""
        old_stack, old_attached = self._stack, self._attached
        self._stack, self._sender, self._attached = stack, sender, list(engines)
        again = {id(engine) for engine in engines}
        await self._release(old_stack, [e for e in old_attached if id(e) not in again])

    async def _joined(
        self, engines: Sequence[ReceivingEngine], tensors: Mapping[str, torch.Tensor]
    ) -> BroadcastSender:
        """A push group: rank 0 here (on the tensors' device), then every worker of every
        engine, each engine's ranks in a row; where it meets is this host's routable address
        and a port bound here, so engines on other hosts (a Ray placement) need no setup."""
        first: Any = next(iter(tensors.values()))
        first = first.tensor if isinstance(first, Piece) else first
        device = first.device if first.is_cuda else torch.device("cpu")

        async def join(config: dict[str, Any]) -> None:
            common = {
                **config,
                **self.worker_config(),
                "address": "",
                "nonce": "",
                "secret": "",
                "timeout_ms": int(self._timeout * 1000),
            }
            offsets = itertools.accumulate((e.weights.num_workers for e in engines), initial=1)
            await asyncio.gather(*(
                e.weights.attach({**common, "rank_offset": offset}, owner=self)
                for e, offset in zip(engines, offsets, strict=False)
            ))

        stack = contextlib.AsyncExitStack()
        async with _closed_on_failure(stack, "engines could not join the push group"):
            sender = await stack.enter_async_context(
                open_broadcast_sender(
                    receivers=sum(e.weights.num_workers for e in engines),
                    device=device,
                    join=join,
                    bucket_bytes=self._bucket_bytes or DEFAULT_BUCKET_BYTES[
                        "broadcast" if device.type == "cuda" else "broadcast_cpu"
                    ],
                    buffers=self._buffers or default_buffers(
                        "broadcast" if device.type == "cuda" else "broadcast_cpu"
                    ),
                    peer_timeout=self._timeout,
                )
            )
        self._stack, self._sender, self._attached = stack, sender, list(engines)
        return sender


def _filled(fill: Callable[[], Any] | None, stamps: dict[str, float]) -> None:
    """Run an adapter push's ``fill`` (if any), stamped."""
    if fill is not None:
        stamps["filling"] = time.perf_counter()
        fill()
        stamps["filled"] = time.perf_counter()


class LandingChannel(SenderChannel):
    """Adapter pushes to the engines' landing threads (``VLLMAdapterPort.landings``), which
    receive while the engines step: the push waits for no engine step, and each engine's
    registration is queued behind it (``VLLMAdapterPort.register``). A sender of its own:
    the workers' weight receivers stay with the manager's ``WeightPusher``."""

    def _port(self, engine: Any) -> Any:
        return engine.adapters.landings

    async def push_adapter(
        self,
        engines: Sequence[Any],
        packed: PackedAdapter,
        revision: AdapterRevision,
        config: Mapping[str, Any],
        *,
        drop: Sequence[AdapterRevision] = (),
        fill: Callable[[], Any] | None = None,
        stamps: dict[str, float] | None = None,
    ) -> PushReport:
        """Push an adapter (as ``SenderChannel.push_adapter``) into every engine's landing
        threads, and return once each worker has it, checked against the sender's
        fingerprints (their verdicts), and each engine's registration is queued (every request
        sent from then on may name ``revision``). ``fill``: writes the revision into
        ``packed`` first (an ``InvalidRequestError`` it raises is raised as is, before any
        byte is sent). ``drop``: revisions each engine forgets as it registers.

        Raises:
            WeightSyncError: a worker's check failed, or the push did (no engine registers
                anything).
        """
        tensors = packed.chunks
        stamps = stamps if stamps is not None else {}
        self._fingerprints = None
        if self._backend_name == "broadcast" or self._one_copy:
            raise InvalidRequestError("an adapter lands through a staged ZeroMQ push only")
        sender = await self._connected(engines, tensors)
        assert isinstance(sender, WeightSender)
        _filled(fill, stamps)
        version = revision.global_steps if revision.global_steps is not None else -1
        push_id = sender.next_push
        stamps["push began"] = time.perf_counter()
        try:
            report = await sender.push(
                tensors, version=version, fingerprints=self._adapter_prints(packed, stamps),
                verdicts=True,
            )
        except BaseException:
            for engine in engines:  # the next revision tells them the layout again
                engine.adapters.landing_failed()
            raise
        stamps["verdicts"] = time.perf_counter()
        # Shielded: every engine's registration leaves, or the caller's failure path forgets
        # the revision everywhere.
        await shielded(asyncio.gather(*(
            e.adapters.register(revision, config, push=push_id, drop=drop) for e in engines
        )))
        stamps["registration queued"] = time.perf_counter()
        tensors_each = len(packed.layout)
        self._delivered = {
            e.name: Delivery(  # a verdict that passed: each of the layout's tensors matched
                version=version, workers=self._port(e).num_workers,
                tensors=tensors_each * self._port(e).num_workers,
                bytes=report.bytes * self._port(e).num_workers,
                verified=tensors_each * self._port(e).num_workers if self._verify else 0,
                not_verifiable=0 if self._verify else tensors_each * self._port(e).num_workers,
            )
            for e in engines
        }
        return report


class WeightPusher(VersionedUpdater):
    """Pushes a trainer's named tensors into a set of engines at once (``VLLMEngine`` or any
    ``ReceivingEngine``), through asyncroll's transport."""

    def __init__(
        self,
        engines: Sequence[ReceivingEngine],
        *,
        bucket_bytes: int | None = None,
        buffers: int | None = None,
        backend: Literal["auto", "shm", "cuda_ipc", "broadcast"] = "auto",
        backup: bool | None = None,
        timeout: float = 120.0,
        load: Literal["auto", "layerwise", "direct"] = "auto",
        load_plan: bool = True,
        one_copy: bool = False,
        check_finite: bool = True,
        strict_dtype: bool = False,
        verify: bool = True,
        land: bool = False,
    ) -> None:
        """Args:
            engines: Engines launched with asyncroll's weight-transfer backend (the default).
            bucket_bytes: Size of each staging buffer (default by backend:
                ``DEFAULT_BUCKET_BYTES``).
            buffers: Staging buffers (default: ``default_buffers``, 3 with CUDA IPC, 2
                otherwise and for ``one_copy``); 3 keeps the device busy while a bucket's
                signal and ack travel (``bench/gpu_e2e.py`` compares); 2 saves one bucket of
                GPU memory.
            backend: ``shm`` (CPU tensors), ``cuda_ipc`` (GPU tensors), or by the tensors
                (``auto``): engines on this host. ``broadcast``: engines on any host (Ray
                actors on other nodes): a process group of this process (rank 0) and every
                worker, NCCL between GPUs, gloo on CPU (``asyncroll.transport.broadcast``),
                formed at the first push from this host's address and a port it binds.
            backup: Keep a copy of the weights during a push so a failed push restores them
                (default: on for CPU machines, off with CUDA where it would double memory).
                With a direct load the copy stays allocated from one update to the next, and
                each update refills it with one fused copy (``asyncroll.receive.Rollback``).
            timeout: Bound on every wait for a peer.
            load: How workers load: ``layerwise`` (vLLM's layerwise reload: any model, and the
                only way on the CPU build) or ``direct`` (``model.load_weights`` in place, as
                verl and slime do on GPU: unquantized models on GPU). ``auto``: direct with
                CUDA, layerwise without.
            load_plan: With ``direct``, replay a compiled load plan: the model's loaders run
                once per tensor name, watched, and later pushes copy straight from the staging
                buffer into the parameters (``asyncroll.receive.load_plan``). False: the loaders run
                on every push.
            one_copy: No staging buffers: the workers copy straight from the trainer's tensors
                (CUDA IPC handles of their storages, exported once and kept while the tensors
                keep their storage). For a colocated trainer holding full, persistent
                parameters; the tensors must be contiguous CUDA tensors and must not change
                until ``update`` returns. Staged (the default) suits tensors made per push
                (gathered shards, converted dtypes).
            check_finite: Refuse tensors holding NaN or inf before any engine pauses (one
                reduction a tensor; ``bench/check_cost.py`` measures it).
            strict_dtype: Refuse any tensor whose dtype is not the dtype the engines serve
                (by default a floating tensor of another width is cast, as vLLM's loaders do).
            verify: Fingerprint every tensor before the pause (``asyncroll.fingerprints``);
                each worker checks, after loading, every tensor it can find whole in its
                model (a parameter of that name, or the one contiguous range the load plan
                copies it to) against it, and a mismatch fails the push, naming the tensor
                (then the engines roll back or hold, as for any failed push).
            land: Each push lands in a thread of every worker's own while the engines step,
                is checked there, and only then is loaded (``asyncroll.receive.landing``): an
                ``inflight`` update then holds each engine between two steps only for the
                device copies into its parameters and their check, never for the transfer.
                Costs the workers memory for one copy of the pushed tensors when staged (none
                with ``one_copy``, whose landing is the trainer's storages). Whole tensors
                only (no lazy tensors or pieces).
        """
        self._sender_channel = SenderChannel(
            engines,
            bucket_bytes=bucket_bytes,
            buffers=buffers,
            backend=backend,
            backup=backup,
            timeout=timeout,
            load=load,
            load_plan=load_plan,
            one_copy=one_copy,
            check_finite=check_finite,
            strict_dtype=strict_dtype,
            verify=verify,
            land=land,
        )
        super().__init__(engines, self._sender_channel)

    def __repr__(self) -> str:
        names = [e.name for e in self._engines]
        return f"<WeightPusher engines={names} sender={self._sender_channel.sender!r}>"

    @property
    def sender(self) -> WeightSender | BroadcastSender | None:
        return self._sender_channel.sender

    @property
    def channel(self) -> SenderChannel:
        """What moves the bytes (``DistributedWeightPusher`` attaches it to every rank's
        sender)."""
        return self._sender_channel

    @property
    def verify(self) -> bool:
        """Whether pushes are fingerprinted and checked (``verify`` above); settable between
        updates (``bench/gpu_e2e.py`` alternates it to measure what the check costs)."""
        return self._sender_channel.verify

    @verify.setter
    def verify(self, value: bool) -> None:
        self._sender_channel.verify = value


@contextlib.asynccontextmanager
async def _closed_on_failure(stack: contextlib.AsyncExitStack, what: str) -> AsyncIterator[None]:
    """Connecting a sender to the workers: on any failure close what ``stack`` opened; an
    error is a ``WeightSyncError`` saying ``what`` (a cancellation goes on as itself)."""
    try:
        yield
    except BaseException as exc:
        await stack.aclose()
        if isinstance(exc, Exception):
            raise WeightSyncError(f"{what}: {exc}") from exc
        raise


async def _commit(
    engines: Sequence[UpdatableEngine], global_steps: int | None, marks: list[float]
) -> None:
    live = [engine for engine in engines if not engine.is_dead]  # one may die meanwhile
    await asyncio.gather(*(e.weights.commit(global_steps) for e in live))
    marks.append(time.perf_counter())


def _check_versions(engines: Sequence[UpdatableEngine], global_steps: int | None) -> None:
    """Every engine awake and alive, and versions never go backwards."""
    for engine in engines:
        engine.check_weights_awake()
        current = engine.global_steps
        if global_steps is not None and current is not None and global_steps < current:
            raise InvalidRequestError(
                f"global_steps {global_steps} is lower than {engine.name}'s {current}: "
                "versions never go backwards"
            )


def _check_inflight(
    engines: Sequence[UpdatableEngine], channel: WeightChannel, *, recompute: bool
) -> None:
    """Refuse an inflight mode before anything moves where an engine cannot commit between
    two of its steps (or, for ``inflight-recompute``, preempt there) or the channel cannot
    undo a failed push in time (``ResumeMode``)."""
    mode = "inflight-recompute" if recompute else "inflight"
    unable = [e.name for e in engines if not getattr(e, "commits_in_step", False)]
    if unable:
        raise InvalidRequestError(
            f"mode={mode!r}: {', '.join(unable)} cannot commit an update between two engine"
            " steps (a vLLM engine counting its samples can; use keep, abort or recompute)"
        )
    unable = [e.name for e in engines if not getattr(e, "recomputes_in_step", False)]
    if recompute and unable:
        raise InvalidRequestError(
            f"mode={mode!r}: {', '.join(unable)} cannot preempt its running requests between"
            " two engine steps (vLLM schedules ahead: async scheduling; use inflight or"
            " recompute)"
        )
    why = channel.inflight_refusal()
    if why is not None:
        raise InvalidRequestError(f"mode={mode!r}: {why}")


def _channel_fingerprints(channel: WeightChannel) -> dict[str, bytes] | None:
    """The fingerprints a channel took of the update it last checked, if it took them."""
    found = getattr(channel, "fingerprints", None)
    return dict(found) if isinstance(found, Mapping) else None


def materialize(
    named_tensors: Iterable[tuple[str, torch.Tensor | LazyTensor | Piece]]
    | Mapping[str, torch.Tensor | LazyTensor | Piece],
) -> dict[str, torch.Tensor]:
    """The update as a dict; a ``LazyTensor`` or ``Piece`` stays one (typed as a tensor from
    here on: the channel makes it as it packs)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor | LazyTensor | Piece):
            raise InvalidRequestError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if isinstance(tensor, torch.Tensor) and (
            tensor.device.type not in ("cpu", "cuda") or tensor.layout != torch.strided
        ):
            raise InvalidRequestError(
                f"{name!r} is a {tensor.layout} tensor on the {tensor.device.type} device: an "
                "update takes dense tensors on the CPU or a CUDA device (a meta tensor has no "
                "values to push)"
            )
        if name in tensors:
            raise InvalidRequestError(f"tensor {name!r} is given twice")
        tensors[name] = (
            tensor if isinstance(tensor, LazyTensor | Piece) else tensor.detach()  # type: ignore[assignment]
        )
    return tensors


def _nbytes(tensor: torch.Tensor | LazyTensor | Piece) -> int:
    if isinstance(tensor, Piece):
        return tensor.nbytes
    return tensor.numel() * tensor.element_size()


async def _until(goal: asyncio.Future[Any] | None, tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until ``goal`` is done (None: every task), raising the first failure among
    ``tasks`` as soon as it happens."""
    pending = {t for t in tasks if not t.done()}
    while True:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if (goal is not None and goal.done()) or not pending:
            if goal is not None:
                goal.result()  # cancelled: raise it
            return
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)


def _describe(failures: Sequence[BaseException]) -> str:
    return "; ".join(f"{type(f).__name__}: {f}" for f in failures[:3])
