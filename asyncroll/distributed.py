"""A trainer of several ranks pushing into engines: each rank serves the workers on its own GPU.

The colocation this project comes from: each GPU of a node holds one trainer rank (FSDP
sharded) and one vLLM worker, in separate processes. At an update every rank gathers the full
tensors bucket by bucket and hands them to the worker on its GPU through its own staging
buffers (CUDA IPC there, shared memory on CPU); one rank, the coordinator, pauses, labels and
resumes the engines, so ``update`` keeps ``WeightPusher.update``'s meaning.

Every rank builds a ``DistributedWeightPusher`` (a collective: it makes a gloo group for its
control messages) and calls ``update`` with the same names, shapes and ``global_steps``. Per
update:

1. Every rank checks what it holds (its shards are finite) and the coordinator what it knows
   (``global_steps``, its engines, names, shapes and dtypes against the checkpoint); the ranks
   agree in one collective. A bad update raises ``InvalidRequestError`` on every rank, before
   anything pauses.
2. At the first update (and when the engines change) every rank opens its sender, and the
   coordinator attaches each engine worker to the sender of its rank (worker ``i`` of all
   engines, counted in order, to rank ``i % world_size``).
3. The coordinator runs the update sequence (pause, push, label, cache reset, resume) while
   every other rank pushes into its workers. Where every worker reads only rows that its rank
   holds (the workers' load plans say what they read, asked after the first pushes), each rank
   pushes its own rows as a ``Piece`` (``asyncroll.transport.piece``), with no gather; with
   ``column_blocks``, where every worker reads only some columns of each row (o, down), the ranks
   exchange those column blocks when the tensor's bucket is packed (the sends and receives of
   a bucket's exchanges in one batch) and each pushes its workers' block as a piece. The
   coordinator chooses these in step 1's collective, so every rank plans the same buckets.
   Any other sharded tensor (``DTensor``) is gathered when its first bucket is packed
   (``asyncroll.transport.lazy``): every rank gathers the same tensors in the same order, and
   the peak memory is the staging buffers plus the buckets in flight, never a full copy of the
   model. A worker that cannot load a piece (its plan was
   dropped) fails the push; the coordinator's verdict says so, and every rank pushes whole
   tensors in the same update.
   A transformers-5 mixture's fused experts (``mlp.experts.gate_up_proj``, sharded over the
   experts) are pushed under the per-expert names of the engines' checkpoint, which the
   coordinator reads and broadcasts before step 1 (``asyncroll.experts.unfusing``); each
   fused tensor is gathered once, when its first expert's bucket is packed (``ExpertPart``).
4. The coordinator tells every rank the outcome: each returns the coordinator's
   ``UpdateReport`` (with its own ``PushReport``) or raises the same ``WeightSyncError``.

A rank that dies fails the update on every other rank within ``timeout``: its workers see their
sender go (the engines roll back), and the collectives it no longer joins fail. Tensors a failed
push did not gather are still gathered, in order, so no rank is left in a collective.

With ``backend="broadcast"`` the engines sit on other GPUs or hosts (the split layout): each
rank forms a push group with the workers it serves (``asyncroll.transport.broadcast``) and the
steps above are the same; with ``fan_in`` every worker joins every rank's group, and each rank
sends its own rows of every sharded tensor, with no gather.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from asyncroll.errors import InvalidRequestError, PieceNotPlannedError, WeightSyncError
from asyncroll.experts import FUSED_EXPERTS, Unfusing, expert_parts, split_experts, unfusing
from asyncroll.fingerprints import SAMPLES, Fingerprinter, sampled
from asyncroll.interfaces import INFLIGHT_MODES, ReceivingEngine, ResumeMode, UpdateReport
from asyncroll.transport import (
    CudaIpcBackend,
    LazyTensor,
    Piece,
    ShmBackend,
    TensorMeta,
    WeightSender,
    plan_buckets,
)
from asyncroll.transport.aio import shielded
from asyncroll.transport.broadcast import BroadcastSender, open_broadcast_sender
from asyncroll.transport.defaults import DEFAULT_BUCKET_BYTES
from asyncroll.transport.lazy import Makes
from asyncroll.transport.sender import open_weight_sender
from asyncroll.update_check import check_update
from asyncroll.validation import check_global_steps, check_resume_mode
from asyncroll.weights import WeightPusher

__all__ = ["TORCHRUN_VARIABLES", "DistributedWeightPusher", "torchrun_hidden"]

TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
"""torchrun's variables: a vLLM engine started under torchrun must not see them."""


@contextlib.contextmanager
def torchrun_hidden() -> Iterator[None]:
    """While vLLM starts an engine under torchrun: its worker processes inherit the
    environment, and torchrun's rank variables would make them join the trainer's process group
    instead of their own."""
    saved = {name: os.environ.pop(name) for name in TORCHRUN_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)

logger = logging.getLogger(__name__)


