"""The compiled load plan against the loaders it replaces.

A model whose ``load_weights`` works the way vLLM's do (fused q/k/v and gate/up parameters
filled by ``narrow(...).copy_``, a tensor-parallel shard cut from the source, a cast, vocabulary
padding zeroed with ``fill_``, a loader that computes, a tied head it skips) loads every push
twice: once through ``LoadPlan`` from views of one staging buffer, and once through plain
``load_weights``. Both must end bitwise equal, every push; the plan must replay what it can map
and say why it does not map the rest. (On the GPU, ``bench/gpu_e2e.py --sections push`` checks
the same against vLLM's own Qwen2 loaders: vLLM's CPU build repacks its weights at start-up, so
loading in place into a running CPU engine is not possible.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncroll.errors import PieceNotPlannedError, WeightSyncError
from asyncroll.receive.assembly import Assembly
from asyncroll.receive.load_plan import LoadPlan
from asyncroll.transport import LazyTensor, Part, Piece, ShmBackend, WeightReceiver, wire
from asyncroll.transport.packing import FUSE_BYTES
from asyncroll.transport.sender import open_weight_sender
from asyncroll.vllm.engine import read_ranges_of

H, KV, INTER, VOCAB, PADDED = 16, 8, 24, 40, 48
TP_RANK, TP_SIZE = 1, 2


class VllmLike(torch.nn.Module):
    """Parameters laid out as vLLM lays them out, loaded by loaders written as vLLM's are."""

    def __init__(self, *, pad_vocab: bool = True, tied_check: bool = False) -> None:
        super().__init__()
        self.tied_check = tied_check
        g = torch.Generator().manual_seed(0)

        def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype), False)

        self.vocab_rows = PADDED if pad_vocab else VOCAB
        self.embed = param(self.vocab_rows, H)
        self.qkv_weight = param(H + 2 * KV, H)
        self.qkv_bias = param(H + 2 * KV)
        self.o_proj = param(H, H // TP_SIZE)  # row-parallel: this rank's half of the input dim
        self.gate_up = param(2 * INTER, H)
        self.norm = param(H, dtype=torch.float32)  # served in float32, pushed in bf16
        self.scaled = param(H)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = {
            "q_proj": (0, H),
            "k_proj": (H, KV),
            "v_proj": (H + KV, KV),
            "gate_proj": (0, INTER),
            "up_proj": (INTER, INTER),
        }
        loaded = set()
        weights = list(weights)
        names = {name for name, _ in weights}
        if self.tied_check and "lm_head.weight" in names and "embed_tokens.weight" not in names:
            # vLLM's AutoWeightsLoader: a skipped alias needs its canonical name in the call
            raise ValueError("'lm_head.weight' was skipped: tied to 'embed_tokens.weight'")
        for name, w in weights:
            part = name.split(".")[-2] if name.count(".") >= 1 else ""
            if name == "lm_head.weight":
                continue  # tied to the embedding
            if part in stacked:
                offset, rows = stacked[part]
                fused = self.gate_up if part in ("gate_proj", "up_proj") else (
                    self.qkv_bias if name.endswith("bias") else self.qkv_weight
                )
                fused.data.narrow(0, offset, rows).copy_(w)
            elif name == "embed_tokens.weight":
                self.embed[: w.shape[0]].data.copy_(w)
                self.embed[w.shape[0]:].data.fill_(0)
            elif name == "o_proj.weight":
                shard = w.shape[1] // TP_SIZE
                self.o_proj.data.copy_(w.narrow(1, TP_RANK * shard, shard))
            elif name == "norm.weight":
                self.norm.data.copy_(w)  # a casting copy
            elif name == "scaled.weight":
                self.scaled.data.copy_(w * 0.5)  # computed: cannot be replayed from bytes
            else:
                raise KeyError(name)
            loaded.add(name)
        return loaded


def pushed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "embed_tokens.weight": t(VOCAB, H),
        "self_attn.q_proj.weight": t(H, H),
        "self_attn.k_proj.weight": t(KV, H),
        "self_attn.v_proj.weight": t(KV, H),
        "self_attn.q_proj.bias": t(H),
        "self_attn.k_proj.bias": t(KV),
        "self_attn.v_proj.bias": t(KV),
        "o_proj.weight": t(H, H),
        "mlp.gate_proj.weight": t(INTER, H),
        "mlp.up_proj.weight": t(INTER, H),
        "norm.weight": t(H),
        "scaled.weight": t(H),
        "lm_head.weight": t(VOCAB, H),
    }


