"""The vLLM engine adapter: one ``AsyncLLM`` client, spoken to in asyncroll's terms.

The EngineCore and its workers run in their own processes; this object lives in ours and owns
the client. Invariants:
- Every request is validated before vLLM sees it (a bad token id kills a vLLM EngineCore).
- Admission is gated: while paused or asleep, new requests wait at the gate instead of reaching
  the engine, on every vLLM version (0.32 queues them, 0.33 raises).
- Every admitted request resolves exactly once, and leaves ``statistics().in_flight`` when it
  does, whether it finished, was aborted, failed or its caller was cancelled.
- vLLM's errors are mapped onto asyncroll's tree here, and nowhere else.
- Every call into vLLM ends: if the EngineCore process exits, calls in flight fail with
  ``EngineDeadError`` at once (vLLM's client leaves a call it sent before the exit pending
  forever; the adapter watches the process itself).
- Every token is labelled with the ``global_steps`` of the weights that produced it: from vLLM's
  own version spans where it reports them (0.32+), else (0.24) from the boundaries this adapter
  records while the engine is paused for an update (nothing is sampled during a pause, so the
  token count of each live request at that moment is exact).

Run on vLLM 0.24 (GPU) and 0.32 (CPU build); written for 0.33's differences too. Version
differences are detected by feature, never by version number.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncroll.admission import AdmissionGate, aborted_segment
from asyncroll.errors import (
    EngineDeadError,
    EngineGenerateError,
    EngineSleepingError,
    EngineStartError,
    InvalidRequestError,
    WeightSyncError,
)
from asyncroll.interfaces import INFLIGHT_MODES, Delivery, ResumeMode
from asyncroll.types import EngineStatistics, FinishReason, PauseMode, Segment
from asyncroll.validation import (
    ENGINE_REQUEST_ID_LEN,
    check_commit,
    check_prompt,
    check_request_id,
    check_take,
    claimed,
    refuse_live,
    resolve_sampling_params,
)
from asyncroll.vllm import compat, sockets
from asyncroll.vllm.adapters import VLLMAdapterPort
from asyncroll.vllm.deliveries import summed

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncroll.adapters import AdapterRevision

__all__ = ["VLLMEngine", "VLLMWeightPort", "parse_version", "version_label", "vllm_client"]

logger = logging.getLogger(__name__)

_CLIENT_ENV_DEFAULTS = {"VLLM_V1_OUTPUT_PROC_CHUNK_SIZE": "32"}
"""What ``start`` sets in this process's environment where the user set nothing (so every vLLM
engine this process starts, and its children, see it too). vLLM's front end turns each
step's outputs into request outputs on the event loop, 128 requests a turn by default; 32 a
turn kept the rollout benchmark's worst loop turn at 12-16 ms against 13-35 ms (one H200,
1024 requests from 256 callers, docs/performance.md), the loop every call shares."""

_CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Environment the CPU build needs (GiB of KV cache; no core pinning on shared machines)."""

_CPU_MEMORY_UTILIZATION = 0.2
"""On CPU vLLM reserves this fraction of the NUMA node's memory; its default of 0.92 fails on
any machine that runs anything else (a trainer, a second engine)."""

ADMISSIONS_PER_TURN = 32
"""Requests an engine sends to vLLM in one turn of the event loop, at most (``AdmissionGate``):
a rollout's callers starting together go over several turns, none of them long (each request
is about 0.12 ms of the loop on an H200 host)."""

_SETTLE_TURNS = 10_000
"""Loop turns vLLM 0.24's output handler gets to drain its queue before a version boundary."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_names = itertools.count()


def _already_shut_down(timeout: float | None = None) -> None:
    """Stands in for ``AsyncLLM.shutdown`` after the adapter shut the engine down."""


def version_label(global_steps: int | None) -> str | None:
    """vLLM's weight version string for a trainer step."""
    return None if global_steps is None else str(global_steps)


def parse_version(label: str | None) -> int | None:
    """The trainer step a vLLM weight version string names, or None if it names none."""
    if label is None:
        return None
    try:
        return int(label)
    except ValueError:
        return None


