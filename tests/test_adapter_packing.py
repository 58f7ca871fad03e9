"""An adapter as it travels and as it lands: packed into one flat tensor per dtype, fingerprinted
tensor by tensor from the pack, unpacked into views; and the replay of what vLLM's activation
wrote into a LoRA slot (pure: plain tensors stand for vLLM's slots; tests/test_lora.py runs both
ways into a real engine and compares the slots bitwise)."""

from __future__ import annotations

import pytest
import torch

from asyncroll import InvalidRequestError, WeightSyncError
from asyncroll.adapters import (
    AdapterConfig,
    AdapterLayout,
    AdapterPlans,
    pack_adapter,
    pack_finite,
    split_adapter,
    unpack_adapter,
)
from asyncroll.fingerprints import fingerprints, packed_fingerprints
from asyncroll.vllm.lora import SlotWrites, _Recording


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