class DistributedWeightPusher:
    """One per trainer rank; the coordinator rank holds the engines (see the module doc)."""

    def __init__(
        self,
        engines: Sequence[ReceivingEngine] = (),
        *,
        coordinator: int = 0,
        dtype: torch.dtype | None = None,
        bucket_bytes: int | None = None,
        buffers: int = 2,
        backend: Literal["auto", "shm", "cuda_ipc", "broadcast"] = "auto",
        timeout: float = 120.0,
        load: Literal["auto", "layerwise", "direct"] = "auto",
        load_plan: bool = True,
        check_finite: bool = True,
        verify: bool = True,
        pieces: bool = True,
        column_blocks: bool | Literal["auto"] = "auto",
        fan_in: bool = False,
    ) -> None:
        """Call on every rank at once (it makes a process group). Args as ``WeightPusher``,
        and:

            engines: The engines, on the coordinator rank only (empty on the others).
            coordinator: The rank that pauses, labels and resumes the engines.
            bucket_bytes: On GPUs, 1 GiB by default (``WeightPusher``'s 512 MiB): each bucket's
                gathers run before it is packed, and at 7B the larger buckets were faster in
                every variant measured (``DEFAULT_BUCKET_BYTES``).
            buffers: Staging buffers on each rank: 2 (not ``WeightPusher``'s 3 with CUDA IPC;
                every rank's GPU also holds its trainer shard and the gathered buckets).
            dtype: Push floating tensors as this dtype (the engines' ``bfloat16``, say): a
                float32 master weight is cast as it is packed, never copied whole first.
            pieces: Where every worker reads only rows that the rank serving it holds (its
                tensor-parallel shard of q, k, v, gate, up, the embedding, the head), push
                each rank's own rows, with no gather (learned from the workers' load plans
                after the first push; ``pieces``). False: always whole tensors.
            backend: ``auto`` (CUDA IPC on GPUs, shared memory on CPU), ``shm`` or ``cuda_ipc``:
                each rank feeds the workers on its own GPU (colocated). ``broadcast``: the
                engines on other GPUs or hosts (split): each rank forms a push group of its
                own with the workers it serves (NCCL between GPUs, gloo on CPU;
                ``asyncroll.transport.broadcast``), meeting at its host's routable address,
                and sends them its tensors, its own rows where they are all a worker reads
                (``pieces``); no rank sends another's workers anything, so the engines are
                fed in parallel, one group a rank. The coordinator must serve a worker
                (rank 0 serves worker 0).
            fan_in: With ``backend="broadcast"``: every worker joins every rank's push group,
                and each rank sends only its own rows of each sharded tensor, to every worker
                at once (one broadcast, relayed between the workers), with no gather; the
                coordinator sends the tensors that are not sharded. For engines that read
                whole tensors (TP=1, data-parallel): each GPU receives the model once, from
                every rank. Every sharded tensor must be ``Shard(0)`` over all ranks, its rows
                dividing evenly (anything else is refused before anything pauses).
            column_blocks: Where every worker reads only some columns of each row (the
                row-parallel shard of o and down), the ranks exchange those column blocks
                (a bucket's exchanges in one batch of sends and receives) and push each
                worker its block, instead of gathering the whole tensor (needs ``pieces``).
                ``auto`` (the default): for tensors of at least ``COLUMN_BLOCK_BYTES``
                (32 MiB), whose gather moves most; smaller ones are gathered, one call a
                bucket, where each exchange's sends and receives cost more than the bytes
                they save. True: every such tensor; False: none. On four H200s
                (docs/performance.md): a 32B shape took 59.0 ms with the exchange against
                104.5 ms gathered; a 1.5B shape (every o and down under 32 MiB) 24.6 against
                16.4, and the 30B-A3B's 6,144 expert projections of 3 MiB 1,257 against
                676 ms. On two H200s a 7B shape (down exchanged, o gathered) took 24.7 ms
                against 28.7 with both gathered and 26.6 with both exchanged.
        """
        if not dist.is_initialized():
            raise InvalidRequestError("torch.distributed is not initialized (init_process_group)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if not 0 <= coordinator < self.world_size:
            raise InvalidRequestError(
                f"coordinator {coordinator} is not a rank of {self.world_size}"
            )
        if (self.rank == coordinator) != bool(engines):
            raise InvalidRequestError("pass the engines on the coordinator rank, and only there")
        if not isinstance(buffers, int) or isinstance(buffers, bool) or buffers < 1:
            raise InvalidRequestError(f"buffers must be an int of at least 1, not {buffers!r}")
        if backend not in ("auto", "shm", "cuda_ipc", "broadcast"):
            raise InvalidRequestError(
                f"backend must be auto, shm, cuda_ipc or broadcast, not {backend!r}"
            )
        if fan_in and backend != "broadcast":
            raise InvalidRequestError("fan_in=True sends through push groups: backend='broadcast'")
        if not (isinstance(column_blocks, bool) or column_blocks == "auto"):
            raise InvalidRequestError(
                f"column_blocks must be True, False or 'auto', not {column_blocks!r}"
            )
        self._fan_in = fan_in
        self._coordinator = coordinator
        self._dtype = dtype
        self._buffers = buffers
        self._backend = backend
        if bucket_bytes is None and self._on_cuda() and backend != "broadcast":
            bucket_bytes = DEFAULT_BUCKET_BYTES["sharded_cuda_ipc"]
        self._timeout = timeout
        self._bucket_bytes = bucket_bytes
        self._verify = verify
        self._check_finite = check_finite
        self._use_pieces = pieces
        self._column_blocks = column_blocks
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._pusher = (
            WeightPusher(
                engines,
                bucket_bytes=bucket_bytes,
                buffers=buffers,
                backend=backend,
                timeout=timeout,
                load=load,
                load_plan=load_plan,
                check_finite=False,  # every rank checks its own shards
                verify=verify,
            )
            if engines
            else None
        )
        self._engines = list(engines)
        self._sender: WeightSender | BroadcastSender | None = None
        """A follower's (the coordinator's is its pusher's)."""
        self._stack: contextlib.AsyncExitStack | None = None
        self._fingerprinter = Fingerprinter()
        self._lazy_fingerprinter = Fingerprinter()
        self._known: dict[str, bytes] = {}
        """This update's fingerprints of lazy tensors, from the shards."""
        self._updates = 0
        self._reads: list[dict[str, tuple[int, ...]] | None] | None = None
        """(Coordinator.) Per worker, what its load reads of each tensor (None: not known)."""
        self._read_updates = 0
        self._piece_failures = 0
        self._last_pieces: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        role = "coordinator" if self.is_coordinator else "follower"
        return f"<DistributedWeightPusher rank={self.rank}/{self.world_size} {role}>"

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self._coordinator

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        global_steps: int | None,
        mode: ResumeMode = "abort",
        changed: bool = False,
    ) -> UpdateReport:
        """Push the model into the engines, every rank at once (see the module doc). On the
        coordinator, an ``AsyncServerManager(engines, weights=pusher)`` calls this for
        ``manager.update_weights`` (requests in flight resume), while the other ranks call it
        themselves. ``changed=True`` is refused: its check compares fingerprints of whole
        tensors before the pause, and sharded tensors are whole only as they are pushed.

        Raises:
            InvalidRequestError: on every rank: a rank's tensors are bad (not finite, not the
                checkpoint's names, shapes or dtypes, another layout than the other ranks'),
                or ``global_steps`` is; nothing paused.
            WeightSyncError: on every rank: the push failed (the engines serve their
                previous weights, or hold), or a rank died.
        """
        steps = check_global_steps(global_steps)
        check_resume_mode(mode)  # only the coordinator pauses, but every rank says it is wrong
        if mode in INFLIGHT_MODES:  # every rank raises alike: none has begun a collective
            raise InvalidRequestError(
                f"mode={mode!r} is not yet offered for a sharded push (several senders into"
                " one RPC between two engine steps is untested); use keep, abort or recompute"
            )
        if changed:
            raise InvalidRequestError("changed=True needs whole tensors: not with a sharded push")
        made: set[str] = set()
        given = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        pairs = await self._unfused(given)
        pushed, local = self._pushed(pairs, made)
        named = dict(pairs)
        # The fingerprints of the full tensors, from the shards (no gather), before any pause.
        self._known = await self._shard_fingerprints(pushed, named) if self._verify else {}
        if self._pusher is not None:
            self._pusher.channel.know_fingerprints(self._known)
        problem = await self._problem(pushed, local, steps)
        connect = self._needs_connect()
        if connect:
            self._reads = None  # new workers: learn what they read again
        pieces = (
            self._piece_names(named) if self._pusher is not None and not self._fan_in else {}
        )
        if self._fan_in and problem is None:
            problem = _fan_in_refusal(named, self.world_size)
        answers = await self._all_gather(
            (problem, _layout(pushed), connect, self._workers(), pieces)
        )
        problems = [p for p in (a[0] for a in answers) if p]
        if len({a[1] for a in answers}) != 1:
            problems.append("the ranks push different names, shapes or dtypes")
        if problems:
            raise InvalidRequestError("; ".join(dict.fromkeys(problems)))
        _, _, _, workers, pieces = answers[self._coordinator]
        if self._backend == "broadcast" and not self._fan_in and not workers[self._coordinator]:
            raise InvalidRequestError(  # (every rank raises alike: the same agreed counts)
                "backend='broadcast' needs the coordinator to serve a worker (worker i is"
                f" served by rank i % {self.world_size}: make rank 0 the coordinator)"
            )
        connect = any(a[2] for a in answers)
        try:
            return await self._push(
                pushed, named, pieces, made, steps, mode, connect=connect, workers=workers
            )
        except _PiecesFailed as exc:
            # A worker's load plan could not load a piece (its parameters moved, say): the
            # coordinator said so to every rank, and every rank pushes whole tensors now,
            # after agreeing again on the engines' workers (one may have died meanwhile).
            logger.warning("rank %d: pushing whole tensors again: %s", self.rank, exc)
            self._reads = None
            self._piece_failures += 1
        answers = await self._all_gather((self._needs_connect(), self._workers()))
        connect = any(a[0] for a in answers)
        workers = answers[self._coordinator][1]
        made = set()
        pushed, _ = self._pushed(pairs, made)
        return await self._push(
            pushed, named, {}, made, steps, mode, connect=connect, workers=workers
        )

    @property
    def pieces(self) -> frozenset[str]:
        """The tensors the last update pushed as pieces (no gather): each rank its own rows,
        where those are all that the workers it serves read, or the column blocks the ranks
        exchanged (``UpdateReport.pieces`` says which)."""
        return self._last_pieces

    async def aclose(self) -> None:
        """Close this rank's sender (the coordinator: detach the engines). Idempotent."""
        if self._pusher is not None:
            await self._pusher.aclose()
        stack, self._stack, self._sender = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    # -- the steps of an update ----------------------------------------------------------

    async def _push(
        self,
        pushed: dict[str, torch.Tensor | LazyTensor],
        named: Mapping[str, torch.Tensor | ExpertPart],
        pieces: Mapping[str, Windows | None],
        made: set[str],
        steps: int | None,
        mode: ResumeMode,
        *,
        connect: bool = False,
        workers: Sequence[int] = (),
    ) -> UpdateReport:
        """One push of the update by every rank (whole tensors, or ``pieces`` as pieces: each
        rank's rows, or the columns its workers read, ``_piece_names``)."""
        version = steps if steps is not None else -1
        with_pieces: dict[str, torch.Tensor | LazyTensor | Piece] = dict(pushed)
        self._last_pieces = frozenset(pieces)
        try:
            if self._fan_in:
                with_pieces = self._own_rows(pushed, named)
                pieces = dict.fromkeys((n for n, t in with_pieces.items()
                                        if isinstance(t, Piece)), None)
                self._last_pieces = frozenset(pieces)
            else:
                with_pieces = self._with_pieces(pushed, named, pieces, made)
            if connect:
                await self._connect(list(workers))
            how = {name: "rows" if windows is None else "columns"
                   for name, windows in pieces.items()}
            if self._pusher is not None:
                report = await self._coordinate(with_pieces, steps, mode, pieces=bool(pieces))
                if self._reads is None or self._read_updates < 2:
                    await self._learn_reads()
                return dataclasses.replace(report, pieces=how)
            followed = await self._follow(with_pieces, version, made)
            return dataclasses.replace(followed, pieces=how)
        finally:
            await asyncio.to_thread(self._finish_makes, with_pieces, made)

    async def _unfused(
        self, pairs: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor | ExpertPart]]:
        """A transformers-5 mixture's fused experts under the checkpoint's per-expert names
        (``asyncroll.experts``), as the coordinator's engines name them: it decides, and one
        broadcast tells the other ranks (only where fused names are given: every rank gives
        the same names). A sharded fused tensor becomes ``ExpertPart``s, gathered once when
        the first is packed; a whole one, views."""
        if not any(n.endswith(FUSED_EXPERTS) and _dims(t) == 3 for n, t in pairs):
            return list(pairs)
        plan: Unfusing | tuple[str, str] = Unfusing()
        if self._pusher is not None:
            try:
                plan = unfusing([n for n, _ in pairs], self._pusher.channel.checkpoint_names())
            except Exception as exc:  # (an unreadable checkpoint) the others must hear of it
                plan = ("failed", f"rank {self.rank}: the engines' checkpoint names: {exc}")
        plan = await self._broadcast(plan)
        if not isinstance(plan, Unfusing):  # the coordinator failed, or did not answer
            raise WeightSyncError(str(plan[1]))
        out: list[tuple[str, torch.Tensor | ExpertPart]] = []
        for name, tensor in pairs:
            fused = plan.blocks.get(name)
            if fused is None or _dims(tensor) != 3:
                out.append((plan.renames.get(name, name), tensor))
                continue
            which, block, projections = fused
            if not _is_dtensor(tensor):
                out += split_experts(block, which, tensor.detach(), projections)
                continue
            out += [
                (part, ExpertPart(fused=name, tensor=tensor.detach(), expert=e, rows=rows))
                for part, e, rows in expert_parts(block, which, tensor.shape, projections)
            ]
        return out

    def _piece_names(
        self, named: Mapping[str, torch.Tensor | ExpertPart]
    ) -> dict[str, Windows | None]:
        """(Coordinator.) The tensors every rank can push as a piece, as a worker's load plan
        says what it reads (worker ``i`` is served by rank ``i % world_size``), each with how:
        - None: each rank's own rows, with no exchange, where every worker reads only rows of
          the rank that serves it (a column-parallel shard: q, k, v, gate, up, the embedding);
        - per rank, the columns ``[first, end)`` its workers read of every row (a row-parallel
          shard: o, down; as ``column_blocks`` says): the ranks exchange those column blocks
          (``_column_block``: each rank receives only what its workers load) instead of
          gathering the whole tensor.
        Only tensors ``Shard(0)`` over all ranks, evenly."""
        reads = self._reads
        if not self._use_pieces or not reads or any(r is None for r in reads):
            return {}
        if self._piece_failures >= 2:  # it keeps failing: whole tensors from now on
            return {}
        world = self.world_size
        chosen: dict[str, Windows | None] = {}
        for name, tensor in named.items():
            if isinstance(tensor, ExpertPart):  # held whole by one rank: gathered
                continue
            if not (_is_dtensor(tensor) and _gathers_in_one_call(tensor)):
                continue
            if tensor.shape[0] % world:
                continue
            mesh = tensor.device_mesh  # type: ignore[attr-defined]
            if mesh.size() != world or mesh.get_local_rank() != self.rank:
                continue
            known = [read[name] for read in reads if read is not None and name in read]
            if len(known) != len(reads):
                continue  # a worker loads it with its batch, or not at all
            per_rank = tensor.numel() // world
            if all((w % world) * per_rank <= r[0] < r[1] <= (w % world + 1) * per_rank
                   for w, r in enumerate(known)):
                chosen[name] = None
                continue
            windows = None
            if tensor.dim() == 2 and _exchanges_columns(self._column_blocks, tensor, self._dtype):
                windows = _column_windows(known, world)
            if windows is not None:
                chosen[name] = windows
        return chosen

    def _own_rows(
        self,
        pushed: dict[str, torch.Tensor | LazyTensor],
        named: Mapping[str, torch.Tensor | ExpertPart],
    ) -> dict[str, torch.Tensor | LazyTensor | Piece]:
        """(``fan_in``.) This rank's push: its own rows of every sharded tensor, as a piece
        (cast to ``dtype`` as it is packed), and, on the coordinator, every other tensor."""
        out: dict[str, torch.Tensor | LazyTensor | Piece] = {}
        places: dict[Any, int] = {}
        for name, given in pushed.items():
            tensor = named[name]
            if isinstance(tensor, ExpertPart) or not _is_dtensor(tensor):
                if self.is_coordinator:
                    out[name] = given
                continue
            out[name] = self._own_piece(tensor, places)
        return out

    def _own_piece(self, tensor: torch.Tensor, places: dict[Any, int]) -> Piece:
        """This rank's rows of a ``Shard(0)`` tensor as a piece of it, cast to ``dtype`` as
        it is packed where they differ. ``places``: this rank's place in each mesh, kept
        across calls (a mesh answers in microseconds, thousands of pieces an update)."""
        rows: torch.Tensor = _local(tensor).contiguous()
        mesh = tensor.device_mesh  # type: ignore[attr-defined]
        place = places.get(mesh)
        if place is None:
            place = places[mesh] = mesh.get_local_rank()
        offset = place * rows.numel()
        target = self._dtype if self._dtype is not None and rows.is_floating_point() else None
        source: torch.Tensor | LazyTensor = rows
        if target is not None and target != rows.dtype:
            source = LazyTensor(shape=tuple(rows.shape), dtype=target, device=rows.device,
                                make=functools.partial(_identity, rows))
        return Piece(source, whole=tuple(tensor.shape), offset=offset)

    def _with_pieces(
        self,
        pushed: dict[str, torch.Tensor | LazyTensor],
        named: Mapping[str, torch.Tensor | ExpertPart],
        pieces: Mapping[str, Windows | None],
        made: set[str],
    ) -> dict[str, torch.Tensor | LazyTensor | Piece]:
        """``pushed``, with each of ``pieces`` as this rank's rows of it, or as the column
        block its workers read (exchanged when packed); cast to ``dtype`` as they are packed,
        if need be."""
        out: dict[str, torch.Tensor | LazyTensor | Piece] = dict(pushed)
        exchanges: dict[object, _Exchanges] = {}  # a group's, for this update
        places: dict[Any, int] = {}
        for name, windows in pieces.items():
            tensor = named[name]
            assert not isinstance(tensor, ExpertPart)  # (never chosen: ``_piece_names``)
            if windows is not None:
                group = tensor.device_mesh.get_group()  # type: ignore[attr-defined]
                block = _column_block(
                    tensor, windows, self.rank, self._dtype, name=name, made=made,
                    exchanges=exchanges.setdefault(group, _Exchanges(group)),
                )
                out[name] = Piece(block, whole=tuple(tensor.shape), offset=0,
                                  columns=windows[self.rank])
                continue
            out[name] = self._own_piece(tensor, places)
        return out

    async def _learn_reads(self) -> None:
        """(Coordinator, after a push.) What each worker's load reads of each tensor."""
        self._read_updates += 1
        try:
            reads: list[dict[str, tuple[int, ...]] | None] = []
            async with asyncio.timeout(self._timeout):
                for engine in self._live():
                    reads += await engine.weights.read_ranges()
        except Exception:
            logger.warning("could not learn what the workers read", exc_info=True)
            return
        self._reads = reads

    def _pushed(
        self, items: Sequence[tuple[str, torch.Tensor | ExpertPart]], made: set[str]
    ) -> tuple[dict[str, torch.Tensor | LazyTensor], dict[str, torch.Tensor]]:
        """Each tensor as pushed (a sharded one, or one cast to ``dtype``: made when its
        bucket is packed, its name then added to ``made``), and this rank's part of each
        (an expert part's: its fused tensor's shard, once, under the fused name)."""
        pushed: dict[str, torch.Tensor | LazyTensor] = {}
        local: dict[str, torch.Tensor] = {}
        batches: dict[object, Callable[[], AbstractContextManager[object]]] = {}
        gathers: dict[str, _FusedGather] = {}
        for name, tensor in items:
            if isinstance(tensor, ExpertPart):
                if name in pushed:
                    raise InvalidRequestError(f"tensor {name!r} is given twice")
                fused = gathers.setdefault(tensor.fused, _FusedGather(tensor.tensor))
                pushed[name] = fused.lazy(name, tensor, self._dtype, made)
                local.setdefault(tensor.fused, _local(tensor.tensor))
                continue
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequestError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
            if name in pushed:
                raise InvalidRequestError(f"tensor {name!r} is given twice")
            # A DTensor as it is: its detach() goes through DTensor's dispatch (10-15 us of
            # host time a call, thousands of tensors an update for a mixture); every use reads
            # it under no_grad or through its plain local tensor (``_local``). With the samples
            # taken together (``_shard_fingerprints``), a 30B-A3B's update call on two H200s
            # went from 9.9 to 2.6 s (docs/performance.md, "Two GPUs, session 44").
            sharded = _is_dtensor(tensor)
            pushed[name] = _lazily(name, tensor if sharded else tensor.detach(), self._dtype,
                                   made, batches)
            local[name] = _local(tensor)
        if not pushed:
            raise InvalidRequestError("no tensors to push")
        return pushed, local

    async def _problem(
        self,
        pushed: dict[str, torch.Tensor | LazyTensor],
        local: dict[str, torch.Tensor],
        steps: int | None,
    ) -> str | None:
        """What this rank finds wrong with the update (None: nothing): its parts are finite;
        the coordinator: its engines, and names, shapes and dtypes against the checkpoint."""
        try:
            if self._check_finite:
                floating = {n: t for n, t in local.items() if t.is_floating_point()}
                await asyncio.to_thread(
                    check_update, floating, None, served_dtype=torch.float32, check_finite=True
                )
            if self._pusher is not None:
                self._check_engines(steps)
                await self._pusher.channel.check(pushed)  # type: ignore[arg-type]
        except InvalidRequestError as exc:
            return f"rank {self.rank}: {exc}"
        return None

    def _check_engines(self, steps: int | None) -> None:
        live = [engine for engine in self._engines if not engine.is_dead]
        if not live:
            raise InvalidRequestError("no live engine to update")
        for engine in live:
            engine.check_weights_awake()
            current = engine.global_steps
            if steps is not None and current is not None and steps < current:
                raise InvalidRequestError(
                    f"global_steps {steps} is lower than {engine.name}'s {engine.global_steps}:"
                    " versions never go backwards"
                )

    def _needs_connect(self) -> bool:
        """This rank's sender must be opened again (every rank's is, then): the coordinator's
        engines changed, or this rank's push group broke (a peer failed it)."""
        if self.is_coordinator and not self._attached():
            return True
        return isinstance(self._sender, BroadcastSender) and self._sender.group.closed

    def _attached(self) -> bool:
        assert self._pusher is not None
        live = [engine for engine in self._engines if not engine.is_dead]
        return self._pusher.channel.is_attached(live)

    def _workers(self) -> list[int]:
        """Per rank, the engine workers it serves (the coordinator's count is the one used)."""
        counts = [0] * self.world_size
        for index in range(sum(e.weights.num_workers for e in self._engines if not e.is_dead)):
            counts[index % self.world_size] += 1
        return counts

    async def _connect(self, workers: list[int]) -> None:
        """Every rank opens a sender; the coordinator attaches each worker to its rank's.
        Every rank learns whether every rank's workers came. Every rank joins the same
        collectives whatever fails on it (a rank that skipped one would leave the others in
        it until the deadline, then mismatch the next)."""
        await self._close_sender()
        stack = contextlib.AsyncExitStack()
        status = "connected"
        try:
            if self._backend == "broadcast":
                await self._connect_groups(workers, stack)
            else:
                await self._connect_staged(workers, stack)
        except Exception as exc:
            await stack.aclose()
            status = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        except BaseException:
            await stack.aclose()
            raise
        failed = [s for s in await self._all_gather(status) if s != "connected"]
        if failed:
            await self._close_sender()
            if self._pusher is not None:  # (its channel may have adopted the new sender, or
                # kept the old one while the engines attached elsewhere: either way, the next
                # update must connect again, not push to receivers that are gone)
                await self._pusher.channel.aclose()
            raise WeightSyncError(f"the engines could not attach to every rank: {failed[0]}")

    async def _connect_staged(self, workers: list[int], stack: contextlib.AsyncExitStack) -> None:
        """Every rank's staged sender; the coordinator attaches each worker to its rank's."""
        try:
            sender = await stack.enter_async_context(
                open_weight_sender(
                    backend=self._make_backend(),
                    bucket_bytes=self._bucket_size(),
                    buffers=self._buffers,
                    receivers=workers[self.rank] or None,
                    connect_timeout=self._timeout,
                    ack_timeout=self._timeout,
                )
            )
        except Exception:
            await self._all_gather(None)  # (the others' configs: every rank gathers once)
            raise
        configs = await self._all_gather(sender.receiver_config())
        if any(config is None for config in configs):
            missing = [rank for rank, config in enumerate(configs) if config is None]
            raise WeightSyncError(f"ranks {missing} could not open their senders")
        waits = [sender.wait_receivers(workers[self.rank])] if workers[self.rank] else []
        if self._pusher is not None:
            await asyncio.gather(*waits, self._attach(configs))
            await self._pusher.channel.adopt(self._live(), sender, stack)
        else:
            await asyncio.gather(*waits)
            self._sender, self._stack = sender, stack

    async def _connect_groups(self, workers: list[int], stack: contextlib.AsyncExitStack) -> None:
        """(``backend="broadcast"``.) Every rank serving workers forms a push group with them,
        rank 0 of it; the coordinator has each worker join its rank's group (``_attach``)."""
        served = sum(workers) if self._fan_in else workers[self.rank]
        if not served:  # (no group here; the others' configs still gathered)
            await self._join_groups(None)
            return
        on_cuda = torch.cuda.is_available()
        joined = False

        async def join(config: dict[str, Any]) -> None:
            nonlocal joined
            joined = True
            await self._join_groups(config)

        try:
            sender = await stack.enter_async_context(
                open_broadcast_sender(
                    receivers=served,
                    device=torch.device("cuda", torch.cuda.current_device()) if on_cuda
                    else torch.device("cpu"),
                    join=join,
                    bucket_bytes=self._bucket_size(),
                    buffers=self._buffers,
                    peer_timeout=self._timeout,
                )
            )
        except Exception:
            if not joined:  # (failed before its group's config existed: gather ours as None)
                await self._join_groups(None)
            raise
        if self._pusher is not None:
            await self._pusher.channel.adopt(self._live(), sender, stack)
        else:
            self._sender, self._stack = sender, stack

    async def _join_groups(self, config: dict[str, Any] | None) -> None:
        """Every rank's push group config gathered; the coordinator attaches its engines'
        workers to them (each joins its own rank's group, all at once)."""
        configs = await self._all_gather(config)
        if self._pusher is not None:
            await self._attach([c or {} for c in configs])

    async def _close_sender(self) -> None:
        """Close this rank's sender; a failure is logged (the old sender's trouble must not
        keep this rank out of the collectives that open the next)."""
        stack, self._stack, self._sender = self._stack, None, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception:
                logger.warning("rank %d: closing the sender failed", self.rank, exc_info=True)

    async def _attach(self, configs: list[Any]) -> None:
        assert self._pusher is not None
        channel = self._pusher.channel
        live = self._live()
        common = {**configs[self.rank], **channel.worker_config(), "senders": configs}
        if self._backend == "broadcast":  # (the staged transport's fields, unused)
            common |= {"address": "", "nonce": "", "secret": "",
                       "timeout_ms": int(self._timeout * 1000), "fan_in": self._fan_in}
        offsets = itertools.accumulate((e.weights.num_workers for e in live), initial=0)
        await asyncio.gather(*(
            engine.weights.attach({**common, "rank_offset": offset}, owner=channel)
            for engine, offset in zip(live, offsets, strict=False)
        ))

    async def _coordinate(
        self,
        pushed: dict[str, torch.Tensor | LazyTensor | Piece],
        steps: int | None,
        mode: ResumeMode,
        *,
        pieces: bool = False,
    ) -> UpdateReport:
        """The update sequence here; then the outcome to every rank (``_PiecesFailed``'s
        kind where pieces were pushed and a worker could not load one: every rank retries)."""
        assert self._pusher is not None
        outcome: tuple[str, Any] = ("failed", "the coordinator's update was cancelled")
        try:
            report = await self._pusher.update(pushed, global_steps=steps, mode=mode)  # type: ignore[arg-type]
            outcome = ("ok", report)
            return report
        except WeightSyncError as exc:
            outcome = (type(exc).__name__, str(exc))
            if pieces and PieceNotPlannedError.__name__ in str(exc):
                outcome = (_PiecesFailed.__name__, str(exc))
                raise _PiecesFailed(str(exc)) from exc
            raise
        except Exception as exc:
            outcome = (type(exc).__name__, str(exc))
            raise
        finally:
            await shielded(self._broadcast(outcome))

    async def _follow(
        self, pushed: dict[str, torch.Tensor | LazyTensor | Piece], version: int, made: set[str]
    ) -> UpdateReport:
        """This rank's push, until the coordinator says how the update ended. A rank that
        serves no worker makes its part of the gathers meanwhile (the others' pushes wait on
        them)."""
        verdict = asyncio.ensure_future(self._broadcast(None))
        push: asyncio.Future[Any] | None = None
        if self._sender is None:
            push = asyncio.ensure_future(asyncio.to_thread(self._finish_makes, pushed, made))
        else:
            plain = {n: t for n, t in pushed.items() if isinstance(t, torch.Tensor)}
            prints = (self._fingerprinter(plain) | self._known) if self._verify else None
            complete = prints is not None and len(prints) == len(pushed)
            push = asyncio.ensure_future(
                self._sender.push(
                    pushed,
                    version=version,
                    fingerprints=prints,
                    fingerprint=self._lazy_fingerprinter if self._verify and not complete else None,
                )
            )
        try:
            kind, value = await verdict
        except BaseException:
            if push is not None:
                push.cancel()
                await asyncio.gather(push, return_exceptions=True)
            raise
        own = None
        if push is not None:
            if kind == "ok":  # every worker took it: our push has ended, or ends now
                try:
                    async with asyncio.timeout(self._timeout):
                        own = await push
                except Exception:
                    logger.warning("rank %d: the update landed, our push did not end", self.rank)
            elif self._sender is None:  # our gathers: ended before any other is made
                await asyncio.gather(push, return_exceptions=True)
            elif isinstance(self._sender, BroadcastSender):
                if kind == _UNANSWERED:  # a rank died: our group is of no more use
                    self._sender.group.close()
                else:  # its thread goes on: let it end (its receivers end the push with it)
                    await asyncio.gather(push, return_exceptions=True)
            push.cancel()  # (a failed update: stop now, and gather the rest below)
            await asyncio.gather(push, return_exceptions=True)
        if kind == "ok":
            assert isinstance(value, UpdateReport)
            return dataclasses.replace(value, push=own)
        if kind == InvalidRequestError.__name__:
            raise InvalidRequestError(value)
        if kind == _PiecesFailed.__name__:
            raise _PiecesFailed(value)
        raise WeightSyncError(value)

    def _finish_makes(
        self, pushed: Mapping[str, torch.Tensor | LazyTensor | Piece], made: set[str]
    ) -> None:
        """Make, in plan order, what this rank's push did not (it failed, or this rank
        serves no worker): the other ranks' collectives wait for ours."""
        rest: dict[str, torch.Tensor | LazyTensor] = {}
        for name, tensor in pushed.items():  # (a piece's own: a cast, or a column exchange)
            inner = tensor.tensor if isinstance(tensor, Piece) else tensor
            lazy = isinstance(inner, LazyTensor) and name not in made
            rest[name] = inner if lazy else torch.empty(0)
        if not any(isinstance(tensor, LazyTensor) for tensor in rest.values()):
            return
        sender = self._pusher.channel.sender if self._pusher is not None else self._sender
        if isinstance(sender, BroadcastSender) and not sender.group.closed:
            sender.idle(self._timeout)  # a failed push's thread, making its gathers
        metas = [  # the plan the push made (a piece travels as its own tensor)
            TensorMeta(
                name=n,
                dtype=t.dtype,
                shape=tuple((t.tensor if isinstance(t, Piece) else t).shape),
                part=t.part() if isinstance(t, Piece) else None,
            )
            for n, t in pushed.items()
        ]
        try:
            Makes(plan_buckets(metas, bucket_bytes=self._bucket_size()), rest).drain()
        except Exception:  # a rank is gone: its collectives fail, and so did the update
            logger.warning("rank %d: could not make the update's rest", self.rank, exc_info=True)

    async def _shard_fingerprints(
        self,
        pushed: Mapping[str, torch.Tensor | LazyTensor],
        named: Mapping[str, torch.Tensor | ExpertPart],
    ) -> dict[str, bytes]:
        """Fingerprints of the lazy tensors' full values without gathering them: each rank
        samples the positions its rows hold (``shard_samples``), and one all-reduce of the
        control group adds them up (each position is held by one rank)."""
        lazy = {n: t for n, t in pushed.items() if isinstance(t, LazyTensor)}
        if not lazy:
            return {}
        rank = self.rank

        def sample() -> tuple[list[str], torch.Tensor]:
            held: list[tuple[str, _HeldSamples]] = []
            meshes: dict[Any, tuple[int, int]] = {}
            for name, made in lazy.items():
                source = named[name]
                if isinstance(source, ExpertPart):
                    whole = source.samples(made.dtype)
                    found = None if whole is None else _HeldSamples(whole.numel(), 0, whole)
                else:
                    found = held_samples(source, rank=rank, meshes=meshes)
                if found is not None:  # None: another layout, fingerprinted as it is made
                    held.append((name, found))
            dtypes = [lazy[name].dtype for name, _ in held]
            return [name for name, _ in held], _sample_blob([h for _, h in held], dtypes)

        names, joined = await asyncio.to_thread(sample)

        def add_up() -> bytes:
            dist.all_reduce(joined, group=self._group)
            return bytes(joined.to(torch.uint8).numpy().tobytes())

        try:
            blob = await asyncio.to_thread(add_up)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"rank {self.rank}: the other ranks did not answer: {exc}"
            ) from exc
        prints, at = {}, 0
        for name in names:
            size = _sample_count(lazy[name].numel()) * lazy[name].dtype.itemsize
            prints[name] = blob[at : at + size]
            at += size
        return prints

    # -- plumbing --------------------------------------------------------------------------

    def _live(self) -> list[ReceivingEngine]:
        return [engine for engine in self._engines if not engine.is_dead]

    def _on_cuda(self) -> bool:
        auto = self._backend in ("auto", "broadcast") and torch.cuda.is_available()
        return self._backend == "cuda_ipc" or auto

    def _make_backend(self) -> CudaIpcBackend | ShmBackend:
        return CudaIpcBackend(torch.cuda.current_device()) if self._on_cuda() else ShmBackend()

    def _bucket_size(self) -> int:
        if self._backend == "broadcast":
            kind = "broadcast" if self._on_cuda() else "broadcast_cpu"
        else:
            kind = "cuda_ipc" if self._on_cuda() else "shm"
        return self._bucket_bytes or DEFAULT_BUCKET_BYTES[kind]

    async def _all_gather(self, value: Any) -> list[Any]:
        def gather() -> list[Any]:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, value, group=self._group)
            return out

        try:
            return await asyncio.to_thread(gather)
        except RuntimeError as exc:  # a rank died or hung: gloo says so
            raise WeightSyncError(
                f"rank {self.rank}: the other ranks did not answer: {exc}"
            ) from exc

    async def _broadcast(self, value: Any) -> Any:
        """The coordinator's ``value`` on every rank."""
        def broadcast() -> Any:
            box = [value]
            source = dist.get_global_rank(self._group, self._coordinator)
            dist.broadcast_object_list(box, src=source, group=self._group)
            return box[0]

        try:
            return await asyncio.to_thread(broadcast)
        except RuntimeError as exc:
            if self.is_coordinator:
                logger.warning("could not tell the other ranks the outcome: %s", exc)
                return value
            return (_UNANSWERED, f"rank {self.rank}: the coordinator did not answer: {exc}")


