"""The protocols the upper floors speak to engines and updaters through, and their value types.

Three floors, each typed against the one below only through this module:
- ``AsyncServerManager`` routes over any ``Engine`` and updates through any ``WeightUpdater``.
- ``WeightPusher`` and ``FakeWeightUpdater`` run one update sequence (``asyncroll.weights``)
  over any ``UpdatableEngine``; what moves the bytes is a ``WeightChannel``.
- ``SenderChannel`` (``asyncroll.weights``) pushes through asyncroll's transport into any
  ``ReceivingEngine``: an engine whose weight port (``engine.weights``, a ``ReceivingPort``)
  attaches its workers to a ``WeightSender`` and takes pushes from it.

An engine's update surface is its weight port alone; the engine itself only pauses, resumes,
sleeps and wakes. An update is four calls per engine: ``pause``, ``weights.take``,
``weights.commit``, ``resume``.

``VLLMEngine`` (``asyncroll.vllm``) is a ``ReceivingEngine``; ``testing.FakeEngine`` is an
``UpdatableEngine``. Both pass ``asyncroll.testing.contract``; so must any new engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from asyncroll.types import Delivery, EngineStatistics, PauseMode, Segment, UpdateReport

if TYPE_CHECKING:
    import torch

    from asyncroll.transport import PushReport

__all__ = [
    "Delivery",
    "Engine",
    "INFLIGHT_MODES",
    "RESUME_MODES",
    "ReceivingEngine",
    "ReceivingPort",
    "ResumeMode",
    "UpdatableEngine",
    "UpdateReport",
    "WeightChannel",
    "WeightPort",
    "WeightUpdater",
]

ResumeMode = Literal["abort", "keep", "recompute", "inflight", "inflight-recompute"]
"""How an update treats requests in flight:

- ``abort`` ends them with their partial output; the manager resubmits prompt + output, so
  their KV is computed again by the new weights (and a request may move to another engine).
- ``keep`` freezes them in their engine; they go on from their KV cache, which the old weights
  computed, with the new weights (an in-flight update, as PipelineRL does): the cheapest. This
  holds for every request that reached the engine before the update, including those still
  queued in vLLM: their prompts may hit prefix blocks the old weights computed. Requests
  admitted after the update never do.
- ``recompute`` freezes them in their engine too, but drops their KV: it is computed again by
  the new weights before they go on (vLLM preempts them). Same tokens as ``abort``, with no
  round trip through the manager.
- ``inflight`` pauses nothing: the engine keeps serving while the bytes come, and commits them
  between two of its steps, in one call that no forward pass interleaves; requests keep their
  KV, as in ``keep``. The engine must commit in its step loop (``VLLMEngine.commits_in_step``)
  and keep a backup of its weights, so that a push that fails midway is undone before its
  next step; anything else refuses the mode before the push.
- ``inflight-recompute`` is ``inflight`` whose running requests then drop their KV, between
  the same two steps: vLLM preempts them and clears its prefix cache, and the new weights
  compute their KV again before their next token (``recompute`` with no pause). Nothing is
  aborted. The engine must also schedule one step at a time, not ahead (vLLM's async
  scheduling off: ``VLLMEngine.recomputes_in_step``).

