"""An adapter as it travels and as it lands: packed into one flat tensor per dtype, fingerprinted
tensor by tensor from the pack, unpacked into views; and the replay of what vLLM's activation
wrote into a LoRA slot (pure: plain tensors stand for vLLM's slots; tests/test_lora.py runs both
ways into a real engine and compares the slots bitwise)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncroll import InvalidRequestError, WeightSyncError
from asyncroll.adapters import (
    AdapterConfig,
    AdapterLayout,
    AdapterPlans,
    AdapterRevision,
    PackedAdapter,
    Revisions,
    pack_adapter,
    pack_finite,
    split_adapter,
    unpack_adapter,
)
from asyncroll.fingerprints import PackedPrints, fingerprints, packed_fingerprints
from asyncroll.receive.adapter import AdapterTake, Landing
from asyncroll.transport.receiver import ReceiveReport
from asyncroll.vllm.lora import RevisionStore, SlotWrites, _Held, _Recording


def adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i, (rows, cols) in enumerate([(8, 96), (8, 33), (8, 7), (1, 3)]):
        out[f"base_model.model.m{i}.lora_A.weight"] = torch.randn(rows, cols, generator=gen)
        out[f"base_model.model.m{i}.lora_B.weight"] = (
            torch.randn(cols + 5, rows, generator=gen).to(torch.bfloat16)
        )
    return out


def test_a_packed_adapter_unpacks_to_the_same_tensors_and_fingerprints() -> None:
    tensors = adapter()
    packed = pack_adapter(tensors)
    assert sorted(packed.chunks) == ["asyncroll.adapter.bfloat16", "asyncroll.adapter.float32"]
    assert all(chunk.dim() == 1 for chunk in packed.chunks.values())
    assert packed.tensors == len(tensors)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    unpacked = unpack_adapter(packed.chunks, packed.layout)
    assert unpacked.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor)
    # Each tensor's fingerprint from the pack is the one of the tensor itself (small ones,
    # fewer elements than samples, included): the check proves per tensor what it did.
    assert packed_fingerprints(packed.chunks, packed.layout) == fingerprints(tensors)


def test_a_changed_element_changes_the_fingerprint_of_its_tensor_only() -> None:
    packed = pack_adapter(adapter())
    before = packed_fingerprints(packed.chunks, packed.layout)
    name, chunk, first, _ = packed.layout[0]  # element 0 of a tensor is always sampled
    packed.chunks[chunk][first] += 1
    after = packed_fingerprints(packed.chunks, packed.layout)
    assert [n for n in before if before[n] != after[n]] == [name]


def test_one_adapter_packs_to_one_layout_whatever_the_order_of_its_tensors() -> None:
    tensors = adapter()
    reversed_order = dict(reversed(list(tensors.items())))
    assert pack_adapter(reversed_order).layout == pack_adapter(tensors).layout


def engine_layout(tensors: dict[str, torch.Tensor], rank: int = 8) -> AdapterLayout:
    shapes = {}
    for name, tensor in tensors.items():
        module, half = name.removeprefix("base_model.model.").split(".lora_")
        out_in = shapes.setdefault(module, [0, 0])
        if half.startswith("A"):
            out_in[1] = tensor.shape[1]
        else:
            out_in[0] = tensor.shape[0]
    return AdapterLayout(max_rank=rank, slots=2, resident=2,
                         modules=frozenset({"m0", "m1", "m2", "m3"}),
                         shapes={m: (o, i) for m, (o, i) in shapes.items()})


def test_a_plan_is_worked_out_once_a_layout_and_packs_each_revision_as_pack_adapter() -> None:
    plans = AdapterPlans(kept=2)
    first, second = adapter(0), adapter(1)
    plan, values = plans.plan(first)
    again, values2 = plans.plan(list(second.items()))  # same names, shapes, dtypes, device
    assert again is plan
    for tensors, vals in ((first, values), (second, values2)):
        packed, expected = plan.pack(vals), pack_adapter(tensors)
        assert packed.layout == expected.layout
        assert all(torch.equal(packed.chunks[c], expected.chunks[c]) for c in expected.chunks)
    # Packed into the kept pack (the manager's way): the same tensors, each revision's values.
    kept = plan.pack(values, keep=True)
    for tensors, vals in ((second, values2), (first, values)):
        assert plan.pack(vals, keep=True) is kept
        expected = pack_adapter(tensors)
        assert all(torch.equal(kept.chunks[c], expected.chunks[c]) for c in expected.chunks)
    # The prefix is optional: the plan names tensors as PEFT does.
    bare = {k.removeprefix("base_model.model."): v for k, v in first.items()}
    assert plans.plan(bare)[0].names == plan.names
    # A changed shape or dtype is another layout; the least recently used goes past ``kept``.
    wider = dict(first, **{"base_model.model.m3.lora_A.weight": torch.zeros(1, 4)})
    assert plans.plan(wider)[0] is not plan
    halved = {k: v.to(torch.bfloat16) for k, v in first.items()}
    assert plans.plan(halved)[0] is not plan
    assert plans.plan(first)[0] is not plan  # evicted (kept=2)


def test_a_known_plan_still_refuses_what_does_not_fit_the_engine_or_is_not_a_lora() -> None:
    plans = AdapterPlans()
    tensors = adapter()
    plan, values = plans.plan(tensors)
    config, layout = AdapterConfig(rank=8, alpha=16), engine_layout(tensors)
    # m3's rank is 1: refused, and refused again (a failed check is not remembered).
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="rank 8"):
            plan.check(values, config, layout, engine="e")
    fitting = {k: v for k, v in tensors.items() if ".m3." not in k}
    plan, values = plans.plan(fitting)
    plan.check(values, config, engine_layout(fitting), engine="e")
    narrow = engine_layout(fitting, rank=4)  # another engine's layout: checked on its own
    with pytest.raises(InvalidRequestError, match="max_lora_rank 4"):
        plan.check(values, config, narrow, engine="e2")
    with pytest.raises(InvalidRequestError, match="not of rank 4"):
        plan.check(values, AdapterConfig(rank=4, alpha=8), engine_layout(fitting), engine="e")
    # Names the plans know, values that are not tensors or not LoRA names: typed errors.
    with pytest.raises(InvalidRequestError, match=r"2-d torch\.Tensor"):
        plans.plan({name: [[1.0]] for name in fitting})
    with pytest.raises(InvalidRequestError, match="not a LoRA tensor"):
        plans.plan({"model.m0.weight": torch.zeros(2, 2)})
    with pytest.raises(InvalidRequestError, match="not a LoRA tensor"):
        plans.plan([(["unhashable"], torch.zeros(2, 2))])
    with pytest.raises(InvalidRequestError, match="non-finite values"):
        plan.pack_finite(tuple(v.clone().fill_(float("nan")) for v in values))


def test_unpacking_refuses_a_layout_that_does_not_tile_the_chunks() -> None:
    packed = pack_adapter(adapter())
    name, chunk, first, shape = packed.layout[1]
    gap = (*packed.layout[:1], (name, chunk, first + 1, shape), *packed.layout[2:])
    with pytest.raises(WeightSyncError, match="at element"):
        unpack_adapter(packed.chunks, gap)
    short = {**packed.chunks, chunk: packed.chunks[chunk][:-1]}
    with pytest.raises(WeightSyncError, match="fills"):
        unpack_adapter(short, packed.layout)
    with pytest.raises(WeightSyncError, match="chunks"):
        unpack_adapter({chunk: packed.chunks[chunk]}, packed.layout)


def test_packing_refuses_non_finite_values_by_name_and_tensors_on_two_devices() -> None:
    tensors = adapter()
    tensors["base_model.model.m2.lora_A.weight"][0, 0] = float("nan")
    with pytest.raises(InvalidRequestError, match=r"m2\.lora_A"):
        pack_finite(tensors)
    meta = {**adapter(), "base_model.model.m9.lora_A.weight": torch.empty(2, 2, device="meta")}
    with pytest.raises(InvalidRequestError, match="one device"):
        pack_adapter(meta)


class Slots:
    """Stand-in for vLLM's LoRA layers: per module, stacked A and B for 3 slots; ``activate``
    writes a revision as vLLM's ``set_lora`` does (zero the slot, copy A, copy B, whose
    ``alpha / rank`` vLLM folded in already: ``fold``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], max_rank: int = 8) -> None:
        self.a = {n: torch.full((3, 1, max_rank, t.shape[1]), 7.0)
                  for n, t in tensors.items() if ".lora_A." in n}
        self.b = {n.replace("lora_A", "lora_B"): torch.full((3, 1, t.shape[1] + 5, max_rank), 7.0)
                  for n, t in tensors.items() if ".lora_A." in n}

    @staticmethod
    def fold(tensors: dict[str, torch.Tensor], scaling: float) -> None:
        """What vLLM does to its LoRAModel's own copy when it registers it."""
        for name, tensor in tensors.items():
            if ".lora_B." in name:
                tensor *= scaling

    def activate(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, stack in self.a.items():
            b_name = name.replace("lora_A", "lora_B")
            a, b = tensors[name], tensors[b_name]
            stack[index] = 0
            self.b[b_name][index] = 0
            stack[index, 0, : a.shape[0], : a.shape[1]].copy_(a)
            self.b[b_name][index, 0, : b.shape[0], : b.shape[1]].copy_(b)

    def slot(self, index: int) -> list[torch.Tensor]:
        return [s[index].clone() for s in (*self.a.values(), *self.b.values())]


def recorded(slots: Slots, tensors: dict[str, torch.Tensor], index: int, scaling: float,
             activate: object = None) -> SlotWrites | None:
    packed = pack_adapter(tensors)  # as pushed; vLLM's copy is in its LoRA dtype (float)
    scratch = {n: c.to(torch.float32, copy=True) for n, c in packed.chunks.items()}
    views = unpack_adapter(scratch, packed.layout)
    Slots.fold(views, scaling)
    with _Recording(scratch, packed.layout) as recording:
        (activate or slots.activate)(index, views)  # type: ignore[operator]
    return recording.writes()


def test_a_replay_writes_the_slot_exactly_as_the_recorded_activation_did() -> None:
    first, second = adapter(1), adapter(2)
    slots = Slots(first)
    writes = recorded(slots, first, 1, 2.0)
    assert writes is not None and len(writes) == 8
    assert len(writes.scaled) == 4  # the B copies
    # Whole tensors into contiguous slot regions copy flat; m3's B (rank 1 of the slots' 8
    # columns) lands in a strided region and keeps its shaped source.
    assert [len(source) for source in writes.sources].count(4) == 1
    # Fills a copy overwrites whole are dropped: only m3's (rank 1 in slots of rank 8) stay.
    assert len(writes.zeros) == 2
    # vLLM's way with the second revision into slot 2, the replay into slot 1 (recorded there)
    theirs = {n: t.float() for n, t in second.items()}
    Slots.fold(theirs, 2.0)
    slots.activate(2, theirs)
    packed = pack_adapter(second)  # as pushed: bf16 B, float A; the slots are float
    writes.replay(packed.chunks, split_adapter(packed.chunks, packed.layout), 2.0)
    assert all(torch.equal(x, y) for x, y in zip(slots.slot(1), slots.slot(2), strict=True))
    assert torch.equal(slots.slot(0)[0], torch.full_like(slots.slot(0)[0], 7.0))  # untouched


def test_an_activation_a_replay_cannot_reproduce_is_refused() -> None:
    tensors = adapter(3)
    slots = Slots(tensors)
    other = torch.ones(8, 96)

    def scales_in_place(index: int, views: dict[str, torch.Tensor]) -> None:
        slots.activate(index, views)
        next(iter(slots.a.values()))[index].mul_(2)  # a write that is no copy nor zero

    def copies_from_elsewhere(index: int, views: dict[str, torch.Tensor]) -> None:
        slots.activate(index, views)
        next(iter(slots.a.values()))[index, 0].copy_(other)

    def zeros_after_copying(index: int, views: dict[str, torch.Tensor]) -> None:
        slots.activate(index, views)
        next(iter(slots.a.values()))[index] = 0

    def converts(index: int, views: dict[str, torch.Tensor]) -> None:
        slots.activate(index, views)
        name = next(iter(slots.a))
        torch.empty(8, 96, dtype=torch.float64).copy_(views[name])  # from the revision's own

    for activate in (scales_in_place, copies_from_elsewhere, zeros_after_copying, converts):
        assert recorded(slots, tensors, 0, 1.0, activate) is None, activate.__name__


def received(packed: PackedAdapter, landing: Landing | None, prints: object = None) -> AdapterTake:
    """An adapter push as a worker takes it (``AdapterTake``), out of one bucket."""
    take = AdapterTake("cpu", packed.layout, landing)
    bucket = [(name, chunk.clone()) for name, chunk in packed.chunks.items()]  # the transport's
    take.load(bucket)
    for _, chunk in bucket:
        chunk.fill_(float("nan"))  # the buffer, reused by the next bucket: nothing reads it
    total = sum(c.numel() * c.element_size() for c in packed.chunks.values())
    take.check(ReceiveReport(
        push=0, version=0, buckets=1, tensors=len(packed.chunks), bytes=total, seconds=0.0,
        fingerprints=prints if prints is not None else packed_fingerprints(
            packed.chunks, packed.layout),
    ))
    return take


def test_revision_after_revision_lands_in_the_same_memory_and_views_and_replays_the_same() -> None:
    first, second = adapter(1), adapter(2)
    slots = Slots(first)
    writes = recorded(slots, first, 1, 2.0)
    assert writes is not None
    layout = pack_adapter(first).layout
    landing = Landing(layout)
    take = received(pack_adapter(first), landing)
    assert all(take.chunks[n] is c for n, c in landing.chunks.items()) and take.chunks
    writes.replay(take.chunks, take.pieces, 2.0, landing)
    views, sources = take.pieces, landing.sources[writes]
    addresses = {n: c.data_ptr() for n, c in landing.chunks.items()}
    # The next revision lands where the first did (it was dropped), reads the views made once,
    # and writes the slot exactly as vLLM's way and as a replay from memory of its own do.
    take = received(pack_adapter(second), landing)
    assert take.pieces is views and {n: c.data_ptr() for n, c in take.chunks.items()} == addresses
    writes.replay(take.chunks, take.pieces, 2.0, landing)
    assert landing.sources[writes] is sources
    theirs = {n: t.float() for n, t in second.items()}
    Slots.fold(theirs, 2.0)
    slots.activate(2, theirs)
    assert all(torch.equal(x, y) for x, y in zip(slots.slot(1), slots.slot(2), strict=True))
    own = received(pack_adapter(adapter(3)), None)
    writes.replay(own.chunks, own.pieces, 2.0, landing)  # not the landing's: views of its own
    assert landing.sources[writes] is sources
    mine = {n: t.float() for n, t in adapter(3).items()}
    Slots.fold(mine, 2.0)
    slots.activate(2, mine)
    assert all(torch.equal(x, y) for x, y in zip(slots.slot(1), slots.slot(2), strict=True))


def test_a_landing_still_checks_every_tensor_and_the_layouts_tiling() -> None:
    packed = pack_adapter(adapter(1))
    landing = Landing(packed.layout)
    received(packed, landing)
    prints = packed_fingerprints(packed.chunks, packed.layout)
    name = next(iter(prints))
    with pytest.raises(WeightSyncError, match="differ from what was pushed"):
        received(packed, landing, {**prints, name: b"\0" * len(prints[name])})
    # A chunk of another size is new memory and views made again, and must tile the layout.
    chunk = next(iter(packed.chunks))
    short = PackedAdapter({**packed.chunks, chunk: packed.chunks[chunk][:-1]}, packed.layout)
    with pytest.raises(WeightSyncError, match="the layout fills"):
        received(short, landing, {})


def test_prints_started_as_chunks_land_are_those_of_the_landed_chunks() -> None:
    packed = pack_adapter(adapter(4))
    prints = PackedPrints(packed.layout)
    for name, chunk in packed.chunks.items():
        prints.start(name, chunk)
    assert prints.result(packed.chunks) == packed_fingerprints(packed.chunks, packed.layout)
    # A chunk that is not the one started (landed again elsewhere) is fingerprinted as it is.
    other = pack_adapter(adapter(5))
    assert prints.result(other.chunks) == packed_fingerprints(other.chunks, other.layout)
    # One the layout does not tile is never started (the check refuses it, by name).
    name = next(iter(packed.chunks))
    late = PackedPrints(packed.layout)
    late.start(name, packed.chunks[name][:-1])
    late.start(name, packed.chunks[name].view(1, -1))
    assert late.result({name: packed.chunks[name]}) == {
        k: v for k, v in packed_fingerprints(packed.chunks, packed.layout).items()
        if k in dict.fromkeys(n for n, c, _, _ in packed.layout if c == name)
    }


def test_an_adapters_revisions_leave_once_it_is_retired_and_its_calls_end() -> None:
    revisions = Revisions()
    first, second = AdapterRevision.next("x", 1), AdapterRevision.next("y", 1)
    revisions.add(first)
    revisions.add(second)
    assert revisions.droppable() == []  # each its adapter's newest
    with revisions.pinned("x") as pinned:
        revisions.retire("x")
        assert pinned == first and revisions.droppable() == []  # in use
        with pytest.raises(InvalidRequestError, match="'x' has no revision"):
            with revisions.pinned("x"):
                pass
    assert revisions.droppable() == [first] and revisions.adapters() == {"y"}


def fake_store() -> RevisionStore:
    manager = SimpleNamespace(
        _load_adapter=lambda request: None,
        _adapter_manager=SimpleNamespace(activate_adapter=lambda lora_id: True),
        remove_adapter=lambda lora_id: True,
    )
    return RevisionStore(SimpleNamespace(), manager)


def test_a_registered_revisions_landing_is_lent_again_only_once_it_is_dropped() -> None:
    store = fake_store()
    layout = pack_adapter(adapter(1)).layout
    landing = store.landing(layout)
    store._held[7] = _Held({}, layout, {}, landing)  # as ``add`` registers revision 7
    store.release(landing)  # a failure after registering: the revision keeps its memory
    assert store.landing(layout) is not landing
    assert store.drop(7)
    assert store.landing(layout) is landing


def test_a_workers_store_lends_a_dropped_revisions_landing_once_and_only_for_its_layout() -> None:
    store = fake_store()
    one, other = pack_adapter(adapter(1)).layout, pack_adapter({
        k: v for k, v in adapter(1).items() if ".m0." in k}).layout
    a = store.landing(one)
    b = store.landing(one)
    assert a is not b and store.landings_made == 2
    store.release(a)
    store.release(a)  # idempotent: lent once, back once
    assert store.landing(other) is not a  # another layout's memory is never lent for it
    assert store.landing(one) is a
    assert store.landing(one) is not a and store.landings_made == 4  # a is lent again