def staged(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Views of one flat buffer, as the receiver hands them over (alignment included)."""
    sizes = [(t.numel() * t.element_size() + 255) // 256 * 256 for t in tensors.values()]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    views, offset = [], 0
    for (name, tensor), size in zip(tensors.items(), sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        views.append((name, view))
        offset += size
    return views


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


class Twins:
    """Two identical models: one loads through a plan, the other through ``load_weights``."""

    def __init__(
        self, *, pad_vocab: bool = True, tied_check: bool = False, check_late: bool = False
    ) -> None:
        self.planned = VllmLike(pad_vocab=pad_vocab, tied_check=tied_check)
        self.plain = VllmLike(pad_vocab=pad_vocab, tied_check=tied_check)
        self.plan = LoadPlan(self.planned, self.planned.load_weights)
        self.check_late = check_late

    def push(self, tensors: dict[str, torch.Tensor]) -> None:
        """Push ``tensors`` into both; they must end bitwise equal."""
        self.plan.begin_push(check_late=self.check_late)
        self.plan.load(staged(tensors))
        self.plain.load_weights(tensors.items())
        assert_same(self.planned, self.plain)


def test_planned_pushes_equal_load_weights_bitwise_and_say_what_is_not_planned() -> None:
    twins = Twins()
    plan = twins.plan
    for step in range(4):
        tensors = pushed(step)
        twins.push(tensors)
        stats = plan.statistics()
        if step == 0:  # everything is learned through the loaders; the padding fill_ taints
            assert stats.learned == len(tensors) and stats.planned == 0  # the whole batch
        if step == 1:  # ... so the batch is learned again, one name at a time
            assert stats.learned == len(tensors) and stats.planned == 0
        if step >= 2:
            assert stats.planned == len(tensors) - 2 and stats.learned == 0
            assert stats.fallback == 2
            assert stats.copies == stats.planned - 1  # one copy a tensor; the tied head none
    why = plan.statistics().unplannable
    assert set(why) == {"embed_tokens.weight", "scaled.weight"}
    assert "fill_" in why["embed_tokens.weight"]
    assert "not pushed" in why["scaled.weight"]


def test_a_batch_without_unattributable_writes_is_planned_from_the_second_push() -> None:
    twins = Twins(pad_vocab=False)
    for step in range(3):
        twins.push(pushed(10 + step))
    stats = twins.plan.statistics()
    assert stats.planned == len(pushed(0)) - 1  # no padding: the embedding is planned too
    assert set(stats.unplannable) == {"scaled.weight"}


def test_a_name_the_model_skips_is_a_planned_no_op() -> None:
    """A tied ``lm_head.weight``: vLLM skips it (and checks the embedding came in the same
    call). Learned in one call with the embedding, it becomes a replay of nothing."""
    twins = Twins(pad_vocab=False, tied_check=True)
    names = [n for n in pushed(0) if n != "scaled.weight"]
    for step in range(3):
        twins.push({n: pushed(50 + step)[n] for n in names})
    stats = twins.plan.statistics()
    assert stats.planned == len(names) and stats.fallback == 0
    assert stats.copies == len(names) - 1  # the head copies nothing


@pytest.mark.parametrize("pad_vocab", [False, True])
def test_names_the_loader_checks_against_each_other_load_with_their_batch(
    pad_vocab: bool,
) -> None:
    """Where the plan would load a tied ``lm_head.weight`` apart from the embedding (here: the
    batch is learned one name at a time, as ``scaled.weight`` computes from a temporary),
    vLLM refuses it. Such a name then loads with its whole batch, and every push stays exact."""
    twins = Twins(pad_vocab=pad_vocab, tied_check=True)
    for step in range(4):
        twins.push(pushed(30 + step))
    stats = twins.plan.statistics()
    assert stats.fallback == len(pushed(0)) and stats.planned == 0  # one whole batch
    assert "with the rest of its batch" in stats.unplannable["lm_head.weight"]
    twins.push({k: v for k, v in pushed(40).items() if k.startswith("mlp.")})  # other batches
    assert twins.plan.statistics().planned == 2  # are still replayed


def test_partial_pushes_and_a_changed_dtype_stay_exact() -> None:
    twins = Twins(pad_vocab=False)
    twins.push(pushed(0))
    twins.push(pushed(1))
    chosen = ("k_proj.weight", "up_proj.weight")
    twins.push({k: v for k, v in pushed(7).items() if k.endswith(chosen)})
    assert twins.plan.statistics().planned == 2
    twins.push({"norm.weight": pushed(8)["norm.weight"].float()})  # a new dtype: learned anew
    assert twins.plan.statistics().learned == 1


def test_pushes_through_the_same_buffer_replay_remembered_copies_exactly() -> None:
    """A receiver hands over views of the same staging buffer every push: from the third push
    on, the plan replays the copies it remembered (no views or checks made again), and reads
    each push's bytes, not the first's. (``scaled.weight``, never planned, is left out: a
    batch is remembered only when the plan maps all of it.)"""
    twins = Twins(pad_vocab=False)

    def plannable(step: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in pushed(step).items() if k != "scaled.weight"}

    views = staged(plannable(0))
    for step in range(5):
        tensors = plannable(60 + step)
        for (_, view), tensor in zip(views, tensors.values(), strict=True):
            view.copy_(tensor)
        twins.plan.begin_push()
        twins.plan.load(views, sources_persist=True)
        twins.plain.load_weights(tensors.items())
        assert_same(twins.planned, twins.plain)
        stats = twins.plan.statistics()
        assert stats.remembered == (1 if step >= 2 else 0)  # learned, planned, remembered
        if step >= 1:
            assert stats.planned == len(tensors) and stats.fallback == 0
            # 11 copies in 2 calls: q, k, v from adjacent slots into qkv_weight coalesce, so do
            # gate and up; the norm's cast is a copy_ of its own; the rest go in one fused call.
            assert (stats.copies, stats.calls) == (11, 2)
    twins.plan.forget_sources()
    twins.plan.begin_push()
    twins.plan.load(views, sources_persist=True)
    assert twins.plan.statistics().remembered == 0
    for _ in range(3):  # sources that may not persist: never remembered
        twins.plan.begin_push()
        twins.plan.load(views)
        stats = twins.plan.statistics()
        assert stats.remembered == 0 and stats.planned == len(views)


@pytest.mark.parametrize("check_late", [False, True], ids=["checked-first", "checked-late"])
def test_a_moved_parameter_drops_the_plan_and_it_is_learned_again(check_late: bool) -> None:
    twins = Twins(pad_vocab=False, check_late=check_late)
    twins.push(pushed(0))
    twins.push(pushed(1))
    twins.planned.qkv_weight.data = twins.planned.qkv_weight.data.clone()  # a new address
    twins.push(pushed(5))
    stats = twins.plan.statistics()
    assert stats.invalidations == 1 and stats.planned == 0 and stats.learned > 0
    twins.push(pushed(6))
    assert twins.plan.statistics().learned == 0
    # A parameter object replaced (not only its data): seen too, and learned again.
    twins.planned.gate_up = torch.nn.Parameter(twins.planned.gate_up.detach().clone(), False)
    twins.push(pushed(7))
    stats = twins.plan.statistics()
    assert stats.invalidations == 2 and stats.planned == 0 and stats.learned > 0
    # Replaced behind torch's registration hooks: the owner no longer holds the old one.
    twins.push(pushed(8))
    new = torch.nn.Parameter(twins.planned.norm.detach().clone(), False)
    twins.planned._parameters["norm"] = new
    twins.push(pushed(9))
    stats = twins.plan.statistics()
    assert stats.invalidations == 3 and stats.planned == 0 and stats.learned > 0
    # The owner's whole table replaced behind the hooks (the old table still holds the old).
    twins.push(pushed(10))
    new = torch.nn.Parameter(twins.planned.norm.detach().clone(), False)
    twins.planned._parameters = {**twins.planned._parameters, "norm": new}
    twins.push(pushed(11))
    stats = twins.plan.statistics()
    assert stats.invalidations == 4 and stats.planned == 0 and stats.learned > 0


@pytest.mark.parametrize("place", [False, True], ids=["reassembled", "placed"])
async def test_the_plan_loads_through_the_transport_with_spanning_tensors(place: bool) -> None:
    """Through a real sender and receiver (shared memory), with buckets small enough that the
    embedding and the tied head span two of them. Reassembled in the receiver's scratch buffer
    and handed to the plan; or, with ``place=plan.destination``, from the second push on
    written piece by piece straight into the embedding (the skipped head: dropped)."""
    planned, plain = VllmLike(pad_vocab=False), VllmLike(pad_vocab=False)
    plan = LoadPlan(planned, planned.load_weights)
    spanning = {"embed_tokens.weight", "lm_head.weight"}
    handed: list[set[str]] = []
    reports = []

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        handed[-1].update(name for name, _ in batch)
        plan.load(batch)

    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=1024, receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="plan-test")
        connected = threading.Event()

        def serve(pushes: int) -> None:
            receiver.connect()
            connected.set()
            for _ in range(pushes):
                plan.begin_push()
                handed.append(set())
                reports.append(
                    receiver.receive(load, place=plan.destination if place else None)
                )

        worker = asyncio.create_task(asyncio.to_thread(serve, 3))
        try:
            for step in range(3):
                tensors = pushed(20 + step)
                report = await sender.push(tensors, version=step)
                assert report.buckets > 3
                plain.load_weights(tensors.items())
            await worker
        finally:
            plan.forget_sources()  # it remembers views of the receiver's buffers
            await asyncio.to_thread(receiver.close)
    assert_same(planned, plain)
    assert plan.statistics().planned == len(pushed(0)) - 1
    assert [r.tensors for r in reports] == [len(pushed(0))] * 3
    assert spanning <= handed[0]  # learned through load_weights on the first push
    for names in handed[1:]:
        assert bool(spanning & names) is not place


async def test_a_bad_destination_fails_the_push_naming_the_tensor() -> None:
    """``place`` answering with the wrong size: the push fails naming the tensor, on both
    sides, and the receiver serves the next push."""
    got: dict[str, torch.Tensor] = {}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        got.update((name, t.clone()) for name, t in batch)

    def place(name: str, dtype: torch.dtype, shape: tuple[int, ...], part: object) -> torch.Tensor:
        return torch.empty(7, dtype=torch.uint8)

    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=1024, receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="bad-place")

        def serve() -> list[str]:
            receiver.connect()
            outcomes = []
            for where in (place, None):
                try:
                    receiver.receive(load, place=where)
                    outcomes.append("ok")
                except WeightSyncError as exc:
                    outcomes.append(str(exc))
            return outcomes

        worker = asyncio.create_task(asyncio.to_thread(serve))
        try:
            with pytest.raises(WeightSyncError, match=r"embed_tokens\.weight"):
                await sender.push(pushed(0), version=1)
            await sender.push(pushed(1), version=2)
            outcomes = await worker
        finally:
            await asyncio.to_thread(receiver.close)
    assert "embed_tokens.weight" in outcomes[0] and "expected uint8 (1280,)" in outcomes[0]
    assert outcomes[1] == "ok"
    for name, tensor in pushed(1).items():
        assert torch.equal(got[name], tensor), name


def test_only_a_whole_contiguous_copy_has_a_destination() -> None:
    """``destination``: the embedding (one copy into a contiguous parameter range) has one;
    a tied head the model skips has an empty one; the padded embedding (its loader also zeroes
    the padding), a sharded or casting copy, an unknown name or a changed dtype have none."""
    twins = Twins(pad_vocab=False)
    twins.push(pushed(0))
    twins.push(pushed(1))
    plan, model = twins.plan, twins.planned
    embed = plan.destination("embed_tokens.weight", torch.bfloat16, (VOCAB, H))
    assert embed is not None and embed.dtype == torch.uint8
    assert embed.data_ptr() == model.embed.data_ptr() and embed.numel() == VOCAB * H * 2
    head = plan.destination("lm_head.weight", torch.bfloat16, (VOCAB, H))
    assert head is not None and head.numel() == 0
    assert plan.destination("self_attn.q_proj.weight", torch.bfloat16, (H, H)) is not None
    for name, dtype, shape in [
        ("o_proj.weight", torch.bfloat16, (H, H)),  # a shard: strided source
        ("norm.weight", torch.bfloat16, (H,)),  # a casting copy
        ("scaled.weight", torch.bfloat16, (H,)),  # computed
        ("no.such.weight", torch.bfloat16, (H,)),
        ("embed_tokens.weight", torch.float32, (VOCAB, H)),
        ("embed_tokens.weight", torch.bfloat16, (VOCAB - 1, H)),
    ]:
        assert plan.destination(name, dtype, shape) is None, name
    padded = Twins(pad_vocab=True)
    for seed in range(3):
        padded.push(pushed(seed))
    assert padded.plan.destination("embed_tokens.weight", torch.bfloat16, (VOCAB, H)) is None


@pytest.mark.parametrize("name", ["scaled.weight"])
def test_a_loader_error_while_learning_propagates(name: str) -> None:
    model = VllmLike()
    plan = LoadPlan(model, model.load_weights)
    plan.begin_push()
    with pytest.raises(KeyError):
        plan.load([("no.such.weight", torch.zeros(2))])
    plan.load(staged({name: pushed(0)[name]}))  # the plan is still usable


def test_the_worker_receives_outside_the_device_mode_and_loads_under_it() -> None:
    """vLLM 0.24 calls ``receive_weights`` under ``torch.device``, a mode that slows every
    tensor op of the receive path: the worker pops it for the receive and puts it back for the
    model's loaders, and leaves the stack as it found it, also when the receive raises."""
    from asyncroll.vllm.worker import _outside_device_context

    depth = torch._C._len_torch_function_stack()
    with torch.device("meta"):
        with pytest.raises(RuntimeError, match="boom"), _outside_device_context() as restored:
            assert torch._C._len_torch_function_stack() == depth
            assert torch.empty(1).device.type == "cpu"
            with restored():
                assert torch.empty(1).device.type == "meta"
            assert torch.empty(1).device.type == "cpu"
            raise RuntimeError("boom")
        assert torch.empty(1).device.type == "meta"
    assert torch._C._len_torch_function_stack() == depth


class TensorParallelLike(torch.nn.Module):
    """Worker ``rank`` of ``size``: column-parallel q/k/v (fused) and embedding rows cut from
    the pushed tensor as vLLM's loaders cut them, a row-parallel projection (a column slice),
    and a replicated norm."""

    def __init__(self, rank: int, size: int = 2) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        g = torch.Generator().manual_seed(rank)

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16), False)

        self.qkv = param((H + 2 * KV) // size, H)
        self.embed = param(VOCAB // size, H)
        self.o_proj = param(H, H // size)
        self.norm = param(H)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rows = {"q_proj": (0, H), "k_proj": (H, KV), "v_proj": (H + KV, KV)}
        loaded = set()
        for name, w in weights:
            part = name.split(".")[-2]
            if part in rows:
                start, count = rows[part]
                shard = count // self.size
                self.qkv.data.narrow(0, start // self.size, shard).copy_(
                    w.narrow(0, self.rank * shard, shard)
                )
            elif name == "embed_tokens.weight":
                shard = VOCAB // self.size
                self.embed.data.copy_(w.narrow(0, self.rank * shard, shard))
            elif name == "o_proj.weight":
                shard = H // self.size
                self.o_proj.data.copy_(w.narrow(1, self.rank * shard, shard))
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            loaded.add(name)
        return loaded


def tensor_parallel_push(seed: int) -> dict[str, torch.Tensor]:
    names = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "embed_tokens.weight", "o_proj.weight", "norm.weight")
    return {name: pushed(seed)[name] for name in names}


def rows_of(tensor: torch.Tensor, rank: int, size: int = 2) -> tuple[torch.Tensor, Part]:
    """Rank ``rank``'s ``Shard(0)`` rows of ``tensor``, and where they sit."""
    rows = tensor.shape[0] // size
    piece = tensor[rank * rows : (rank + 1) * rows].contiguous()
    return piece, Part(whole=tuple(tensor.shape), offset=rank * piece.numel())


def columns_of(tensor: torch.Tensor, rank: int, size: int = 2) -> tuple[torch.Tensor, Part]:
    """Worker ``rank``'s columns of ``tensor`` (a row-parallel shard), every row: what a column
    block exchange hands the rank serving it, and where it sits."""
    width = tensor.shape[1] // size
    piece = tensor[:, rank * width : (rank + 1) * width].contiguous()
    return piece, Part(whole=tuple(tensor.shape), offset=0,
                       columns=(rank * width, (rank + 1) * width))


def piece_of(name: str, tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, Part]:
    return columns_of(tensor, rank) if name == "o_proj.weight" else rows_of(tensor, rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_loads_pieces_of_its_own_rows_exactly(rank: int) -> None:
    """Once a whole push taught the plan, ``read_ranges`` says which elements each name's load
    reads (its tensor-parallel rows; a row-parallel shard's columns; all of a replicated
    tensor), and pushing only those rows, or columns of every row, as pieces loads bitwise what
    the whole tensors load."""
    planned, plain = TensorParallelLike(rank), TensorParallelLike(rank)
    plan = LoadPlan(planned, planned.load_weights)
    plan.begin_push()
    plan.load(staged(tensor_parallel_push(0)))
    ranges = plan.read_ranges()
    q_rows = H // 2 * H
    assert ranges["self_attn.q_proj.weight"] == (rank * q_rows, (rank + 1) * q_rows)
    assert ranges["embed_tokens.weight"] == (rank * VOCAB // 2 * H, (rank + 1) * VOCAB // 2 * H)
    first, end, *columns = ranges["o_proj.weight"]  # a column slice reads across every row
    assert end - first > H * H // 2 and columns == [rank * H // 2, (rank + 1) * H // 2]
    assert ranges["norm.weight"] == (0, H)
    # A column block is the worker's whole o_proj shard: it lands there byte for byte.
    # What the engine's port hands on from the workers' RPC (msgpack: lists): the same.
    assert read_ranges_of({n: list(r) for n, r in ranges.items()}) == ranges
    o_proj = tensor_parallel_push(0)["o_proj.weight"]
    _, part = columns_of(o_proj, rank)
    landing = plan.destination("o_proj.weight", o_proj.dtype, (H, H // 2), part)
    assert landing is not None and landing.data_ptr() == planned.o_proj.data_ptr()
    assert landing.numel() == planned.o_proj.numel() * o_proj.element_size()  # (bytes)

    for seed in (1, 2):
        tensors = tensor_parallel_push(seed)
        local = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "embed_tokens.weight",
                 "o_proj.weight"}
        batch, parts = [], {}
        for name, tensor in staged(tensors):
            if name in local:
                tensor, parts[name] = piece_of(name, tensor, rank)
            batch.append((name, tensor))
        plan.begin_push()
        plan.load(batch, parts=parts)
        plain.load_weights(tensors.items())
        assert_same(planned, plain)
    assert plan.statistics().planned == len(tensors) and plan.statistics().learned == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_each_piece_a_fan_in_worker_gets_is_loaded_skipped_or_put_together(rank: int) -> None:
    """``fan_in``: every rank's rows of every tensor reach every worker. A tensor-parallel
    worker loads its own rank's rows where the plan says, needs none of the other rank's (its
    rows are one rank's), and puts together what it reads across ranks: all of a replicated
    norm, the columns of every row of a row-parallel shard. Unknown names are put together."""
    model = TensorParallelLike(rank)
    plan = LoadPlan(model, model.load_weights)
    plan.begin_push()
    plan.load(staged(tensor_parallel_push(0)))
    tensors = tensor_parallel_push(1)
    other = 1 - rank
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "embed_tokens.weight"):
        assert plan.piece_route(name, *rows_of(tensors[name], rank)) == "load"
        assert plan.piece_route(name, *rows_of(tensors[name], other)) == "skip"
    for name in ("norm.weight", "o_proj.weight"):
        for sender in (0, 1):
            assert plan.piece_route(name, *rows_of(tensors[name], sender)) == "assemble"
    assert plan.piece_route("lm_head.weight", *rows_of(tensors["embed_tokens.weight"], 0)) == (
        "assemble")  # not learned
    piece, part = rows_of(tensors["embed_tokens.weight"], other)
    half = piece.numel() // 2  # off the grid of equal pieces: never skipped
    assert plan.piece_route("embed_tokens.weight", piece[: piece.shape[0] // 2].contiguous(),
                            Part(whole=part.whole, offset=part.offset + half)) == "assemble"


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("rank", [0, 1])
def test_fan_in_pieces_arriving_in_any_buckets_load_every_tensor_once(
    rank: int, first: int
) -> None:
    """The 7B split run's failure (two H200s, session 43): a TP=2 worker fed by both ranks
    got its own rank's rows of ``lm_head`` alone in a bucket (loaded by the plan) and the other
    rank's rows in a bucket the plan could not load (put together, never completed: "pieces of
    lm_head.weight arrived, not all of them"). Each piece is routed by what it holds, so every
    tensor loads once, bitwise as the whole tensors load, in either order of the groups."""
    planned, plain = TensorParallelLike(rank), TensorParallelLike(rank)
    plan = LoadPlan(planned, planned.load_weights)
    plan.begin_push()
    plan.load(staged(tensor_parallel_push(0)))
    tensors = tensor_parallel_push(1)
    embed = "embed_tokens.weight"
    buckets = []
    for sender in (first, 1 - first):  # each rank's push group: its rows, the embedding alone
        rows = {name: rows_of(tensor, sender) for name, tensor in tensors.items()}
        buckets.append([(name, rows[name]) for name in tensors if name != embed])
        buckets.append([(embed, rows[embed])])
    assembly = Assembly()
    plan.begin_push()
    skipped = []
    for bucket in buckets:
        taken = assembly.take([(name, piece) for name, (piece, _) in bucket],
                              {name: part for name, (_, part) in bucket}, route=plan.piece_route)
        skipped += [name for name, _, _ in taken.skipped]
        if taken.batch:
            plan.load(taken.batch, parts=taken.parts)
    assert assembly.incomplete == []
    assert sorted(skipped) == sorted(["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", embed])
    plain.load_weights(tensors.items())
    assert_same(planned, plain)


def test_a_piece_the_plan_cannot_load_is_refused_before_anything_loads() -> None:
    """A piece of a name the plan has not learned, or that does not hold every element the
    name's load reads (the other rank's rows), raises ``PieceNotPlannedError`` (a
    ``WeightSyncError``) naming it, and nothing of its batch is loaded."""
    model = TensorParallelLike(1)
    plan = LoadPlan(model, model.load_weights)
    tensors = tensor_parallel_push(0)
    q = "self_attn.q_proj.weight"
    piece, part = rows_of(tensors[q], 1)
    before = [p.detach().clone() for p in model.parameters()]
    plan.begin_push()
    with pytest.raises(PieceNotPlannedError, match="has not learned it"):
        plan.load([("norm.weight", tensors["norm.weight"]), (q, piece)], parts={q: part})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    plan.load(staged(tensors))
    wrong, wrong_part = rows_of(tensors[q], 0)  # rank 0's rows: not what worker 1 reads
    with pytest.raises(PieceNotPlannedError, match=r"reads elements \[128, 256\)"):
        plan.load([(q, wrong)], parts={q: wrong_part})
    o = "o_proj.weight"
    wrong, wrong_part = columns_of(tensors[o], 0)  # rank 0's columns
    with pytest.raises(PieceNotPlannedError, match=r"the piece holds columns \[0, 8\]"):
        plan.load([(o, wrong)], parts={o: wrong_part})
    assert issubclass(PieceNotPlannedError, WeightSyncError)


@pytest.mark.parametrize("place", [False, True], ids=["reassembled", "placed"])
async def test_pieces_travel_through_the_transport_and_load_exactly(place: bool) -> None:
    """A real sender and receiver (shared memory): the sender pushes some tensors as pieces
    (``Piece``), buckets small enough that the embedding's rows span two; the receiver hands
    each piece over with its ``Part`` (or, with ``place``, writes the spanning rows straight
    into the embedding shard), and the plan loads them exactly as whole tensors."""
    rank = 1
    planned, plain = TensorParallelLike(rank), TensorParallelLike(rank)
    plan = LoadPlan(planned, planned.load_weights)
    local = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "embed_tokens.weight",
             "o_proj.weight"}
    handed: list[dict[str, Part]] = []

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        handed[-1].update(getattr(batch, "parts", {}))
        plan.load(batch)

    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=512, receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="pieces")

        def serve(pushes: int) -> None:
            receiver.connect()
            for _ in range(pushes):
                plan.begin_push()
                handed.append({})
                receiver.receive(load, place=plan.destination if place else None)

        worker = asyncio.create_task(asyncio.to_thread(serve, 3))
        try:
            for step in range(3):
                tensors = tensor_parallel_push(10 + step)
                given: dict[str, torch.Tensor | Piece] = dict(tensors)
                if step:  # the first push teaches the plan
                    for name in local:
                        rows, part = piece_of(name, tensors[name], rank)
                        given[name] = Piece(rows, whole=part.whole, offset=part.offset,
                                            columns=part.columns)
                report = await sender.push(given, version=step)
                plain.load_weights(tensors.items())
                whole = sum(t.numel() * t.element_size() for t in tensors.values())
                assert (report.bytes < whole) is bool(step)
            await worker
        finally:
            plan.forget_sources()
            await asyncio.to_thread(receiver.close)
    assert_same(planned, plain)
    assert handed[0] == {}
    for parts in handed[1:]:  # placed: spanning pieces went straight into their parameters
        assert set(parts) < local if place else set(parts) == local
        for name, part in parts.items():
            assert part == piece_of(name, tensor_parallel_push(0)[name], rank)[1]
    assert plan.statistics().learned == 0 and plan.statistics().fallback == 0


async def test_a_bad_piece_is_refused_by_the_sender() -> None:
    """A piece that does not fit its whole tensor, or is not contiguous: ``ValueError`` before
    anything is sent; the sender pushes the next update."""
    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=1024, receivers=0) as sender:
        with pytest.raises(ValueError, match="does not fit"):
            await sender.push({"w": Piece(torch.ones(4), whole=(4,), offset=1)}, version=1)
        with pytest.raises(ValueError, match="contiguous"):
            await sender.push({"w": Piece(torch.ones(4, 2).t(), whole=(16,), offset=0)}, version=1)
        with pytest.raises(ValueError, match=r"columns \[2, 6\) .* do not fit"):  # 4 columns
            await sender.push({"w": Piece(torch.ones(3, 4), whole=(3, 4), offset=0,
                                          columns=(2, 6))}, version=1)
        with pytest.raises(ValueError, match=r"columns \[0, 2\) .* at -4 do not fit"):
            await sender.push({"w": Piece(torch.ones(2, 2), whole=(3, 4), offset=-4,
                                          columns=(0, 2))}, version=1)
        with pytest.raises(ValueError, match="4 rows at 0 do not fit"):
            await sender.push({"w": Piece(torch.ones(4, 2), whole=(3, 4), offset=0,
                                          columns=(0, 2))}, version=1)
        with pytest.raises(ValueError, match="one_copy"):
            await sender.push({"w": Piece(torch.ones(4), whole=(8,), offset=0)}, version=1,
                              one_copy=True)


async def test_a_piece_made_lazily_in_another_dtype_arrives_cast_with_its_part() -> None:
    """A rank's float32 rows pushed as a bf16 piece (a ``LazyTensor`` made at packing, cast
    into the staging buffer): the receiver gets the bf16 rows, bitwise, with their ``Part``."""
    whole = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    rows = whole[4:].contiguous()
    made: list[int] = []

    def make() -> torch.Tensor:
        made.append(1)
        return rows

    lazy = LazyTensor(shape=(4, 4), dtype=torch.bfloat16, device=rows.device, make=make)
    got: dict[str, tuple[torch.Tensor, Part | None]] = {}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        parts = getattr(batch, "parts", {})
        got.update((name, (t.clone(), parts.get(name))) for name, t in batch)

    async with open_weight_sender(backend=ShmBackend(), bucket_bytes=1024, receivers=1) as sender:
        receiver = WeightReceiver.from_config(sender.receiver_config(), name="cast-piece")

        def serve() -> None:
            receiver.connect()
            receiver.receive(load)

        worker = asyncio.create_task(asyncio.to_thread(serve))
        try:
            report = await sender.push(
                {"w": Piece(lazy, whole=(8, 4), offset=16), "b": torch.ones(3)}, version=1
            )
            await worker
        finally:
            await asyncio.to_thread(receiver.close)
    tensor, part = got["w"]
    assert made == [1] and report.bytes == 4 * 4 * 2 + 3 * 4
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, rows.to(torch.bfloat16))
    assert part == Part(whole=(8, 4), offset=16) and got["b"][1] is None


def test_pieces_beside_a_name_that_loads_only_with_its_batch_are_refused() -> None:
    """A batch whose names include one that loads only with its whole batch (a tied head,
    checked against the embedding by the loader) goes through ``load_weights``, which would
    take a piece for the whole tensor: a piece in such a batch is refused instead."""
    twins = Twins(pad_vocab=False, tied_check=True)
    for step in range(4):
        twins.push(pushed(30 + step))
    assert "with the rest of its batch" in twins.plan.statistics().unplannable["lm_head.weight"]
    tensors = pushed(50)
    q = "self_attn.q_proj.weight"
    rows = tensors[q][H // 2 :].contiguous()
    batch = [(q, rows), *((n, tensors[n]) for n in ("embed_tokens.weight", "lm_head.weight"))]
    before = [p.detach().clone() for p in twins.planned.parameters()]
    with pytest.raises(PieceNotPlannedError, match="loads only with its whole batch"):
        twins.plan.load(batch, parts={q: Part(whole=(H, H), offset=H // 2 * H)})
    assert all(torch.equal(a, b) for a, b in zip(before, twins.planned.parameters(), strict=True))

    # A piece the plan loads (here all of q's rows, as a piece) beside those names: refused
    # together too, and ``load_apart`` (a fan_in worker's way out) loads the piece through the
    # plan and the whole tensors with their batch, as the whole tensors load.
    whole_piece = {q: Part(whole=(H, H), offset=0)}
    assert twins.plan.piece_route(q, tensors[q], whole_piece[q]) == "load"
    batch = [(q, tensors[q]), *((n, tensors[n]) for n in ("embed_tokens.weight", "lm_head.weight"))]
    with pytest.raises(PieceNotPlannedError, match="loads only with its whole batch"):
        twins.plan.load(batch, parts=whole_piece)
    twins.plan.load_apart(batch, parts=whole_piece)
    twins.plain.load_weights(batch)
    assert_same(twins.planned, twins.plain)


class _Aliased(torch.nn.Module):
    """A loader that writes ``a`` over the first rows and ``b`` over all of them: loaded in
    that order, ``b`` wins everywhere."""

    ROWS = 2 * FUSE_BYTES // 16  # float32 x 4: ``b`` is too big to fuse, ``a`` is small

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(self.ROWS, 4), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            (self.weight.data[:4] if name == "a" else self.weight.data).copy_(w)
        return {name for name, _ in weights}


def test_remembered_copies_into_overlapping_destinations_keep_their_order() -> None:
    """Replayed copies put the small ones last only where destinations are disjoint: here the
    small ``a`` lies inside the big ``b``, and every push, replayed or not, ends as the model's
    loader leaves it (``b`` over ``a``), not with ``a`` copied last."""
    planned, plain = _Aliased(), _Aliased()
    plan = LoadPlan(planned, planned.load_weights)
    views = [("a", torch.zeros(4, 4)), ("b", torch.zeros(_Aliased.ROWS, 4))]
    for step in range(4):
        for i, (_, view) in enumerate(views):
            view.fill_(float(10 * step + i + 1))
        plan.begin_push()
        plan.load(views, sources_persist=True)
        plain.load_weights([(n, v.clone()) for n, v in views])
        assert torch.equal(planned.weight, plain.weight), step
        assert planned.weight[0, 0].item() == 10 * step + 2
    assert plan.statistics().remembered == 1


class _Halves(torch.nn.Module):
    """A loader that writes ``a`` and ``b`` into the two halves of one parameter."""

    HALF = FUSE_BYTES // 4 + 1  # float32: each copy too big to fuse

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2 * self.HALF), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            self.weight.data.narrow(0, 0 if name == "a" else self.HALF, self.HALF).copy_(w)
        return {name for name, _ in weights}


def test_copies_into_one_parameter_from_adjacent_slots_coalesce_into_one_call() -> None:
    """``a`` and ``b`` from end-to-end slots into the two halves of one parameter (as ``q, k,
    v`` into ``qkv_proj``): planned, the two copies are one call, and the bytes are exact."""
    planned, plain = _Halves(), _Halves()
    plan = LoadPlan(planned, planned.load_weights)
    buffer = torch.zeros(2 * _Halves.HALF)
    views = [("a", buffer[: _Halves.HALF]), ("b", buffer[_Halves.HALF :])]
    for step in range(3):
        buffer.copy_(torch.randn(buffer.shape))
        plan.begin_push()
        plan.load(views, sources_persist=True)
        plan.end_push()
        plain.load_weights(views)
        assert torch.equal(planned.weight, plain.weight)
        if step:
            assert (plan.statistics().copies, plan.statistics().calls) == (2, 1)


def test_a_push_lets_go_of_remembered_sources_it_did_not_use() -> None:
    """Copies remembered from one push and not used by the next are dropped at its end, so
    a buffer (a one-copy push's trainer storage) the sender stopped listing is let go."""
    import gc
    import weakref

    model = _Halves()
    plan = LoadPlan(model, model.load_weights)
    old = torch.randn(2 * _Halves.HALF)
    gone = weakref.ref(old)
    for _ in range(3):  # learned, planned, replayed
        plan.begin_push()
        plan.load([("a", old[: _Halves.HALF]), ("b", old[_Halves.HALF :])], sources_persist=True)
        plan.end_push()
    assert plan.statistics().remembered == 1
    new = torch.randn(2 * _Halves.HALF)  # the next push reads other storage
    plan.begin_push()
    plan.load([("a", new[: _Halves.HALF]), ("b", new[_Halves.HALF :])], sources_persist=True)
    plan.end_push()
    del old
    gc.collect()
    assert gone() is None


class _MappedStorages:
    """A receiver's backend for ``_load_shared`` on the CPU: a descriptor names a buffer."""

    def __init__(self, buffers: dict[bytes, torch.Tensor]) -> None:
        self.buffers, self.opened, self.closed = buffers, [], []

    def open(self, descriptor: bytes, *, nbytes: int) -> Any:
        self.opened.append(descriptor)
        return SimpleNamespace(tensor=self.buffers[descriptor],
                               close=lambda: self.closed.append(descriptor))

    def finish_loads(self) -> None:
        pass


def _shared_message(views: list[tuple[str, torch.Tensor]], buffer: torch.Tensor,
                    descriptor: bytes = b"trainer", ident: int = 1, layout: int = 0,
                    repeat: bool = False) -> wire.Shared:
    if repeat:  # the list of id ``layout``, by its id alone
        return wire.Shared(conn=b"c", seq=1, push=1, version=1, storages=[], entries=[],
                           layout=layout, repeat=True)
    base = buffer.data_ptr()
    entries = [wire.SharedEntry(name=name, dtype=str(t.dtype).removeprefix("torch."),
                                shape=list(t.shape), storage=ident,
                                offset=t.data_ptr() - base,
                                nbytes=t.numel() * t.element_size())
               for name, t in views]
    storages = [wire.Storage(id=ident, descriptor=descriptor, nbytes=buffer.numel())]
    return wire.Shared(conn=b"c", seq=1, push=1, version=1, storages=storages, entries=entries,
                       layout=layout)


def test_one_copy_pushes_of_the_same_storages_reuse_the_views_and_replay_by_layout() -> None:
    """A one-copy receiver hands over the same views, under one ``layout``, for each push that
    lists the same storages and entries (a fresh list each time: a loader may change it); the
    plan replays its copies by that layout, reading each push's bytes. A message that differs
    (another storage) gets a new layout, so nothing is replayed from the old views."""
    twins = Twins(pad_vocab=False)
    tensors = {k: v for k, v in pushed(0).items() if k != "scaled.weight"}
    views = staged(tensors)
    buffer = views[0][1].untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(buffer)
    other = flat.clone()
    backend = _MappedStorages({b"trainer": flat, b"moved": other})
    receiver = WeightReceiver(address="ipc:///nowhere", secret=b"s" * 32)
    receiver._backend = backend  # type: ignore[assignment]
    batches = []
    for step in range(4):
        fresh = {k: v for k, v in pushed(70 + step).items() if k != "scaled.weight"}
        for (_, view), tensor in zip(views, fresh.values(), strict=True):
            view.copy_(tensor)
        twins.plan.begin_push()
        failure, loaded = receiver._load_shared(
            _shared_message(views, flat), lambda b: (batches.append(b), twins.plan.load(b))
        )
        assert failure is None and loaded == len(views)
        twins.plain.load_weights(fresh.items())
        assert_same(twins.planned, twins.plain)
        assert twins.plan.statistics().remembered == (1 if step >= 2 else 0)
    assert backend.opened == [b"trainer"]  # mapped once
    assert len({id(b) for b in batches}) == 4 and len({b.layout for b in batches}) == 1
    # The plan keys its replay by the layout (and the length), not by the views' addresses:
    # the same views under another layout, or fewer of them under the same, replay nothing.
    for layout, pairs in ((batches[0].layout, batches[0][:-1]), (object(), list(batches[0]))):
        for _ in range(2):  # (re)remembered, then replayed by the layout; then one of these
            twins.plan.begin_push()
            receiver._load_shared(_shared_message(views, flat), twins.plan.load)
        assert twins.plan.statistics().remembered == 1
        again = type(batches[0])()
        again.extend(pairs)
        again.sources_persist, again.layout = True, layout
        twins.plan.begin_push()
        twins.plan.load(again)
        assert twins.plan.statistics().remembered == 0
        assert_same(twins.planned, twins.plain)
    assert all(x is y for b in batches[1:] for (_, x), (_, y) in zip(b, batches[0], strict=True))
    other.copy_(flat)
    other_views = [(n, other[v.data_ptr() - flat.data_ptr():][: v.numel() * v.element_size()]
                    .view(v.dtype).view(v.shape)) for n, v in views]
    last = {k: v for k, v in pushed(80).items() if k != "scaled.weight"}
    for (_, view), tensor in zip(other_views, last.values(), strict=True):
        view.copy_(tensor)
    twins.plan.begin_push()
    failure, _ = receiver._load_shared(
        _shared_message(other_views, other, b"moved", ident=2), lambda b: (batches.append(b),
                                                                  twins.plan.load(b))
    )
    assert failure is None and backend.closed == [b"trainer"]
    assert batches[-1].layout is not batches[0].layout
    assert twins.plan.statistics().remembered == 0
    twins.plain.load_weights(last.items())
    assert_same(twins.planned, twins.plain)


def test_a_one_copy_push_repeated_by_its_id_loads_the_list_the_receiver_holds() -> None:
    """A sender repeats a one-copy list by its id alone (``Shared.repeat``: no storages, no
    entries) once the receiver's ack said it holds it. The receiver loads that list's views
    (under the same layout, so the plan replays), each push's bytes; its acks name the list
    it holds. A repeat of a list it does not hold fails the push, naming both, and loads
    nothing."""
    twins = Twins(pad_vocab=False)
    tensors = {k: v for k, v in pushed(0).items() if k != "scaled.weight"}
    views = staged(tensors)
    flat = torch.empty(0, dtype=torch.uint8).set_(views[0][1].untyped_storage())
    backend = _MappedStorages({b"trainer": flat})
    receiver = WeightReceiver(address="ipc:///nowhere", secret=b"s" * 32)
    receiver._backend = backend  # type: ignore[assignment]
    batches: list[Any] = []

    def push(message: wire.Shared, step: int) -> tuple[str, str] | None:
        fresh = {k: v for k, v in pushed(90 + step).items() if k != "scaled.weight"}
        for (_, view), tensor in zip(views, fresh.values(), strict=True):
            view.copy_(tensor)
        twins.plan.begin_push()
        failure, loaded = receiver._load_shared(
            message, lambda b: (batches.append(b), twins.plan.load(b))
        )
        twins.plan.end_push()
        if failure is None:
            assert loaded == len(views)
            twins.plain.load_weights(fresh.items())
        assert_same(twins.planned, twins.plain)  # (a failed push loaded nothing)
        return failure

    def held() -> int:
        ack = receiver._ack(_shared_message(views, flat), None)(0)
        assert isinstance(ack, wire.Ack)
        return ack.layout

    assert held() == 0
    assert push(_shared_message(views, flat, layout=5), 0) is None and held() == 5
    nbytes = sum(t.numel() * t.element_size() for _, t in views)
    assert receiver._last_shared is not None and receiver._last_shared.nbytes == nbytes
    for step in (1, 2, 3):  # learned, planned, then replayed by the layout
        assert push(_shared_message(views, flat, layout=5, repeat=True), step) is None
    assert twins.plan.statistics().remembered == 1
    assert held() == 5 and backend.opened == [b"trainer"]
    assert len({b.layout for b in batches}) == 1 and len({id(b) for b in batches}) == 4
    # The same list under a new id (the sender built it again): the same views, the new id.
    assert push(_shared_message(views, flat, layout=6), 4) is None and held() == 6
    assert batches[-1].layout is batches[0].layout
    failure = push(_shared_message(views, flat, layout=5, repeat=True), 5)
    assert failure is not None and "repeated one-copy list 5" in failure[1]
    assert "holds list 6" in failure[1] and len(batches) == 5  # no loader call
    assert held() == 6


def test_a_late_check_replays_first_and_a_moved_parameter_is_loaded_again() -> None:
    """``begin_push(check_late=True)``: a one-copy push of the list held replays its copies,
    then the parameters are checked. A parameter that moved since is caught: those copies
    went to its old storage (kept alive until ``end_push``), and the push is loaded again,
    learned, so the model ends equal to ``load_weights``; the next pushes replay again."""
    twins = Twins(pad_vocab=False)
    tensors = {k: v for k, v in pushed(0).items() if k != "scaled.weight"}
    views = staged(tensors)
    flat = torch.empty(0, dtype=torch.uint8).set_(views[0][1].untyped_storage())
    receiver = WeightReceiver(address="ipc:///nowhere", secret=b"s" * 32)
    receiver._backend = _MappedStorages({b"trainer": flat})  # type: ignore[assignment]
    message = _shared_message(views, flat, layout=1)
    spent = []

    def push(step: int) -> None:
        fresh = {k: v for k, v in pushed(100 + step).items() if k != "scaled.weight"}
        for (_, view), tensor in zip(views, fresh.values(), strict=True):
            view.copy_(tensor)
        twins.plan.begin_push(check_late=True)
        failure, _ = receiver._load_shared(message, twins.plan.load)
        assert failure is None
        spent.append(len(twins.plan._spent))
        twins.plan.end_push()
        assert not twins.plan._spent
        twins.plain.load_weights(fresh.items())
        assert_same(twins.planned, twins.plain)

    for step in range(3):  # learned, planned and remembered, replayed by the layout
        push(step)
    stats = twins.plan.statistics()
    assert stats.remembered == 1 and stats.invalidations == 0
    old = twins.planned.qkv_weight.data
    before = old.clone()
    twins.planned.qkv_weight.data = old.clone()  # a new address
    push(3)
    stats = twins.plan.statistics()
    assert stats.invalidations == 1 and stats.learned > 0 and stats.remembered == 0
    assert spent == [0, 0, 0, 1]  # the replay into the old storage, kept to the end
    assert not torch.equal(old, before)  # the replay wrote there; the reload here (above)
    for step in (4, 5, 6):  # planned, then replayed into the new storage
        push(step)
    assert twins.plan.statistics().remembered == 1 and spent[-1] == 0


@pytest.mark.parametrize("use", ["destination", "whole_target", "knows", "read_ranges"])
def test_a_late_check_runs_before_the_plan_answers_where_a_tensor_goes(use: str) -> None:
    """With ``check_late``, whatever asks the plan where bytes go before any load (a piece's
    destination, the fingerprint check's targets) gets the check first: after a parameter
    moved, the plan is dropped, and no answer points into the old storage."""
    twins = Twins(pad_vocab=False)
    for step in range(3):
        twins.push(pushed(110 + step))
    name = "self_attn.q_proj.weight"
    tensor = pushed(0)[name]
    dtype, shape = tensor.dtype, tuple(tensor.shape)
    old = twins.planned.qkv_weight.data_ptr()
    assert twins.plan.whole_target(name, dtype, shape).data_ptr() == old  # planned, whole
    twins.planned.qkv_weight.data = twins.planned.qkv_weight.data.clone()  # a new address
    twins.plan.begin_push(check_late=True)
    answer: Any = {
        "destination": lambda: twins.plan.destination(name, dtype, shape),
        "whole_target": lambda: twins.plan.whole_target(name, dtype, shape),
        "knows": lambda: twins.plan.knows(name),
        "read_ranges": lambda: twins.plan.read_ranges().get(name),
    }[use]()
    assert twins.plan.statistics().invalidations == 1
    assert answer in (None, False)  # dropped: learned again at its next load
    twins.plan.load(staged(pushed(113)))
    twins.plain.load_weights(pushed(113).items())
    assert_same(twins.planned, twins.plain)