def _fan_in_refusal(named: Mapping[str, torch.Tensor | ExpertPart], world: int) -> str | None:
    """Why ``fan_in`` cannot push these tensors (None: it can): every sharded one must be
    ``Shard(0)`` over all ranks, its rows dividing evenly."""
    for name, tensor in named.items():
        if isinstance(tensor, ExpertPart):
            return f"fan_in=True pushes no fused experts sharded over the ranks ({name!r})"
        if not _is_dtensor(tensor):
            continue
        if not _gathers_in_one_call(tensor) or tensor.device_mesh.size() != world:  # type: ignore[attr-defined]
            return (f"fan_in=True needs every sharded tensor Shard(0) over all {world} ranks:"
                    f" {name!r} is {tensor.placements}")  # type: ignore[attr-defined]
        if tensor.shape[0] % world:
            return (f"fan_in=True needs rows that divide evenly: {name!r} has {tensor.shape[0]}"
                    f" rows over {world} ranks")
    return None


_UNANSWERED = "unanswered"
"""The outcome a follower takes for the coordinator's when the coordinator did not answer."""


def _lazily(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype | None,
    made: set[str],
    batches: dict[object, Callable[[], AbstractContextManager[object]]],
) -> torch.Tensor | LazyTensor:
    """A sharded tensor, gathered when packed (the gathers of a bucket in one call where they
    are all ``gather``'s one-call kind); a tensor of another floating dtype than
    ``dtype``, cast as it is packed; any other tensor as it is."""
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    sharded = _is_dtensor(tensor)
    if not sharded and target == tensor.dtype:
        return tensor
    device = _local(tensor).device
    batch = None
    if sharded and _gathers_in_one_call(tensor):
        mesh = tensor.device_mesh  # type: ignore[attr-defined]
        batch = batches.get(mesh)  # (a mesh's get_group() costs microseconds a call)
        if batch is None:
            batch = batches[mesh] = functools.partial(_coalescing, mesh.get_group())

    def make() -> torch.Tensor:
        made.add(name)
        with torch.no_grad():
            return gather(tensor) if sharded else tensor

    return LazyTensor(
        shape=tuple(tensor.shape), dtype=target, device=device, make=make, batch=batch
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpertPart:
    """One expert's projection (``rows`` of expert ``expert``) of a fused expert tensor
    sharded over the experts (FSDP2's ``Shard(0)``): the rank whose rows hold the expert holds
    it whole. Pushed as its own tensor under the checkpoint's name (``asyncroll.experts``)."""

    fused: str
    """The fused tensor's name (a transformers-5 ``mlp.experts.gate_up_proj``)."""
    tensor: torch.Tensor
    """The fused ``DTensor``."""
    expert: int
    rows: slice

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows.stop - self.rows.start, *self.tensor.shape[2:])

    def numel(self) -> int:
        return math.prod(self.shape)

    def held(self) -> torch.Tensor | None:
        """This rank's copy (a view of its shard), or None: another rank holds the expert
        (or the layout is not ``Shard(0)`` over one mesh dimension)."""
        if not _gathers_in_one_call(self.tensor):
            return None
        local = _local(self.tensor)
        mesh = self.tensor.device_mesh  # type: ignore[attr-defined]
        first = mesh.get_local_rank() * -(-self.tensor.shape[0] // mesh.size())
        if not first <= self.expert < first + local.shape[0]:
            return None
        return local[self.expert - first, self.rows]

    def samples(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``shard_samples`` of this part: the holder's, zeros on the other ranks; None for
        another layout (fingerprinted as it is made)."""
        if not _gathers_in_one_call(self.tensor):
            return None
        held = self.held()
        if held is None:
            return torch.zeros(_sample_count(self.numel()), dtype=dtype)
        return sampled(held).to(dtype).contiguous()  # (a strided view where no cast copies)


class _FusedGather:
    """The parts of one fused expert tensor: the first made gathers it whole, the others
    slice that, and the last made lets it go (every rank makes them in plan order)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._whole: torch.Tensor | None = None
        self._left = 0

    def lazy(
        self, name: str, part: ExpertPart, dtype: torch.dtype | None, made: set[str]
    ) -> LazyTensor:
        self._left += 1
        target = dtype if dtype is not None and part.tensor.is_floating_point() else None

        def make() -> torch.Tensor:
            made.add(name)
            if self._whole is None:
                with torch.no_grad():
                    self._whole = gather(self._tensor)
            out = self._whole[part.expert, part.rows]
            self._left -= 1
            if not self._left:
                self._whole = None
            return out

        return LazyTensor(shape=part.shape, dtype=target or part.tensor.dtype,
                          device=_local(part.tensor).device, make=make)


def _dims(tensor: torch.Tensor) -> int:
    return tensor.dim() if isinstance(tensor, torch.Tensor) else -1


Windows = list[tuple[int, int]]
"""Per trainer rank, the columns ``[first, end)`` of every row that the workers it serves
read of a row-parallel tensor."""


def _column_windows(reads: Sequence[tuple[int, ...]], world: int) -> Windows | None:
    """Per rank, the one column window every worker it serves reads (``reads[i]`` is worker
    ``i``'s read, ``(first, end, first column, end column)``); None unless every worker reads
    only columns, every rank serves a worker, and the workers of a rank read the same ones."""
    windows: list[tuple[int, int] | None] = [None] * world
    for worker, read in enumerate(reads):
        if len(read) != 4:
            return None
        window = (read[2], read[3])
        rank = worker % world
        if windows[rank] not in (None, window):
            return None
        windows[rank] = window
    if any(window is None for window in windows):
        return None
    return [window for window in windows if window is not None]


COLUMN_BLOCK_BYTES = 32 << 20
"""``column_blocks="auto"``: the row-parallel tensors exchanged as column blocks, by size. A
gather moves about ``world`` times the bytes a worker loads of the tensor (over the links, then
into the worker); an exchange moves one block, but costs ``2 (world - 1)`` sends and receives a
tensor where a bucket's gathers are one call. Measured on four H200s (32B: o 50 MiB, down 270
MiB, exchanged 1.77x faster; 1.5B and the 30B-A3B's experts, all under 32 MiB: gathered faster)."""


def _exchanges_columns(
    column_blocks: bool | str, tensor: torch.Tensor, dtype: torch.dtype | None = None
) -> bool:
    """Whether a row-parallel ``tensor`` moves as column blocks (``column_blocks``), by its
    bytes as pushed (a float32 master pushed as ``dtype=torch.bfloat16`` counts half)."""
    if column_blocks == "auto":
        pushed = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.numel() * pushed.itemsize >= COLUMN_BLOCK_BYTES
    return bool(column_blocks)


class _Exchanges:
    """The column exchanges of the tensors first packed in one bucket, as one batch of
    point-to-point sends and receives (``dist.batch_isend_irecv``: one NCCL group for the
    bucket, as its all-gathers are one call), run as the batch's context exits."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ops: list[dist.P2POp] = []
        self.batch = functools.partial(_exchanging, self)
        """The one factory of the batch's context (``LazyTensor.batch``, compared by
        identity)."""


@contextlib.contextmanager
def _exchanging(exchanges: _Exchanges) -> Iterator[None]:
    exchanges.ops = []
    try:
        yield
    finally:  # what was queued is issued, even where a make failed: the peers wait for it
        ops, exchanges.ops = exchanges.ops, []
        if ops:
            for request in dist.batch_isend_irecv(ops) or ():
                request.wait()


def _column_block(
    tensor: torch.Tensor,
    windows: Windows,
    rank: int,
    dtype: torch.dtype | None,
    *,
    name: str = "",
    made: set[str] | None = None,
    exchanges: _Exchanges | None = None,
) -> LazyTensor:
    """The columns ``windows[rank]`` of every row of ``tensor`` (a 2-D ``DTensor``,
    ``Shard(0)`` evenly over the ranks), made when packed, alone by one all-to-all: each rank sends
    every other rank its own rows' block of that rank's columns (cast to ``dtype`` first: a
    float32 master moves as bf16), and stacks the blocks it receives in rank order (the rows'
    order). Each rank moves only what its workers load. Once made, ``name`` is in ``made``
    (``_finish_makes`` makes what a failed push did not: every rank joins each exchange).

    With ``exchanges`` and windows of one width (tensor parallelism's), the block is made
    by sends and receives added to that batch instead (``_Exchanges``): each rank copies its
    own rows' block in place, sends each other rank that rank's columns of its rows, and
    receives its columns of their rows straight into the block; read only after the batch."""
    local = _local(tensor)
    group = tensor.device_mesh.get_group()  # type: ignore[attr-defined]
    first, end = windows[rank]
    target = dtype if dtype is not None and local.is_floating_point() else local.dtype
    widest = max(b - a for a, b in windows)

    world = len(windows)
    even = all(b - a == widest for a, b in windows)

    def exchanged() -> torch.Tensor:
        if made is not None:
            made.add(name)
        assert exchanges is not None
        rows = local.shape[0]
        with torch.no_grad():
            block = local.new_empty((world * rows, widest), dtype=target)
            for peer, (a, b) in enumerate(windows):
                if peer == rank:
                    block[rank * rows:(rank + 1) * rows].copy_(local[:, a:b])
                    continue
                send = local.new_empty((rows, widest), dtype=target)
                send.copy_(local[:, a:b])
                other = dist.get_global_rank(group, peer)
                exchanges.ops.append(dist.P2POp(dist.isend, send, other, group))
                exchanges.ops.append(
                    dist.P2POp(dist.irecv, block[peer * rows:(peer + 1) * rows], other, group)
                )
        return block

    if exchanges is not None and even and world > 1:
        return LazyTensor(shape=(tensor.shape[0], end - first), dtype=target,
                          device=local.device, make=exchanged, batch=exchanges.batch)

    def make() -> torch.Tensor:
        if made is not None:
            made.add(name)
        rows = local.shape[0]
        with torch.no_grad():  # blocks of one width (gloo's all-to-all takes no other)
            send = (local.new_empty if even else local.new_zeros)(
                (world, rows, widest), dtype=target)
            for peer, (a, b) in enumerate(windows):  # cast and gathered in one copy a peer
                send[peer, :, : b - a].copy_(local[:, a:b])
            # Peer j's block lands in rows [j * rows, (j + 1) * rows): the rows' own order,
            # so the block is made in place (no copy after the exchange).
            block = local.new_empty((world * rows, widest), dtype=target)
            dist.all_to_all_single(block, send.view(-1, widest), group=group)
            return block if end - first == widest else block[:, : end - first].contiguous()

    return LazyTensor(shape=(tensor.shape[0], end - first), dtype=target, device=local.device,
                      make=make)


class _PiecesFailed(WeightSyncError):
    """The coordinator's verdict: a worker could not load a piece; every rank pushes the
    update again, as whole tensors."""


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def shard_samples(tensor: torch.Tensor, dtype: torch.dtype, *, rank: int) -> torch.Tensor | None:
    """The samples of ``asyncroll.fingerprints`` (element ``i * (n // 64)`` of the full tensor,
    or all of a tensor of 64 or fewer) that this rank holds, as ``dtype``, zeros elsewhere;
    None for a layout other than whole tensors and ``Shard(0)`` rows. A whole (not sharded)
    tensor is sampled by rank 0 only, so that the ranks' samples add up to the fingerprint.
    (One tensor's; an update's are taken together: ``held_samples``, ``_sample_blob``.)"""
    held = held_samples(tensor, rank=rank)
    if held is None:
        return None
    samples = torch.zeros(held.count, dtype=dtype, device=_local(tensor).device)
    if held.view is not None:
        samples[held.first : held.first + held.view.numel()] = held.view.to(dtype)
    return samples


@dataclasses.dataclass(frozen=True, slots=True)
class _HeldSamples:
    """Of a tensor's ``count`` fingerprint samples, those this rank holds: samples
    ``first, first + 1, ...``, as ``view`` (a strided view of its rows: no copy; None: none)."""

    count: int
    first: int
    view: torch.Tensor | None


def held_samples(
    tensor: torch.Tensor, *, rank: int, meshes: dict[Any, tuple[int, int]] | None = None
) -> _HeldSamples | None:
    """The fingerprint samples of ``tensor`` that this rank holds (``shard_samples``), as a
    view: no device work, so an update's thousands of tensors cost one gather
    (``_sample_blob``), not several launches and a host sync each. None for a layout other
    than whole tensors and ``Shard(0)`` rows. ``meshes`` keeps each mesh's (size, this
    rank's place) for the next call (a mesh answers in microseconds, thousands of times)."""
    n = tensor.numel()
    count = _sample_count(n)
    step = n // SAMPLES if n > SAMPLES else 1
    if _is_dtensor(tensor):
        if not _gathers_in_one_call(tensor):
            return None
        if n == 0:
            return _HeldSamples(0, 0, None)
        local = _local(tensor).reshape(-1)
        rows, mesh = tensor.shape[0], tensor.device_mesh  # type: ignore[attr-defined]
        place = None if meshes is None else meshes.get(mesh)
        if place is None:
            place = (mesh.size(), mesh.get_local_rank())
            if meshes is not None:
                meshes[mesh] = place
        chunk = -(-rows // place[0])
        start = min(rows, place[1] * chunk) * (n // rows)
    elif rank == 0:
        local, start = tensor.detach().reshape(-1), 0
    else:
        return _HeldSamples(count, 0, None)
    first, end = held_window(n, start, local.numel())
    if end <= first:
        return _HeldSamples(count, 0, None)
    at = first * step - start
    return _HeldSamples(count, first, local[at : at + (end - first - 1) * step + 1 : step])


def held_window(n: int, start: int, held: int) -> tuple[int, int]:
    """Of the fingerprint samples of a tensor of ``n`` elements (sample ``i`` at position
    ``i * step``), ``[first, end)``: those at positions ``start`` to ``start + held`` (one
    rank's rows)."""
    count = _sample_count(n)
    step = n // SAMPLES if n > SAMPLES else 1
    return min(count, -(-start // step)), min(count, -(-(start + held) // step))


def _sample_blob(held: Sequence[_HeldSamples], dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """The bytes of each tensor's ``count`` samples as ``dtypes[i]``, in order, this rank's
    where it holds them and 0 elsewhere, widened to int32 (the ranks' blobs add up to the full
    tensors' samples: one all-reduce). One gather, cast and copy to the host per (device,
    dtype, dtype pushed); the rest on the host, vectorized."""
    sizes = np.array([h.count * d.itemsize for h, d in zip(held, dtypes, strict=True)],
                     dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else sizes
    blob = np.zeros(int(sizes.sum()), dtype=np.uint8)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, (h, dtype) in enumerate(zip(held, dtypes, strict=True)):
        if h.view is not None and h.view.numel():
            groups.setdefault((h.view.device, h.view.dtype, dtype), []).append(i)
    with torch.no_grad():
        for (_, _, dtype), members in groups.items():
            views = [v for v in (held[i].view for i in members) if v is not None]
            joined = torch.cat(views) if len(views) > 1 else views[0]
            data = joined.to(dtype).contiguous().cpu().view(torch.uint8).numpy()
            width = dtype.itemsize
            lengths = np.array([v.numel() * width for v in views], dtype=np.int64)
            to = starts[members] + np.array([held[i].first for i in members]) * width
            # data's bytes of member k go to blob[to[k] : to[k] + lengths[k]]
            begun = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            blob[np.repeat(to - begun, lengths) + np.arange(len(data))] = data
    return torch.from_numpy(blob).to(torch.int32)


def _sample_count(n: int) -> int:
    return min(n, SAMPLES)


def _gathers_in_one_call(tensor: torch.Tensor) -> bool:
    types = _dtensor_types()
    assert types is not None  # (called with DTensors only)
    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    return bool(
        mesh.ndim == 1
        and len(placements) == 1
        and isinstance(placements[0], types[1])  # (not ``== Shard(0)``: a new Shard a call)
        and placements[0].dim == 0
        and tensor.ndim
    )


@contextlib.contextmanager
def _coalescing(group: Any) -> Iterator[None]:
    """torch.distributed's coalescing of the all-gathers issued inside: one call of the
    backend for all of them (NCCL and gloo), as FSDP gathers its parameters."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(group):
        yield


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a ``DTensor``. Sharded on dim 0 over a 1-D mesh (FSDP2's layout):
    one ``all_gather_into_tensor`` into a new tensor, whose first rows are the full tensor
    (``DTensor.full_tensor()`` costs about 0.2 ms of Python a call, as long as the gather of a
    7B model's 339 tensors over NVLink takes; docs/performance.md); any other layout:
    ``full_tensor()``."""
    if not _gathers_in_one_call(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined,no-any-return]
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    world, rows = mesh.size(), tensor.shape[0]
    chunk = -(-rows // world)  # torch.chunk's split: ceil, the last ranks may hold fewer rows
    local = _local(tensor)
    if local.shape[0] != chunk or not local.is_contiguous():
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]].copy_(local)
        local = padded
    out = local.new_empty((world * chunk, *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=mesh.get_group())
    return out[:rows]


@functools.cache
def _dtensor_types() -> tuple[type, Any] | None:
    """(``DTensor``, ``Shard``), imported once (an import statement in a function costs a
    microsecond or more a call); None for a torch without them."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor, Shard


def _is_dtensor(tensor: torch.Tensor) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(tensor, types[0])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (detached: reading it records no autograd graph), or
    the tensor itself. Through ``_local_tensor``, as FSDP2 reads it: ``to_local()`` is an
    autograd function, 5-10 us of host time a call, thousands of calls an update."""
    if not _is_dtensor(tensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):  # pragma: no cover - another torch's DTensor
        local = tensor.to_local()  # type: ignore[attr-defined]
    return local.detach()


def _layout(pushed: Mapping[str, torch.Tensor | LazyTensor]) -> str:
    text = ";".join(f"{n}:{t.dtype}:{tuple(t.shape)}" for n, t in pushed.items())
    return hashlib.sha256(text.encode()).hexdigest()