class VLLMEngine:
    """One vLLM engine (``AsyncLLM``), with validation, an admission gate and typed errors.

    Start one with ``async with VLLMEngine.launch(model_path, **engine_args) as engine:``.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        name: str | None = None,
        global_steps: int | None = None,
    ) -> None:
        self._llm = llm
        self.name = name or f"engine-{next(_names)}"
        self.model_path = str(llm.model_config.model)
        self.vocab_size: int = llm.model_config.get_vocab_size()
        self.max_model_len: int = llm.model_config.max_model_len
        self._global_steps = global_steps
        self._live: set[str] = set()
        self._in_flight = 0
        self._in_transit: set[str] = set()
        """Requests admitted at the gate whose ``add_request`` has not yet returned: they may
        still reach the EngineCore (``pause`` waits for them; see ``_landed``)."""
        self._landed = asyncio.Event()
        """Set while no request is in transit."""
        self._landed.set()
        compat.on_request_added(llm, self._request_added)
        self._seeds_kill = compat.seeded_split_prefill_kills(llm)
        """A seeded request would kill this engine (vLLM's CPU build, chunked prefill on)."""
        self._gate = AdmissionGate(per_turn=ADMISSIONS_PER_TURN)
        self._paused = False
        self._sleeping_tags: set[str] = set()
        self._closed = False
        self._rendezvous_files: list[Path] = []
        """vLLM's process-group store files, removed at close (``compat.rendezvous_files``)."""
        self._dead: BaseException | None = None
        self._num_requests = 0
        self._num_aborted = 0
        self._num_rejected = 0
        self._holding: str | None = None
        self._weights = VLLMWeightPort(self)
        self._adapters = VLLMAdapterPort(self)
        self.native_versions = compat.labels_versions(llm)
        """vLLM labels weight versions itself (0.32+); else this adapter does (see module doc)."""
        self._version_marks: dict[str, list[tuple[int | None, int]]] = {}
        """Per live request: (global_steps, index of its first token under them), in order;
        the first is the label at dispatch. They label its tokens where vLLM labels no
        versions (0.24) and, on vLLM 0.32+, for requests in ``_labelled_here``."""
        self.commits_in_step = False
        """The workers count each request's samples (``asyncroll_count_samples``): an update
        can commit between two engine steps with no pause (``mode="inflight"``)."""
        self.recomputes_in_step = False
        """It can also preempt its running requests between the same two steps, so the new
        weights compute their KV again (``mode="inflight-recompute"``; ``weights.take``)."""
        self._commit_recorded = asyncio.Event()
        """Clear while an inflight update's RPC is out: a request that ends meanwhile waits
        for the boundary it may have crossed before it reports its tokens' labels."""
        self._commit_recorded.set()
        self._labelled_here: set[str] = set()
        """Live requests whose tokens this adapter labels though vLLM labels versions: an
        inflight update crossed them, or they started while vLLM's label lagged the weights."""
        self._label_lags = False
        """An inflight update is in force and vLLM's label is not yet (``weights.commit``)."""
        self._cache_epoch = 0
        """Salts every request's prefix-cache key (vLLM's ``cache_salt``); a new epoch makes
        the KV cached before it unreachable (``weights.commit``)."""
        self._cache_salt = f"asyncroll-{secrets.token_hex(8)}"
        """Unique to this engine, so two engines' keys never meet in a shared KV store."""
        self._died: asyncio.Future[None] | None = None
        """Done when an EngineCore process exits (or the engine is closed): every call into
        vLLM races it (made on first use, in the engine's loop)."""
        self._watched: list[int] = []
        self._watching: asyncio.AbstractEventLoop | None = None
        self._watch_engine_cores()

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls,
        model_path: str | os.PathLike[str],
        *,
        name: str | None = None,
        global_steps: int | None = 0,
        **engine_args: Any,
    ) -> AsyncIterator[VLLMEngine]:
        """Start a vLLM engine on ``model_path`` and close it on exit.

        Args:
            model_path: A local model folder.
            name: A name for logs and ``repr``.
            global_steps: The trainer step the starting weights belong to (labels their tokens).
            **engine_args: vLLM ``AsyncEngineArgs``; asyncroll's defaults fill the gaps. The
                batch limits (``max_num_seqs``, ``max_num_batched_tokens``) default to those
                of ``vllm.LLM``, not ``AsyncLLM``'s smaller ones.
        """
        engine = await cls.start(model_path, name=name, global_steps=global_steps, **engine_args)
        try:
            yield engine
        finally:
            await engine.aclose()

    @classmethod
    async def start(
        cls,
        model_path: str | os.PathLike[str],
        *,
        name: str | None = None,
        global_steps: int | None = 0,
        **engine_args: Any,
    ) -> VLLMEngine:
        """Start an engine without a context manager; the caller must ``aclose()`` it.

        Raises:
            EngineStartError: no such model folder (a path that does not exist never reaches
                vLLM, which would look it up on the Hugging Face hub), bad engine arguments, or
                vLLM failed to start (its error is the cause).
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        path = _check_model_path(model_path)
        sockets.private_rpc_directory()  # vLLM's socket files go where this process removes them
        try:
            args = AsyncEngineArgs(**_engine_args_with_defaults(path, engine_args))
        except Exception as exc:  # an unknown keyword, a value vLLM refuses
            raise EngineStartError(f"bad engine arguments: {exc}") from exc
        try:
            # Start-up blocks for tens of seconds; keep the event loop free for other engines.
            # vLLM's offline batch limits (those of ``vllm.LLM``: on an H100, 1024 sequences and
            # 16384 tokens a step), not ``AsyncLLM``'s bare fallbacks (128 and 2048): a rollout
            # is a batch job. Limits the caller sets win.
            llm = await asyncio.to_thread(
                AsyncLLM.from_engine_args, args, usage_context=UsageContext.LLM_CLASS
            )
        except Exception as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
            raise EngineStartError(f"vLLM could not start on {str(path)!r}: {reason}") from exc
        engine = cls(llm, name=name, global_steps=global_steps)
        try:
            label = version_label(global_steps)
            if label is not None and engine.native_versions:
                await engine.call_vllm(llm.update_weight_version(label))
            engine._rendezvous_files = compat.rendezvous_files(
                await engine.call_vllm(llm.collective_rpc("asyncroll_rendezvous")))
            prepacked = await engine.call_vllm(llm.collective_rpc("asyncroll_prepacked_experts"))
            engine._weights.prepacked_experts = tuple(sorted(set().union(*prepacked)))
            counting = await engine.call_vllm(llm.collective_rpc("asyncroll_count_samples"))
            # One worker: several (tensor parallel) would each decide their load's fate alone
            # in the commit's RPC, and one could roll back while another finishes.
            engine.commits_in_step = len(counting) == 1 and all(counting)
            # Where vLLM schedules ahead, the preemption would drop a token an unfinished
            # step sampled on the old weights, and the count would place the switch one late.
            engine.recomputes_in_step = engine.commits_in_step and not compat.schedules_ahead(llm)
        except EngineDeadError as exc:
            await engine.aclose()
            raise EngineStartError(f"vLLM died as it started on {str(path)!r}: {exc}") from exc
        except BaseException:
            await engine.aclose()
            raise
        logger.info("started %r", engine)
        return engine

    def __repr__(self) -> str:
        state = "dead" if self.is_dead else "asleep" if self.is_asleep else (
            "paused" if self._paused else "holding" if self._holding else "running"
        )
        return (
            f"<VLLMEngine {self.name} {state} in_flight={self._in_flight} "
            f"global_steps={self._global_steps} model={self.model_path!r}>"
        )

    @property
    def global_steps(self) -> int | None:
        """The trainer step of the weights in force."""
        return self._global_steps

    @property
    def is_dead(self) -> bool:
        return self._closed or self._dead is not None or bool(self._llm.errored)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_asleep(self) -> bool:
        return bool(self._sleeping_tags)

    @property
    def has_tokenizer(self) -> bool:
        """Whether vLLM loaded a tokenizer (not with ``skip_tokenizer_init``, asyncroll's default
        for a model folder without tokenizer files); sampling by text needs one."""
        if self._llm.model_config.skip_tokenizer_init:
            return False
        return getattr(self._llm, "tokenizer", None) is not None

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            in_flight=self._in_flight,
            paused=self._paused,
            asleep=self.is_asleep,
            dead=self.is_dead,
            global_steps=self._global_steps,
            num_requests=self._num_requests,
            num_aborted=self._num_aborted,
            num_rejected=self._num_rejected,
            holding=self._holding is not None,
            waiting=self._gate.waiting,
        )

    def num_unfinished_in_vllm(self) -> int:
        """Requests vLLM's own front end still tracks (0 once aborts have landed)."""
        return compat.num_unfinished_requests(self._llm)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        adapter: AdapterRevision | None = None,
    ) -> Segment:
        """Generate one segment for one request.

        Waits while the engine is paused or asleep. Cancelling the caller aborts the request in
        the engine.

        Args:
            request_id: A non-empty printable str, unique among this engine's live requests.
            prompt_ids: Token ids of the prompt.
            sampling_params: vLLM sampling arguments (``max_tokens``, ``temperature``...; see
                ``asyncroll.validation.SAMPLING_KEYS``); never mutated. ``max_tokens`` defaults
                to the rest of the context.
            adapter: A LoRA revision the engine holds (``adapters``): the request runs under
                it, and its tokens carry the revision's ``global_steps``.

        Returns:
            The tokens, their log probs and per-token ``global_steps``; ``finish_reason`` is
            ``"abort"`` when the request was aborted or paused away, with the partial output.

        Raises:
            InvalidRequestError: bad input; nothing reached the engine.
            EngineDeadError: the engine is gone.
            EngineGenerateError: vLLM failed this request; the engine still serves.
        """
        self._check_alive()
        try:
            check_request_id(request_id, max_len=ENGINE_REQUEST_ID_LEN)
            params = self._sampling_params(prompt_ids, sampling_params)
            refuse_live(request_id, self._live)
            if adapter is not None and not self._adapters.holds(adapter):
                raise InvalidRequestError(
                    f"{self.name} does not hold adapter revision {adapter.lora_name}"
                )
        except InvalidRequestError:
            self._num_rejected += 1
            raise
        prompt = list(prompt_ids)
        with claimed(self._live, request_id):
            if not await self._gate.admit(request_id):
                self._num_requests += 1
                self._num_aborted += 1
                return aborted_segment(request_id, len(prompt))
            self._check_alive()
            self._in_flight += 1
            self._num_requests += 1
            try:
                return await self._run(
                    request_id, prompt, params, self._global_steps, adapter=adapter
                )
            finally:
                self._in_flight -= 1

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort live requests; each ends with ``finish_reason="abort"`` and its partial output
        (none for a request still waiting to be admitted: it ends at once, never admitted)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = self._gate.abort(ids)
        live = [request_id for request_id in ids if request_id in self._live]
        if not live or self.is_dead:
            return
        if any(request_id in self._in_transit for request_id in live):
            await self._all_landed()  # vLLM ignores an abort of a request it does not know yet
        await self._call(self._llm.abort(live))

    async def pause(
        self, mode: PauseMode = "abort", *, clear_cache: bool | None = None
    ) -> None:
        """Stop scheduling: ``abort`` ends in-flight requests, ``wait`` drains them, ``keep``
        freezes them until ``resume()``. New requests wait at the gate until then.

        ``clear_cache`` (default: for ``abort`` and ``wait``, not for ``keep``): clear vLLM's
        caches in the pause. vLLM's clear preempts the running requests, so a kept request
        would compute its KV cache again on resume."""
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"pause mode must be abort, wait or keep, not {mode!r}")
        if clear_cache is None:
            clear_cache = mode != "keep"
        self._check_alive()
        self._paused = True
        self._gate.clear()
        # Requests admitted before the gate closed reach the EngineCore before the pause does:
        # an abort or wait pause then ends every request that holds the old cache epoch's salt
        # (``reset_prefix_cache`` relies on it), and none can arrive after it.
        await self._all_landed()
        await self._call(
            compat.pause_generation(self._llm, mode=mode, clear_cache=clear_cache)
        )

    async def resume(self) -> None:
        """Resume scheduling after ``pause()``; kept requests continue, waiters are admitted."""
        self._check_alive()
        await self._call(self._llm.resume_generation())
        self._paused = False
        self._open_gate_if_ready()

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Release the engine's memory (on GPU; on CPU only scheduling stops).

        Level 1 offloads the weights and drops the KV cache; level 2 drops the weights too.
        """
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, not {level!r}")
        self._check_alive()
        self._gate.clear()
        self._sleeping_tags = {"weights", "kv_cache", "scheduling"}
        await self._all_landed()  # as for a pause: the sleep's abort must reach them all
        await self._call(self._llm.sleep(level, mode))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what ``tags`` name (``weights``, ``kv_cache``, ``scheduling``; None: all)."""
        self._check_alive()
        woken = set(tags) if tags is not None else set(self._sleeping_tags)
        unknown = woken - {"weights", "kv_cache", "scheduling"}
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {sorted(unknown)}")
        fully_awake = await self._call(
            self._llm.wake_up(list(tags) if tags is not None else None)
        )
        if fully_awake is None:  # vLLM 0.24 does not say; scheduling resumes with the memory
            fully_awake = not (self._sleeping_tags - woken) & {"weights", "kv_cache"}
        self._sleeping_tags -= woken
        if fully_awake:
            self._sleeping_tags.clear()
        self._open_gate_if_ready()

    def check_weights_awake(self) -> None:
        """Raise if the engine's weights are asleep (a push then would crash vLLM)."""
        self._check_alive()
        if "weights" in self._sleeping_tags:
            raise EngineSleepingError(
                f"{self.name} is asleep: wake_up(['weights']) before pushing weights"
            )

    async def aclose(self) -> None:
        """Shut the engine's processes down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.set()  # waiters wake and find the engine closed
        self._stop_watching()
        self._mark_died()
        # vLLM's output handler would log the EngineCore's exit as a crash: stop it first.
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
        # Shielded: a caller cancelled here would leave the processes, pipes and ZMQ context
        # behind for good (the engine is marked closed already).
        shutdown = asyncio.ensure_future(self._shut_down())
        try:
            await asyncio.shield(shutdown)
        except asyncio.CancelledError:
            await asyncio.gather(shutdown, return_exceptions=True)
            raise
        logger.info("closed %s", self.name)

    async def _shut_down(self) -> None:
        processes = compat.engine_core_processes(self._llm)
        monitors = compat.engine_monitor_threads(self._llm)
        try:
            await asyncio.to_thread(self._llm.shutdown)
            # AsyncLLM.__del__ shuts down again, which fails at interpreter exit; once is enough.
            self._llm.shutdown = _already_shut_down  # type: ignore[method-assign]
            # vLLM stops its EngineCore but leaves the exited process unreaped (a zombie until
            # the next process starts): reap it.
            await asyncio.to_thread(_reap, processes, monitors)
        finally:
            for path in self._rendezvous_files:  # its workers are gone: nobody meets there
                with contextlib.suppress(OSError):
                    path.unlink()
        await asyncio.sleep(0)  # vLLM's socket closes, queued on this loop, run first
        compat.release_client(self._llm)

    async def call_vllm(self, awaitable: Any) -> Any:
        """Await a call into vLLM (a coroutine of ``llm``'s), failing with ``EngineDeadError``
        as soon as the EngineCore exits, answered or not: vLLM's client never fails a call it
        sent before the exit. Every call the adapter makes goes through here (not the output
        streams of ``generate``: vLLM fails those itself).

        Raises:
            EngineDeadError: the engine died or was closed before the call was answered.
        """
        call = asyncio.ensure_future(awaitable)
        if not call.done():
            try:
                await asyncio.wait((call, self._death()), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # our caller is cancelled: so is the call
                call.cancel()
                raise
        if not call.done():  # the engine died or was closed first: vLLM would never answer
            call.cancel()
            self._check_alive()
            raise EngineDeadError(f"{self.name} is dead")
        return call.result()

    @property
    def adapters(self) -> VLLMAdapterPort:
        """The engine's LoRA revisions (``asyncroll.adapters``; ``enable_lora=True``)."""
        return self._adapters

    @property
    def weights(self) -> VLLMWeightPort:
        """The engine's update surface (``asyncroll.interfaces.ReceivingPort``)."""
        return self._weights

    async def collective_rpc(
        self, method: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` of every worker's extension (``asyncroll.vllm.worker``), through
        ``call_vllm``; one answer per worker, in rank order."""
        answers: list[Any] = await self.call_vllm(
            self._llm.collective_rpc(method, args=tuple(args), kwargs=dict(kwargs or {}))
        )
        return answers

    async def rpc_sent(
        self, method: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> asyncio.Future[list[Any]]:
        """``collective_rpc``, returning once vLLM's client has handed the request to its
        socket (on Python 3.12+, which can start the call eagerly, before any turn of the loop;
        before 3.12, three turns later), with the future of the answers (``call_vllm``'s):
        every call sent after this reaches the EngineCore after it."""
        call = self._llm.collective_rpc(method, args=tuple(args), kwargs=dict(kwargs or {}))
        if sys.version_info >= (3, 12):
            task: asyncio.Future[list[Any]] = asyncio.Task(  # type: ignore[call-arg,unused-ignore]
                call, loop=asyncio.get_running_loop(), eager_start=True
            )
        else:
            # The call's task, then vLLM's call in it, then that call's first step, which
            # hands it to vLLM's socket: three loop turns see it out.
            task = asyncio.ensure_future(call)
            for _ in range(3):
                await asyncio.sleep(0)
        return asyncio.ensure_future(self.call_vllm(task))

    # -- internals -------------------------------------------------------------------------

    def _commit_inflight(self, global_steps: int | None, sampled: Mapping[str, int]) -> None:
        """The new weights are in force since the workers' RPC ran: label them at once (a
        request dispatched from here on starts under them), move to a new cache epoch, and
        mark where each live request's tokens switch: after the ``sampled`` count its
        workers saw (keyed by vLLM's internal ids: ours plus ``-`` and 8 characters)."""
        self._cache_epoch += 1
        if global_steps is not None:
            self._global_steps = global_steps
        by_suffix: dict[str, int] = {}  # for requests vLLM's front end has let go of already
        for internal, count in sampled.items():
            external = internal if internal in self._live else internal[:-9]
            by_suffix[external] = max(by_suffix.get(external, 0), int(count))
        internals = getattr(self._llm.output_processor, "external_req_ids", {})
        for request_id, marks in self._version_marks.items():
            if marks[-1][0] == self._global_steps:
                continue
            known = [sampled[i] for i in internals.get(request_id, ()) if i in sampled]
            count = max(known) if known else by_suffix.get(request_id, 0)
            marks.append((self._global_steps, int(count)))
        self._labelled_here.update(self._version_marks)
        self._label_lags = self.native_versions

    async def _mark_version_boundary(self, global_steps: int | None) -> None:
        """Record where each live request's tokens switch to ``global_steps``. Call while
        paused, after the push and before resuming. On vLLM 0.32+ too, which labels tokens
        itself: an inflight update that crosses the request later labels it here throughout
        (``_labelled_here``), this boundary included."""
        if not self._version_marks:
            return
        # Outputs produced before the pause are in the client's queue once pause returned;
        # let vLLM's output handler take them all before counting. The queue has no event to
        # wait on: give the handler loop turns, a bounded number (it takes one item a turn).
        queue = getattr(self._llm.engine_core, "outputs_queue", None)
        for _ in range(_SETTLE_TURNS):
            if not (isinstance(queue, asyncio.Queue) and queue.qsize()):
                break
            await asyncio.sleep(0)
        else:
            logger.warning("%s: vLLM's output queue did not drain; version labels may be off",
                           self.name)
        for _ in range(3):  # the handler processes its last item in chunks, a turn each
            await asyncio.sleep(0)
        states = self._llm.output_processor
        for request_id, marks in self._version_marks.items():
            detokenizers = [
                states.request_states[internal].detokenizer
                for internal in states.external_req_ids.get(request_id, ())
                if internal in states.request_states
            ]
            produced = max(
                (d.num_output_tokens() for d in detokenizers if d is not None), default=0
            )
            if marks[-1][0] != global_steps:
                marks.append((global_steps, produced))

    async def _all_landed(self) -> None:
        """Return once every request admitted so far has reached vLLM (or never will)."""
        while not self._landed.is_set():
            await self._landed.wait()

    def _request_added(self, request_id: str) -> None:
        self._in_transit.discard(request_id)
        if not self._in_transit:
            self._landed.set()

    def _open_gate_if_ready(self) -> None:
        if not self._paused and not self._sleeping_tags and self._holding is None:
            self._gate.set()

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(f"{self.name} is closed")
        if self._dead is not None or self._llm.errored:
            raise EngineDeadError(f"{self.name} is dead") from self._dead

    def _sampling_params(
        self, prompt_ids: Sequence[int], params: Mapping[str, Any] | None
    ) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt = check_prompt(prompt_ids, vocab_size=self.vocab_size)
        resolved = resolve_sampling_params(
            params,
            prompt_len=len(prompt),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            has_tokenizer=self.has_tokenizer,
        )
        if resolved.get("seed") is not None and self._seeds_kill:
            raise InvalidRequestError(
                "seed: on vLLM's CPU build a seeded request whose prefill is split across "
                "steps kills the engine (torch's CPU generator cannot rewind), and this engine "
                "splits prefills (enable_chunked_prefill=True); start it without that argument "
                "(asyncroll's default on CPU turns it off) or send no seed"
            )
        try:
            if "structured_outputs" in resolved:  # vLLM takes its own object, not a mapping
                from vllm.sampling_params import StructuredOutputsParams

                resolved["structured_outputs"] = StructuredOutputsParams(
                    **resolved["structured_outputs"])
            return SamplingParams(
                **resolved,
                output_kind=RequestOutputKind.FINAL_ONLY,
                detokenize="stop" in resolved,  # vLLM matches stop strings on the text
                # Log probs in plain lists, not a dict and a Logprob object per token: at 256
                # requests of 1500 tokens those were ~800k objects for every full gc pass to walk.
                flat_logprobs=True,
            )
        # ValueError, TypeError, and vLLM's VLLMValidationError (not a ValueError in 0.32):
        # whatever the shared checks let through is still the caller's input.
        except Exception as exc:
            raise InvalidRequestError(f"vLLM rejected sampling_params: {exc}") from exc

    async def _run(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        dispatched_at: int | None,
        *,
        adapter: AdapterRevision | None = None,
    ) -> Segment:
        from vllm.inputs import TokensPrompt

        last: RequestOutput | None = None
        lora_request = None
        if adapter is None:
            marks = [(dispatched_at, 0)]
            self._version_marks[request_id] = marks
            if self._label_lags:
                self._labelled_here.add(request_id)
        else:  # the revision labels every token: its weights sampled them all
            from vllm.lora.request import LoRARequest

            marks = [(adapter.global_steps, 0)]
            self._labelled_here.add(request_id)
            lora_request = LoRARequest(adapter.lora_name, adapter.revision, adapter.lora_path)
        salt = f"{self._cache_salt}-{self._cache_epoch}"
        self._in_transit.add(request_id)  # until vLLM's add_request returns (_request_added)
        self._landed.clear()
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params, request_id,
            lora_request=lora_request,
        )
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    last = output
            # An inflight update's RPC may be out: its answer places this request's boundary.
            while not self._commit_recorded.is_set():
                await self._commit_recorded.wait()
        except Exception as exc:
            error = self._map_error(exc, request_id)
            if not isinstance(error, EngineDeadError):  # leave nothing behind inside vLLM
                with contextlib.suppress(Exception):
                    await self.call_vllm(self._llm.abort(request_id))
            raise error from exc
        finally:
            self._version_marks.pop(request_id, None)
            labelled_here = request_id in self._labelled_here
            self._labelled_here.discard(request_id)
            self._request_added(request_id)  # a stream closed before it added anything
        use_spans = self.native_versions and not labelled_here
        segment = _segment(request_id, last, len(prompt), marks, use_spans)
        if segment.finish_reason == "abort":
            self._num_aborted += 1
        return segment

    async def _call(self, awaitable: Any) -> Any:
        """Await a call into vLLM (``call_vllm``), its errors mapped onto asyncroll's."""
        try:
            return await self.call_vllm(awaitable)
        except EngineDeadError:
            raise
        except Exception as exc:
            raise self._map_error(exc, None) from exc

    def _watch_engine_cores(self) -> None:
        """Learn of an EngineCore's exit from its process sentinel, on the event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop (a test's stand-in): nothing to watch
            return
        for process in compat.engine_core_processes(self._llm):
            loop.add_reader(process.sentinel, self._core_exited, process)
            self._watched.append(process.sentinel)
        self._watching = loop

    def _stop_watching(self) -> None:
        watched, self._watched = self._watched, []
        loop, self._watching = self._watching, None
        if loop is None or loop.is_closed():
            return
        for sentinel in watched:
            loop.remove_reader(sentinel)

    def _core_exited(self, process: Any) -> None:
        self._stop_watching()
        if self._closed:
            return
        if self._dead is None:
            code = "" if process.exitcode is None else f" with code {process.exitcode}"
            self._dead = RuntimeError(f"vLLM's EngineCore process {process.pid} exited{code}")
            logger.error("%s: %s", self.name, self._dead)
        self._mark_died()
        self._gate.set()  # requests waiting for admission wake and find the engine dead

    def _death(self) -> asyncio.Future[None]:
        """Done once the engine died or closed. Made in the running loop; an engine called
        from another loop later (never two at once: ``AsyncLLM`` is bound to one) gets a new
        one, done at once if the engine is already dead or closed."""
        loop = asyncio.get_running_loop()
        if self._died is None or self._died.get_loop() is not loop:
            self._died = loop.create_future()
            if self._closed or self._dead is not None:
                self._died.set_result(None)
        return self._died

    def _mark_died(self) -> None:
        """Wake every call racing ``_death`` (from the loop's thread, or with no loop running)."""
        if self._died is not None and not self._died.done():
            self._died.set_result(None)

    def _map_error(self, exc: Exception, request_id: str | None) -> Exception:
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

        what = f"request {request_id!r} on {self.name}" if request_id else self.name
        if isinstance(exc, VLLMEngineDeadError) or self._llm.errored:
            self._dead = exc
            self._mark_died()
            self._gate.set()  # requests waiting for admission wake and find the engine dead
            return EngineDeadError(f"{what}: the engine died ({exc!r})")
        if isinstance(exc, ValueError) or _is_input_error(exc):
            return InvalidRequestError(f"{what}: vLLM rejected the request: {exc}")
        return EngineGenerateError(f"{what} failed: {exc!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Taken:
    """What a successful ``take`` leaves for the ``commit`` that follows it."""

    finished: bool
    """The workers finished the update in the take's RPC: only the label is left."""
    marked: bool
    """An inflight take committed in the engine and marked each request's boundary."""


class _WeightLandingPort:
    """The workers' landing threads (``asyncroll.receive.landing``), as a sender's receivers:
    a ``SenderChannel(land=True)`` attaches them instead of the workers' receivers, and each
    push it lands is then loaded by a take with ``landed=True``."""

    def __init__(self, port: VLLMWeightPort) -> None:
        self._port = port
        self._attached_to: object | None = None
        self.layerwise = True
        """The landing threads' pushes load with vLLM's layerwise reload (the ``load`` told
        at their attach; the workers' own receivers may have been told otherwise)."""

    @property
    def num_workers(self) -> int:
        return self._port.num_workers

    @property
    def attached_to(self) -> object | None:
        return self._attached_to

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        """Start every worker's landing thread on the sender ``config`` describes."""
        engine = self._port._engine
        await engine.collective_rpc("asyncroll_bind_weight_transfer_engine")
        await engine.collective_rpc(
            "asyncroll_open_weight_landing", kwargs={"config": {**config, "name": engine.name}}
        )
        self._attached_to = owner
        self.layerwise = config.get("load", "layerwise") == "layerwise"

    async def detach(self) -> None:
        """Stop the landing threads (their receivers release their mappings)."""
        self._attached_to = None
        await self._port._engine.collective_rpc("asyncroll_close_weight_landing")


class VLLMWeightPort:
    """A ``VLLMEngine``'s update surface (``asyncroll.interfaces.ReceivingPort``): vLLM's
    weight-update protocol, with asyncroll's transport in the workers (``asyncroll.vllm.worker``).

    Its state between two calls is one value: the take awaiting its commit (``_taken``), or
    None. ``take`` sets it, ``commit`` and ``abort`` end it.
    """

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self._llm = engine._llm
        self._attached_to: object | None = None
        self._taken: _Taken | None = None
        self._layerwise = True
        """The workers load with vLLM's layerwise reload (the ``load`` told at attach)."""
        self.answered = 0.0
        """When the workers' answers to the last take came back (``time.perf_counter()``;
        benchmarks: the RPC's way back)."""
        self.prepacked_experts: tuple[str, ...] = ()
        """The expert layers the workers keep in a layout of their own (found at start-up):
        no ``load="direct"`` push (``direct_load_refusal``)."""
        self.landing = _WeightLandingPort(self)
        """Where a ``SenderChannel(land=True)`` attaches: the workers' landing threads."""
        self.finish_in_receive = compat.worker_runs_the_session()
        """The workers finish an update in the take's RPC, and ``commit`` only labels it: one
        RPC less an update (about 0.9 ms of a 7B update on an H100). On by default where the
        worker runs the session (vLLM 0.24): its receive commits the new weights as it
        returns, so finishing there loses nothing. Off elsewhere: a worker keeps its backup
        until the finish, and a push that fails in another engine still rolls this one back
        (``abort``)."""

    def __repr__(self) -> str:
        return f"<VLLMWeightPort {self._engine.name} attached_to={self._attached_to!r}>"

    @property
    def num_workers(self) -> int:
        parallel: Any = self._llm.vllm_config.parallel_config
        return int(parallel.world_size)

    @property
    def direct_load_refusal(self) -> str | None:
        """Why a ``load="direct"`` push would be refused by the workers (None: it would not);
        the sender's check asks before anything pauses."""
        if not self.prepacked_experts:
            return None
        return compat.direct_load_refusal(self.prepacked_experts)

    @property
    def served_dtype(self) -> torch.dtype:
        dtype = self._llm.model_config.dtype  # resolved to a torch.dtype once vLLM started
        if not isinstance(dtype, torch.dtype):
            raise WeightSyncError(f"{self._engine.name}: vLLM reports no served dtype ({dtype!r})")
        return dtype

    @property
    def attached_to(self) -> object | None:
        return self._attached_to

    def hold(self, reason: str) -> None:
        """Admit nothing until a ``commit`` (the weights in force are not whole)."""
        self._engine._holding = reason
        self._engine._gate.clear()

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        """Connect every worker's receiver to the sender ``config`` describes."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        engine = self._engine
        # vLLM 0.24 builds weight-transfer engines without the configs a rollback needs; the
        # RPC supplies them where they are missing (the worker checks).
        await engine.collective_rpc("asyncroll_bind_weight_transfer_engine")
        request = WeightTransferInitRequest(init_info={**config, "name": engine.name})
        await engine.call_vllm(self._llm.init_weight_transfer_engine(request))
        self._attached_to = owner
        self._layerwise = config.get("load", "layerwise") == "layerwise"

    async def detach(self) -> None:
        """Close the workers' receivers (they release their mappings)."""
        self._attached_to = None
        await self._engine.call_vllm(compat.shutdown_weight_transfer(self._llm))

    async def take(
        self,
        version: int,
        *,
        push: int = 0,
        mode: ResumeMode = "keep",
        sent: Callable[[], None] | None = None,
        landed: bool = False,
    ) -> Delivery | None:
        """Take a push in one RPC (``asyncroll_take_update``): the workers begin the update,
        load it, check it and, where they can (``finish_in_receive``), finish it.

        ``landed``: the push landed in the workers' landing threads already (``landing``),
        checked; the RPC loads it from there, and waits for no byte.

        An ``INFLIGHT_MODES`` take finds the engine running: the workers load, check and
        finish in the RPC, which vLLM's EngineCore runs between two steps, and the new weights
        are labelled ``version`` (-1: no label) from the first token they sample
        (``VLLMEngine.commits_in_step``).

        ``inflight-recompute``: vLLM then preempts the running requests and clears its prefix
        cache (``reset_prefix_cache(reset_running_requests=True)``) between the same two
        steps, so the new weights compute their KV again before their next token
        (``VLLMEngine.recomputes_in_step``). That call is sent right behind the RPC, on the
        same socket, and the EngineCore handles every call its input thread has queued before
        its next step. The RPC cannot end before the sender's bytes come, and the sender
        starts after both calls left (``sent``): the input thread has the whole push
        (milliseconds) to queue the second call. Were it starved that long, one step would
        run on the new weights with the old KV before the preemption (its tokens still
        labelled new)."""
        engine = self._engine
        mode = check_take(version, push, mode)
        inflight = mode in INFLIGHT_MODES
        if inflight and not engine.commits_in_step:
            raise InvalidRequestError(
                f"{engine.name} cannot commit an update between two steps (several workers,"
                " speculative decoding or another model runner): no inflight update"
            )
        if mode == "inflight-recompute" and not engine.recomputes_in_step:
            raise InvalidRequestError(
                f"{engine.name} cannot preempt its running requests between two steps"
                " (vLLM schedules ahead: async scheduling): no inflight-recompute"
            )
        engine._check_alive()
        self._taken = None
        finish = self.finish_in_receive or inflight
        kwargs: dict[str, Any] = {
            "update_info": {"version": version, "push": push, "landed": landed},
            "layerwise": self.landing.layerwise if landed else self._layerwise,
            "finish": finish,
        }
        if inflight:
            kwargs["inflight"] = True
            engine._commit_recorded.clear()
        # The preemption's call is made in the same step as the RPC, so it is sent right
        # behind it (see above); it is sent whatever happens here, and its failure is logged.
        call = asyncio.ensure_future(
            self._llm.collective_rpc("asyncroll_take_update", kwargs=kwargs)
        )
        preempt = (
            asyncio.ensure_future(self._llm.reset_prefix_cache(reset_running_requests=True))
            if mode == "inflight-recompute" else None
        )
        if preempt is not None:
            preempt.add_done_callback(_log_failed_preemption)
        rpc = asyncio.ensure_future(engine.call_vllm(call))
        try:
            answers = await self._answers(rpc, version, inflight=inflight, sent=sent)
            if preempt is not None:  # done by now, or soon: the EngineCore's next call
                await asyncio.wait((preempt, engine._death()), return_when=asyncio.FIRST_COMPLETED)
            self.answered = time.perf_counter()
        finally:
            engine._commit_recorded.set()
        failed = [(rank, why) for rank, why in enumerate(answers) if isinstance(why, str)]
        if failed:
            rank, why = failed[0]
            raise WeightSyncError(
                f"{engine.name}: the push failed in {len(failed)} of {len(answers)} workers;"
                f" rank {rank}: {why}"
            )
        finished = finish and all(
            isinstance(answer, dict) and answer.get("finished") for answer in answers
        )
        self._taken = _Taken(finished=finished, marked=inflight)
        return summed(answers)

    async def commit(self, global_steps: int | None) -> None:
        """End a hold, end the update in vLLM (unless the take finished it) and label the
        weights ``global_steps`` (None keeps the label), in a new prefix-cache epoch. Called
        while paused (or after an inflight take), after a successful push; with no take
        before it, it commits the weights in force (a hold ends, the label moves).

        Raises:
            InvalidRequestError: ``global_steps`` is not a version, or lower than the
                engine's; nothing changed.
        """
        engine = self._engine
        global_steps = check_commit(global_steps, engine.global_steps, engine=engine.name)
        taken, self._taken = self._taken, None
        engine._holding = None
        engine._open_gate_if_ready()
        label = version_label(global_steps) if engine.native_versions else None
        # The new weights are in: a new cache epoch first, whatever the label calls below do
        # (an abort update clears no cache: the epoch is all that keeps old KV out of reach).
        engine._cache_epoch += 1
        if taken is not None and not taken.finished:
            # vLLM 0.24 labels nothing (the engine does: see the module doc) and takes no label.
            finish = (
                self._llm.finish_weight_update(weight_version=label)
                if engine.native_versions else self._llm.finish_weight_update()
            )
            await engine.call_vllm(finish)
        elif label is not None:
            await engine.call_vllm(self._llm.update_weight_version(label))
        engine._label_lags = False
        if global_steps is not None:
            engine._global_steps = global_steps
        if taken is None or not taken.marked:  # an inflight take marked its boundary
            await engine._mark_version_boundary(engine._global_steps)

    async def abort(self) -> bool:
        """End the update in every worker; True if each restored its previous weights."""
        self._taken = None
        whole = await self._engine.collective_rpc("asyncroll_abort_weight_update")
        return all(whole)

    async def read_ranges(self) -> list[dict[str, tuple[int, ...]] | None]:
        """Per worker, ``LoadPlan.read_ranges``: ``(first, end)`` of each tensor, and the
        columns ``(first, end, first column, end column)`` where it reads only those."""
        ranges = await self._engine.collective_rpc("asyncroll_read_ranges")
        return [read_ranges_of(found) for found in ranges]

    async def _answers(
        self,
        rpc: asyncio.Future[Any],
        version: int,
        *,
        inflight: bool,
        sent: Callable[[], None] | None,
    ) -> list[Any]:
        """The take RPC's answers; ``sent()`` once it has left."""
        try:
            if sent is not None:
                # vLLM's client hands a call to its socket in the call's first step, and the
                # call runs in a task of its own (``call_vllm``), which asyncio starts in the
                # order it was made: two loop turns see both calls out.
                for _ in range(2):
                    await asyncio.sleep(0)
                sent()
            answers: list[Any] = await (asyncio.shield(rpc) if inflight else rpc)
        except asyncio.CancelledError:
            if not inflight:
                rpc.cancel()
                raise
            # An inflight RPC runs on in the engine and may commit: its answer still labels
            # what the engine serves, then the cancellation goes on.
            outcome: Any = (await asyncio.gather(rpc, return_exceptions=True))[0]
            if isinstance(outcome, list):
                self._took_inflight(outcome, version)
            raise
        if inflight:
            self._took_inflight(answers, version)
        return answers

    def _took_inflight(self, answers: list[Any], version: int) -> None:
        """Record an inflight RPC's answers: where each request switched, if it committed.
        Called with no await since the answer came: no request ends in between."""
        if any(isinstance(answer, str) for answer in answers):
            return  # failed: rolled back in the RPC
        sampled = answers[0].pop("sampled", {})
        for answer in answers[1:]:
            answer.pop("sampled", None)
        self._engine._commit_inflight(version if version >= 0 else None, sampled)


def vllm_client(engine: VLLMEngine) -> AsyncLLM:
    """The vLLM client under ``engine``, for tests and benchmarks that spy on it or read its
    state (``asyncroll.testing.vllm_client``). asyncroll speaks to vLLM through the engine's
    verbs only; a call made on the client bypasses the engine's gate, labels and death watch
    (``VLLMEngine.collective_rpc`` does not)."""
    return engine._llm


def _is_input_error(exc: Exception) -> bool:
    """vLLM's own input-validation errors (not ``ValueError`` subclasses in every version)."""
    return any(cls.__name__ == "VLLMClientError" for cls in type(exc).__mro__)


def _log_failed_preemption(call: asyncio.Future[Any]) -> None:
    """The preemption of an ``inflight-recompute`` update failed: the new weights are in force,
    and the running requests go on from the old weights' KV (as ``inflight``)."""
    if not call.cancelled() and call.exception() is not None:
        logger.warning("vLLM could not preempt the running requests after an inflight update:"
                       " they keep the old weights' KV (%r)", call.exception())


def _segment(
    request_id: str,
    output: RequestOutput | None,
    num_prompt_tokens: int,
    marks: Sequence[tuple[int | None, int]],
    use_spans: bool,
) -> Segment:
    """Turn vLLM's final output into a Segment (an abort may carry no output at all)."""
    if output is None or not output.outputs:
        return aborted_segment(request_id, num_prompt_tokens)
    completion = output.outputs[0]
    token_ids = tuple(completion.token_ids)
    log_probs = _sampled_log_probs(completion.logprobs, token_ids)
    if len(log_probs) != len(token_ids):
        raise EngineGenerateError(
            f"request {request_id!r}: vLLM returned {len(token_ids)} tokens but "
            f"{len(log_probs)} log probs"
        )
    return Segment(
        request_id=request_id,
        token_ids=token_ids,
        log_probs=log_probs,
        global_steps=_per_token_versions(
            completion if use_spans else None, len(token_ids), marks
        ),
        finish_reason=_finish_reason(completion.finish_reason),
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=int(output.num_cached_tokens or 0),
    )


def _sampled_log_probs(entries: Any, token_ids: Sequence[int]) -> tuple[float, ...]:
    """The sampled token's log prob at each position, from vLLM's ``FlatLogprobs`` (plain lists,
    ``start_indices``/``end_indices`` bounding each position) or a list of per-position dicts."""
    if entries is None:
        return ()
    if not hasattr(entries, "start_indices"):
        return tuple(
            entry[token].logprob
            for entry, token in zip(entries, token_ids, strict=False)
            if entry is not None
        )
    ids, values = entries.token_ids, entries.logprobs
    found = []
    bounds = zip(entries.start_indices, entries.end_indices, token_ids, strict=False)
    for start, end, token in bounds:
        found += [values[i] for i in range(start, end) if ids[i] == token][:1]
    return tuple(found)


def _per_token_versions(
    completion: Any, num_tokens: int, marks: Sequence[tuple[int | None, int]]
) -> tuple[int | None, ...]:
    """One label a token: vLLM's version spans where it reports them (0.32+), else the
    boundaries recorded during updates (``marks``: (global_steps, first token) in order, the
    first being the version in force at dispatch)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return _expand_marks(marks, num_tokens)
    versions: list[int | None] = [marks[0][0]] * num_tokens
    for span in spans:
        label = parse_version(span.version)
        for position in range(max(span.start, 0), min(span.end, num_tokens)):
            versions[position] = label
    return tuple(versions)


def _expand_marks(
    marks: Sequence[tuple[int | None, int]], num_tokens: int
) -> tuple[int | None, ...]:
    versions: list[int | None] = []
    for (steps, start), (_, end) in itertools.pairwise([*marks, (None, num_tokens)]):
        versions += [steps] * (min(end, num_tokens) - min(start, num_tokens))
    return tuple(versions)


def _finish_reason(reason: str | None) -> FinishReason:
    if reason in ("stop", "length"):
        return reason  # type: ignore[return-value]
    return "abort"


def _check_model_path(model_path: str | os.PathLike[str]) -> Path:
    """The model's path; a local-looking path that does not exist is an error here, before vLLM
    would take it for a Hugging Face hub id (and fail, after a network timeout, on that)."""
    path = Path(model_path)
    if not path.exists() and (path.is_absolute() or str(model_path).startswith(".")):
        raise EngineStartError(f"model folder {str(model_path)!r} does not exist")
    return path


def read_ranges_of(found: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]] | None:
    """One worker's ``asyncroll_read_ranges`` answer as tuples of ints (a range, or a range
    and the columns read: two or four numbers)."""
    if found is None:
        return None
    return {name: tuple(int(x) for x in read) for name, read in found.items()}


def _reap(
    processes: Sequence[Any],
    monitors: Sequence[threading.Thread] = (),
    timeout: float | None = 5.0,
) -> None:
    """Join vLLM's exited EngineCore processes and release their sentinel pipes, once vLLM's
    monitor threads are done with them: a monitor that saw the process exit reads its
    ``exitcode`` after our close otherwise, and fails with ``ValueError`` (CI saw it). Each
    monitor ends within a second of the shutdown (its wait's period); one that does not
    leaves the processes open. ``timeout`` bounds each join (None: no bound)."""
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout)
    for monitor in monitors:
        monitor.join(timeout)
        if monitor.is_alive():
            logger.warning("vLLM's engine monitor %s outlived the shutdown", monitor.name)
            return
    for process in processes:
        with contextlib.suppress(Exception):
            process.close()  # ValueError if it still runs: then it keeps its pipe


def _engine_args_with_defaults(model_path: Path, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    from vllm.platforms import current_platform

    args: dict[str, Any] = {
        "model": str(model_path),
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "skip_tokenizer_init": not any((model_path / f).exists() for f in _TOKENIZER_FILES),
        "disable_log_stats": True,
        "worker_extension_cls": "asyncroll.vllm.worker.AsyncrollWorkerExtension",
    }
    for key, value in _CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "weight_transfer_config" not in engine_args:
        from vllm.config import WeightTransferConfig

        args["weight_transfer_config"] = WeightTransferConfig(backend="asyncroll")
    if current_platform.is_cpu():
        for key, value in _CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        args["gpu_memory_utilization"] = _CPU_MEMORY_UTILIZATION
        args["dtype"] = "bfloat16"
        # The CPU build's worker rewinds the random generator of a seeded request whose
        # prefill was split across steps, and torch's CPU generator cannot (`CPU Generator does
        # not use offset`): the whole engine dies. Unsplit prefills never rewind. vLLM raises its
        # token budget to the context length where the caller set none.
        args["enable_chunked_prefill"] = False
    args.update(engine_args)
    return args


if TYPE_CHECKING:
    from asyncroll.interfaces import ReceivingEngine

    def _conforms(engine: VLLMEngine) -> ReceivingEngine:
        """mypy checks here that the adapter satisfies the Protocol."""
        return engine
