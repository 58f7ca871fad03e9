"""FakeEngine: an in-process engine that keeps ``VLLMEngine``'s contract, for pure-logic tests.

Tokens are deterministic: each one is a hash of the whole sequence before it (prompt and tokens
generated so far) and the engine's ``seed``, so a request resumed with prompt + partial output
continues exactly as it would have, on any FakeEngine with the same seed. Request ids and sampling
arguments pass the checks ``VLLMEngine`` makes (``asyncroll.validation``) but do not change the
tokens, except ``max_tokens``, ``min_tokens``, ``stop_token_ids`` and ``ignore_eos``; log probs
are in ``[-10, -0.01]``.

The contract kept with ``VLLMEngine`` (``asyncroll.testing.contract``; tests/test_contract.py
runs it on both):
- Bad input raises ``InvalidRequestError`` before admission and counts in ``num_rejected``; a
  request id may not be live twice.
- Admission is gated: while paused or asleep, new requests wait.
- ``pause("abort")`` ends running requests with their partial output (``finish_reason="abort"``),
  ``"keep"`` freezes them until ``resume()``, ``"wait"`` lets them finish first.
- Each token carries the ``global_steps`` in force when it was produced.
- Every admitted request leaves ``in_flight`` exactly once, also when its caller is cancelled.
- A killed or closed engine fails running, waiting and future calls with ``EngineDeadError``.
- Its weight port (``weights``): ``hold()`` admits nothing until a ``commit``, which labels the
  weights.

Time: with ``token_delay=0`` a request yields to the loop once, then produces all its tokens;
with ``token_delay > 0`` it waits that long before each token on a timer that abort, pause,
resume and kill wake early. ``wait_generated`` lets a test act once generation has progressed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncroll.admission import AdmissionGate, aborted_segment
from asyncroll.errors import (
    EngineDeadError,
    EngineSleepingError,
    InvalidRequestError,
    WeightSyncError,
)
from asyncroll.interfaces import Delivery, ResumeMode, UpdateReport
from asyncroll.types import EngineStatistics, FinishReason, PauseMode, Segment
from asyncroll.validation import (
    ENGINE_REQUEST_ID_LEN,
    check_commit,
    check_prompt,
    check_request_id,
    claimed,
    refuse_live,
    resolve_sampling_params,
)
from asyncroll.weights import VersionedUpdater

if TYPE_CHECKING:
    import torch

__all__ = ["FakeChannel", "FakeEngine", "FakeWeightUpdater"]

_MASK = (1 << 64) - 1
_names = itertools.count()


class _Slot:
    """One admitted request: whether it was aborted, and the wait to end early if so."""

    __slots__ = ("aborted", "wakeup")

    def __init__(self) -> None:
        self.aborted = False
        self.wakeup: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)


class FakeEngine:
    """An engine in this process with ``VLLMEngine``'s contract and deterministic tokens.

    ```python
    engine = FakeEngine(name="a", token_delay=0.001)
    segment = await engine.generate("r1", prompt_ids=[5, 6], sampling_params={"max_tokens": 8})
    engine.kill()      # running and later calls raise EngineDeadError
    engine.revive()    # alive again, with the version it had
    ```
    """

    def __init__(
        self,
        *,
        name: str | None = None,
        vocab_size: int = 512,
        max_model_len: int = 512,
        global_steps: int | None = 0,
        token_delay: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        has_tokenizer: bool = False,
    ) -> None:
        """Args:
            name: A name for routing statistics and ``repr``.
            vocab_size: Token ids are in ``[0, vocab_size)``.
            max_model_len: Prompt + ``max_tokens`` may not exceed it.
            global_steps: The version label of the weights in force.
            token_delay: Seconds before each token; 0 yields to the loop once per request.
            seed: Engines with one seed serve "the same model": the same tokens for a prefix.
            eos_token_id: Ends a request with ``finish_reason="stop"`` unless ``ignore_eos``.
            has_tokenizer: Accept arguments that need a tokenizer (``bad_words``, ignored), as a
                ``VLLMEngine`` on a model with one does.
        """
        if token_delay < 0:
            raise InvalidRequestError(f"token_delay must be >= 0, got {token_delay!r}")
        self.name = name or f"fake-{next(_names)}"
        self.commits_in_step = True
        """Each token is made under the label in force as it is made: an update's commit falls
        between two tokens (``ResumeMode`` ``inflight``)."""
        self.recomputes_in_step = True
        """Its requests keep no KV: ``inflight-recompute`` is ``inflight`` here."""
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._global_steps = global_steps
        self._token_delay = token_delay
        self._seed = seed
        self._eos = eos_token_id
        self.has_tokenizer = has_tokenizer
        self._live: set[str] = set()
        self._running: dict[str, _Slot] = {}
        self._gate = AdmissionGate()  # open while admitting, or dead (waiters wake to fail)
        self._idle = asyncio.Event()  # set while nothing runs
        self._idle.set()
        self._paused = False
        self._holding: str | None = None  # admit nothing: a push failed without a backup
        self._weights = FakeWeightPort(self)
        self._frozen = False  # running requests make no progress
        self._sleeping_tags: set[str] = set()
        self._dead = False
        self._closed = False
        self._num_requests = 0
        self._num_aborted = 0
        self._num_rejected = 0
        self._num_generated = 0
        self._progress: list[tuple[int, asyncio.Future[None]]] = []
        self._next_progress = _MASK

    def __repr__(self) -> str:
        state = "dead" if self.is_dead else "asleep" if self.is_asleep else (
            "paused" if self._paused else "running"
        )
        return (
            f"<FakeEngine {self.name} {state} in_flight={len(self._running)} "
            f"global_steps={self._global_steps}>"
        )

    @property
    def global_steps(self) -> int | None:
        """The version label of the weights in force."""
        return self._global_steps

    @property
    def is_dead(self) -> bool:
        return self._dead or self._closed

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_asleep(self) -> bool:
        return bool(self._sleeping_tags)

    @property
    def num_generated(self) -> int:
        """Tokens produced since the engine was made, over all requests."""
        return self._num_generated

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            in_flight=len(self._running),
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
        """Requests the engine itself still tracks (``VLLMEngine``'s name, for shared tests)."""
        return len(self._running)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
    ) -> Segment:
        """Generate one segment for one request, as ``VLLMEngine.generate`` does.

        Raises:
            InvalidRequestError: bad input; nothing was admitted.
            EngineDeadError: the engine was killed or closed.
        """
        self._check_alive()
        try:
            check_request_id(request_id, max_len=ENGINE_REQUEST_ID_LEN)
            params = self._sampling_params(prompt_ids, sampling_params)
            refuse_live(request_id, self._live)
        except InvalidRequestError:
            self._num_rejected += 1
            raise
        prompt = list(prompt_ids)
        with claimed(self._live, request_id):
            if not await self._admitted(request_id):
                self._num_requests += 1
                self._num_aborted += 1
                return aborted_segment(request_id, len(prompt))
            return await self._run(request_id, prompt, params)

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """End running requests with their partial output, and waiting ones with none."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in self._gate.abort(ids):
            slot = self._running.get(request_id)
            if slot is not None:
                slot.aborted = True
                slot.wake()

    async def pause(
        self, mode: PauseMode = "abort", *, clear_cache: bool | None = None
    ) -> None:
        """Stop admitting; ``abort`` ends running requests, ``wait`` drains them, ``keep``
        freezes them until ``resume()``. ``clear_cache`` is accepted (there is no cache)."""
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"pause mode must be abort, wait or keep, not {mode!r}")
        self._check_alive()
        self._paused = True
        await self._stop(mode)

    async def resume(self) -> None:
        """Resume after ``pause()``: frozen requests continue, waiters are admitted. Like a
        real engine's, the call crosses a process boundary first (a loop turn): a caller can
        be cancelled inside it."""
        self._check_alive()
        await asyncio.sleep(0)
        self._check_alive()
        self._paused = False
        self._thaw_if_ready()

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Stop as ``pause(mode)`` does, until ``wake_up()`` (the fake has no memory to free)."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, not {level!r}")
        self._check_alive()
        self._sleeping_tags = {"weights", "kv_cache", "scheduling"}
        await self._stop(mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what ``tags`` name (``weights``, ``kv_cache``, ``scheduling``; None: all)."""
        self._check_alive()
        woken = set(tags) if tags is not None else set(self._sleeping_tags)
        unknown = woken - {"weights", "kv_cache", "scheduling"}
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {sorted(unknown)}")
        self._sleeping_tags -= woken
        self._thaw_if_ready()

    def check_weights_awake(self) -> None:
        """Raise if the engine's weights are asleep (``VLLMEngine``'s check before a push)."""
        self._check_alive()
        if "weights" in self._sleeping_tags:
            raise EngineSleepingError(f"{self.name} is asleep: wake_up(['weights']) first")

    def set_global_steps(self, global_steps: int | None) -> None:
        """Relabel the weights in force, as a finished weight update does."""
        self._global_steps = global_steps

    @property
    def weights(self) -> FakeWeightPort:
        """The engine's update surface (``asyncroll.interfaces.WeightPort``)."""
        return self._weights

    async def wait_generated(self, count: int) -> None:
        """Wait until the engine has produced ``count`` tokens in all (``num_generated``).

        Raises:
            EngineDeadError: the engine died first.
        """
        self._check_alive()
        if self._num_generated >= count:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._progress.append((count, waiter))
        self._next_progress = min(self._next_progress, count)
        try:
            await waiter
        finally:
            self._progress = [entry for entry in self._progress if entry[1] is not waiter]

    def kill(self) -> None:
        """Die like a crashed EngineCore: running, waiting and later calls raise
        ``EngineDeadError`` (what ``VLLMEngine`` raises once its EngineCore is gone)."""
        self._dead = True
        self._wake_all()

    def revive(self) -> None:
        """Undo ``kill()``: the engine serves again, with the version and pause state it had."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed and stays so")
        self._dead = False
        self._sync_gate()

    async def aclose(self) -> None:
        """Close the engine: it is dead from now on. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake_all()

    # -- internals -------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(f"{self.name} is closed")
        if self._dead:
            raise EngineDeadError(f"{self.name} is dead")

    def _sampling_params(
        self, prompt_ids: Sequence[int], params: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        prompt = check_prompt(prompt_ids, vocab_size=self.vocab_size)
        return resolve_sampling_params(
            params,
            prompt_len=len(prompt),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            has_tokenizer=self.has_tokenizer,
        )

    async def _admitted(self, request_id: str) -> bool:
        """Wait until admitted: True; False if aborted while waiting."""
        while True:
            self._check_alive()
            if not self._paused and not self._sleeping_tags and self._holding is None:
                return True
            if not await self._gate.admit(request_id):
                return False

    async def _run(self, request_id: str, prompt: list[int], params: dict[str, Any]) -> Segment:
        slot = _Slot()
        self._running[request_id] = slot
        self._idle.clear()
        self._num_requests += 1
        try:
            segment = await self._decode(request_id, slot, prompt, params)
        finally:
            del self._running[request_id]
            if not self._running:
                self._idle.set()
        if segment.finish_reason == "abort":
            self._num_aborted += 1
        return segment

    async def _decode(
        self, request_id: str, slot: _Slot, prompt: list[int], params: dict[str, Any]
    ) -> Segment:
        max_tokens: int = params["max_tokens"]
        min_tokens = int(params.get("min_tokens") or 0)
        stops = set(params.get("stop_token_ids") or ())
        if self._eos is not None and not params.get("ignore_eos"):
            stops.add(self._eos)
        state = _prefix_state(self._seed, prompt)
        tokens: list[int] = []
        log_probs: list[float] = []
        steps: list[int | None] = []
        finish: FinishReason = "length"
        if not self._token_delay:
            await asyncio.sleep(0)
        while len(tokens) < max_tokens:
            await self._turn(slot)
            if slot.aborted:
                finish = "abort"
                break
            draw = _draw(state)
            token = draw % self.vocab_size
            tokens.append(token)
            log_probs.append(-(1 + (draw >> 40) % 1000) / 100)
            steps.append(self._global_steps)
            state = _fold(state, token)
            self._count_token()
            if token in stops and len(tokens) >= min_tokens:
                finish = "stop"
                break
        return Segment(
            request_id=request_id,
            token_ids=tuple(tokens),
            log_probs=tuple(log_probs),
            global_steps=tuple(steps),
            finish_reason=finish,
            num_prompt_tokens=len(prompt),
        )

    async def _turn(self, slot: _Slot) -> None:
        """Wait for the next token's turn: the token delay, then while frozen."""
        if self._token_delay:
            await self._park(slot, self._token_delay)
        while self._frozen and not slot.aborted:
            self._check_alive()
            await self._park(slot, None)
        self._check_alive()

    async def _park(self, slot: _Slot, delay: float | None) -> None:
        loop = asyncio.get_running_loop()
        wakeup: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(delay, _wake, wakeup) if delay is not None else None
        slot.wakeup = wakeup
        try:
            await wakeup
        finally:
            slot.wakeup = None
            if timer is not None:
                timer.cancel()

    async def _stop(self, mode: PauseMode) -> None:
        self._gate.clear()
        if mode == "wait":
            await self._idle.wait()
        elif mode == "abort":
            for slot in self._running.values():
                slot.aborted = True
                slot.wake()
            await self._idle.wait()
        self._frozen = True
        self._sync_gate()
        self._check_alive()  # the engine may have died while draining

    def _thaw_if_ready(self) -> None:
        if self._paused or self._sleeping_tags:
            return
        self._frozen = False
        for slot in self._running.values():
            slot.wake()
        self._sync_gate()

    def _sync_gate(self) -> None:
        if self.is_dead or not (self._paused or self._sleeping_tags or self._holding is not None):
            self._gate.set()
        else:
            self._gate.clear()

    def _wake_all(self) -> None:
        self._gate.set()
        for slot in self._running.values():
            slot.wake()
        progress, self._progress, self._next_progress = self._progress, [], _MASK
        for _, waiter in progress:
            if not waiter.done():
                waiter.set_exception(EngineDeadError(f"{self.name} died"))

    def _count_token(self) -> None:
        self._num_generated += 1
        if self._num_generated < self._next_progress:
            return
        for count, waiter in self._progress:
            if count <= self._num_generated:
                _wake(waiter)
        pending = [count for count, waiter in self._progress if not waiter.done()]
        self._next_progress = min(pending, default=_MASK)


class FakeWeightPort:
    """A ``FakeEngine``'s weight port: a hold and a label (no cache, no workers)."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def hold(self, reason: str) -> None:
        """Admit nothing until a ``commit``."""
        self._engine._holding = reason
        self._engine._sync_gate()

    async def commit(self, global_steps: int | None) -> None:
        """End a hold and label the weights ``global_steps`` (None keeps the label)."""
        engine = self._engine
        global_steps = check_commit(global_steps, engine.global_steps, engine=engine.name)
        engine._check_alive()
        engine._holding = None
        engine._sync_gate()
        if global_steps is not None:
            engine._global_steps = global_steps


class FakeChannel:
    """A ``WeightChannel`` that moves nothing: it can wait mid-push and fail on request."""

    def __init__(
        self,
        *,
        hold: asyncio.Event | None = None,
        failures: int = 0,
        leave_holding: Sequence[str] = (),
    ) -> None:
        self.hold = hold
        self.failures = failures
        self.leave_holding = list(leave_holding)
        self.is_holding = False
        self.closed = False

    def checkpoint_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors  # a fake engine has no checkpoint

    async def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.closed:
            raise WeightSyncError("the FakeWeightUpdater is closed")

    def inflight_refusal(self) -> str | None:
        return None  # nothing is moved: nothing can be torn

    async def push(
        self,
        engines: Sequence[Any],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: ResumeMode = "keep",
    ) -> None:
        if self.hold is not None:
            self.is_holding = True
            try:
                await self.hold.wait()
            finally:
                self.is_holding = False
        if self.failures > 0:
            self.failures -= 1
            raise WeightSyncError(f"planned failure (version {version})")

    async def abort(self, engines: Sequence[Any]) -> list[str]:
        return [e.name for e in engines if e.name in self.leave_holding]

    def deliveries(self) -> dict[str, Delivery]:
        return {}  # nothing moves

    async def aclose(self) -> None:
        self.closed = True


class FakeWeightUpdater(VersionedUpdater):
    """The manager's ``WeightUpdater`` over FakeEngines: ``WeightPusher``'s update sequence
    (checks, pause, label, resume; holds after a failed push) with a channel that moves no
    tensors."""

    def __init__(
        self,
        engines: Sequence[FakeEngine],
        *,
        hold: asyncio.Event | None = None,
        failures: int = 0,
        leave_holding: Sequence[str] = (),
    ) -> None:
        """Args:
            engines: The engines to update (dead ones are skipped at each update).
            hold: If given, each update waits for it while the engines are paused (a push in
                progress), so tests can act mid-update.
            failures: How many of the next updates fail with ``WeightSyncError`` after pausing.
            leave_holding: Names of engines a failed push leaves holding (as a push without a
                backup does), the others serving their previous weights.
        """
        self.channel = FakeChannel(hold=hold, failures=failures, leave_holding=leave_holding)
        super().__init__(engines, self.channel)
        self.num_updates = 0

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        global_steps: int | None,
        mode: ResumeMode = "abort",
        changed: bool = False,
        prechecked: bool = False,
    ) -> UpdateReport:
        report = await super().update(
            named_tensors, global_steps=global_steps, mode=mode, changed=changed,
            prechecked=prechecked,
        )
        self.num_updates += 1
        return report

    @property
    def is_holding(self) -> bool:
        """Whether an update waits on ``hold`` (the engines are paused)."""
        return self.channel.is_holding

    @property
    def failures(self) -> int:
        """How many of the next updates fail after pausing."""
        return self.channel.failures

    @failures.setter
    def failures(self, count: int) -> None:
        self.channel.failures = count


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fold(state: int, token: int) -> int:
    """The prefix hash after one more token (FNV-1a over whole token ids)."""
    return ((state ^ (token + 1)) * 0x100000001B3) & _MASK


def _prefix_state(seed: int, prompt: Sequence[int]) -> int:
    state = (0xCBF29CE484222325 ^ seed) & _MASK
    for token in prompt:
        state = _fold(state, token)
    return state


def _draw(state: int) -> int:
    """Spread a prefix hash over 64 bits (splitmix64's finaliser)."""
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


if TYPE_CHECKING:
    from asyncroll.interfaces import UpdatableEngine, WeightChannel, WeightUpdater

    def _conforms(
        engine: FakeEngine, updater: FakeWeightUpdater, channel: FakeChannel
    ) -> tuple[UpdatableEngine, WeightUpdater, WeightChannel]:
        """mypy checks here that the fakes satisfy the Protocols."""
        return engine, updater, channel