Each token is labelled with the weights that sampled it in every mode."""

RESUME_MODES: tuple[ResumeMode, ...] = (
    "abort", "keep", "recompute", "inflight", "inflight-recompute"
)
INFLIGHT_MODES: tuple[ResumeMode, ...] = ("inflight", "inflight-recompute")
"""The modes that pause nothing."""


class Engine(Protocol):
    """What the manager needs of an engine: generation, pause and resume, statistics."""

    name: str
    vocab_size: int
    max_model_len: int

    @property
    def is_dead(self) -> bool: ...

    @property
    def global_steps(self) -> int | None: ...

    @property
    def has_tokenizer(self) -> bool: ...

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
    ) -> Segment:
        """Generate one segment. The request id is checked and registered at the call's
        first step, before any await: a second call with an id still live raises
        ``InvalidRequestError`` however the two calls interleave."""
        ...

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """End live requests with ``finish_reason="abort"``: running ones with their partial
        output, ones still waiting at the adapter's gate (paused, asleep, holding) with none,
        at once (``asyncroll.admission``). Ids that are not live are ignored."""
        ...

    async def pause(
        self, mode: PauseMode = "abort", *, clear_cache: bool | None = None
    ) -> None: ...

    async def resume(self) -> None: ...

    def statistics(self) -> EngineStatistics: ...

    async def aclose(self) -> None: ...


class WeightPort(Protocol):
    """An engine's side of a versioned update: ``engine.weights``.

    The update sequence (``asyncroll.weights``) pauses the engine, has its channel move the
    bytes, then ``commit``s; where a failed push leaves the weights not whole, it ``hold``s.
    """

    def hold(self, reason: str) -> None:
        """Admit no request until a ``commit`` (the weights in force are not whole)."""

    async def commit(self, global_steps: int | None) -> None:
        """The new weights are whole: end a hold, label them ``global_steps`` (None keeps the
        label), and move to a new prefix-cache epoch, so that no request admitted from here on
        reuses KV cached before (``VLLMEngine`` salts each request's cache key with the epoch).
        Called after a successful push, before the resume."""


@runtime_checkable
class UpdatableEngine(Engine, Protocol):
    """An engine whose weights change under a versioned update (``asyncroll.weights``), and
    that sleeps and wakes around a colocated trainer's steps."""

    @property
    def weights(self) -> WeightPort: ...

    @property
    def is_asleep(self) -> bool: ...

    def check_weights_awake(self) -> None:
        """Raise ``EngineSleepingError`` if the weights are asleep, ``EngineDeadError`` if the
        engine is gone."""

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None: ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> None: ...


class ReceivingPort(WeightPort, Protocol):
    """The weight port of an engine whose workers take pushes from a ``WeightSender`` (shared
    memory or CUDA IPC) or a push group (broadcast).

    Attached once (``attach``); per push, ``take`` while the sender pushes, then ``commit``
    on success, ``abort`` on any failure. An update is four calls per engine: ``pause``,
    ``take``, ``commit``, ``resume``.
    """

    @property
    def num_workers(self) -> int:
        """How many receivers the engine's workers open (one per worker)."""

    @property
    def served_dtype(self) -> torch.dtype: ...

    @property
    def attached_to(self) -> object | None:
        """The owner of the sender the workers are attached to (one at a time), or None."""

    async def attach(self, config: Mapping[str, Any], *, owner: object) -> None:
        """Connect every worker to the sender ``config`` describes (``receiver_config()``
        plus ``backup``, ``load`` and ``plan``)."""

    async def detach(self) -> None: ...

    async def take(
        self,
        version: int,
        *,
        push: int = 0,
        mode: ResumeMode = "keep",
        sent: Callable[[], None] | None = None,
    ) -> Delivery | None:
        """Take one whole push: the workers begin the update, load every bucket, check it and,
        where they can, finish it, in one round trip. Returns what they took (None: not
        known).

        ``version``: the update's ``global_steps``, or -1 for an update that keeps the label.
        ``push``: the sender's id of that push (``WeightSender.next_push``): messages of
        earlier pushes still queued for the workers are skipped (0: the next push).
        ``mode``: ``abort``, ``keep`` and ``recompute`` take into a paused engine; the
        ``INFLIGHT_MODES`` into a running one, which commits the push between two of its steps
        and labels the new weights ``version`` at once (``ResumeMode``); an engine that cannot
        raises ``InvalidRequestError``. ``sent()`` is called once the request has left for the
        workers (anyio's ``task_status.started()``): a sender that starts then finds them
        waiting."""

    async def abort(self) -> bool:
        """End a failed push in every worker; True if the previous weights are whole again."""

    async def read_ranges(self) -> list[dict[str, tuple[int, ...]] | None]:
        """Per worker, in order: the range of elements ``[first, end)`` of each pushed tensor
        its load reads, and where it reads only some columns of every row, those too:
        ``(first, end, first column, end column)`` (its load plan's, once a push taught it);
        or None (no load plan)."""


@runtime_checkable
class ReceivingEngine(UpdatableEngine, Protocol):
    """An engine whose weight port takes pushes through asyncroll's transport."""

    model_path: str

    @property
    def weights(self) -> ReceivingPort: ...


class WeightChannel(Protocol):
    """What moves the bytes of an update (the update sequence does everything else)."""

    async def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse a bad update before anything pauses (``InvalidRequestError``)."""

    async def push(
        self,
        engines: Sequence[Any],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: ResumeMode = "keep",
    ) -> PushReport | None:
        """Move ``tensors`` into the paused ``engines`` (the ``INFLIGHT_MODES``: into running
        ones, each committing between two of its steps; see ``ResumeMode``)."""

    def inflight_refusal(self) -> str | None:
        """Why this channel cannot push into running engines (``inflight``), or None."""

    async def abort(self, engines: Sequence[Any]) -> list[str]:
        """End a failed push; the names of engines left without whole weights."""

    def deliveries(self) -> dict[str, Delivery]:
        """After a successful push: engine name -> what its workers took (where known)."""

    async def aclose(self) -> None: ...


class WeightUpdater(Protocol):
    """Pauses, pushes, labels and resumes a set of engines (``WeightPusher`` for vLLM)."""

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        global_steps: int | None,
        mode: ResumeMode = "abort",
        changed: bool = False,
    ) -> UpdateReport: ...

    async def aclose(self) -> None: ...
