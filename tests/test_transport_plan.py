"""Loop-free unit tests of the bucket planner and of packing/unpacking a plan in memory."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools

import pytest
import torch

from asyncroll.transport import packing
from asyncroll.transport.packing import (
    FUSE_BYTES,
    SpanAssembler,
    bucket_spans,
    copy_many,
    fuse_limit,
    fused_slots,
    pack_bucket,
    run_copies,
    slot_view,
    split_copies,
)
from asyncroll.transport.plan import (
    ALIGN,
    Bucket,
    Part,
    TensorMeta,
    default_group,
    plan_buckets,
)


def meta(name: str, nbytes: int, dtype: torch.dtype = torch.uint8) -> TensorMeta:
    size = torch.empty((), dtype=dtype).element_size()
    return TensorMeta(name=name, dtype=dtype, shape=(nbytes // size,))


def names(bucket: Bucket) -> list[str]:
    return [slot.name for slot in bucket.slots]


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.qkv_proj"),
        ("model.layers.3.self_attn.v_proj.bias", "model.layers.3.self_attn.qkv_proj"),
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj"),
        (
            "model.layers.0.mlp.experts.7.gate_proj.weight",
            "model.layers.0.mlp.experts.7.gate_up_proj",
        ),
        (
            "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            "model.layers.1.block_sparse_moe.experts.2.w13",
        ),
        ("model.layers.3.self_attn.o_proj.weight", None),
        ("model.layers.0.mlp.down_proj.weight", None),
        ("lm_head.weight", None),
    ],
)
def test_default_group_understands_hugging_face_names(name: str, group: str | None) -> None:
    assert default_group(name) == group


def test_order_alignment_and_size_invariants() -> None:
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool, torch.int64]
    metas = [meta(f"t{i}", 100 + 37 * i, dtypes[i % len(dtypes)]) for i in range(40)]
    plan = plan_buckets(metas, bucket_bytes=1024)
    order = [s.name for b in plan for s in b.slots]
    assert list(dict.fromkeys(order)) == [m.name for m in metas]
    assert [b.index for b in plan] == list(range(len(plan)))
    for bucket in plan:
        assert all(s.offset % ALIGN == 0 for s in bucket.slots)
        assert bucket.nbytes <= 1024
        ends = [s.offset + s.nbytes for s in bucket.slots]
        assert all(a <= s.offset for a, s in zip(ends, bucket.slots[1:], strict=False))


def test_tensor_exactly_filling_a_bucket_is_alone_and_whole() -> None:
    plan = plan_buckets([meta("a", 10), meta("full", 1024), meta("b", 10)], bucket_bytes=1024)
    assert [names(b) for b in plan] == [["a"], ["full"], ["b"]]
    assert plan[1].slots[0].spanning is False and plan[1].nbytes == 1024


def test_zero_size_tensor_gets_a_slot() -> None:
    empty = TensorMeta(name="empty", dtype=torch.float32, shape=(0, 5))
    plan = plan_buckets([meta("a", 1024), empty], bucket_bytes=1024)
    slots = [s for b in plan for s in b.slots if s.name == "empty"]
    assert len(slots) == 1 and slots[0].nbytes == 0


def test_fused_group_that_would_straddle_opens_a_new_bucket() -> None:
    metas = [
        meta("model.layers.0.input_layernorm.weight", 600),
        meta("model.layers.0.self_attn.q_proj.weight", 200),
        meta("model.layers.0.self_attn.o_proj.weight", 100),
        meta("model.layers.0.self_attn.k_proj.weight", 200),
        meta("model.layers.0.self_attn.v_proj.weight", 200),
    ]
    plan = plan_buckets(metas, bucket_bytes=1024)
    assert names(plan[0]) == ["model.layers.0.input_layernorm.weight"]
    assert names(plan[1]) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    ]


def test_a_fused_group_is_laid_out_kind_by_kind_so_its_copies_coalesce() -> None:
    """Hugging Face order interleaves weights and biases (q.weight, q.bias, k.weight, ...);
    the plan lays a group out kind by kind, in input order within a kind: q, k, v weights end
    to end, as ``qkv_proj.weight`` holds them, so a receiver copies them in one go."""
    prefix = "model.layers.0.self_attn"
    metas = [
        meta(f"{prefix}.{p}_proj.{kind}", 256 if kind == "weight" else 16)
        for p in "qkv"
        for kind in ("weight", "bias")
    ]
    (bucket,) = plan_buckets([*metas, meta("model.norm.weight", 16)], bucket_bytes=4096)
    assert names(bucket) == [
        *(f"{prefix}.{p}_proj.bias" for p in "qkv"),
        *(f"{prefix}.{p}_proj.weight" for p in "qkv"),
        "model.norm.weight",
    ]
    weights = [slot for slot in bucket.slots if slot.name.endswith("weight")][:3]
    assert all(a.offset + a.nbytes == b.offset for a, b in itertools.pairwise(weights))


def test_custom_grouping_function() -> None:
    metas = [meta("x", 700), meta("pair.a", 200), meta("pair.b", 200)]
    plan = plan_buckets(
        metas, bucket_bytes=1024, group_of=lambda n: "pair" if "pair" in n else None
    )
    assert [names(b) for b in plan] == [["x"], ["pair.a", "pair.b"]]


def test_a_custom_group_keeps_numbered_members_in_numeric_order() -> None:
    """Members named by number (``experts.2``, ``experts.10``) sort as numbers, not text: the
    order a stacked parameter holds them in, so their copies can coalesce."""
    metas = [meta(f"moe.experts.{i}", 64) for i in (0, 1, 2, 10, 11)]
    (bucket,) = plan_buckets(
        [meta("x", 64), *reversed(metas)], bucket_bytes=4096,
        group_of=lambda n: "experts" if ".experts." in n else None,
    )
    assert names(bucket) == ["x", *(m.name for m in metas)]


def test_tensor_larger_than_a_bucket_spans_and_completes_once() -> None:
    plan = plan_buckets([meta("a", 100), meta("big", 3000), meta("b", 100)], bucket_bytes=1024)
    pieces = [s for b in plan for s in b.slots if s.name == "big"]
    assert all(s.spanning for s in pieces)
    assert sum(s.nbytes for s in pieces) == 3000
    assert [s.start for s in pieces] == [
        0,
        *[sum(p.nbytes for p in pieces[:i]) for i in range(1, len(pieces))],
    ]
    assert [b.completes for b in plan].count(("big",)) == 1
    assert all(b.nbytes <= 1024 for b in plan)


def test_group_larger_than_a_bucket_is_delivered_whole_at_its_last_piece() -> None:
    metas = [meta(f"m.mlp.{p}_proj.weight", 800) for p in ("gate", "up")]
    plan = plan_buckets(metas, bucket_bytes=1024)
    completes = [b.completes for b in plan if b.completes]
    assert completes == [("m.mlp.gate_proj.weight", "m.mlp.up_proj.weight")]
    assert plan[-1].completes == completes[0]


@pytest.mark.parametrize("bucket_bytes", [0, -256, 1000])
def test_bad_bucket_size_is_rejected(bucket_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        plan_buckets([meta("a", 1)], bucket_bytes=bucket_bytes)


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([meta("a", 1), meta("a", 2)], bucket_bytes=256)


def test_empty_input_is_an_empty_plan() -> None:
    assert plan_buckets([], bucket_bytes=256) == []


def model_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "model.embed_tokens.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).half(),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16, generator=g).half(),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(8, 16, generator=g).half(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g),
        "strided": base[:, ::3],
        "transposed": base.t(),
        "mask": torch.rand(33, generator=g) > 0.5,
        "int8": torch.randint(-128, 127, (77,), dtype=torch.int8, generator=g),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "big": torch.randn(1000, generator=g),
    }


def test_pack_and_unpack_in_memory_is_bit_exact() -> None:
    tensors = model_tensors()
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes=2048)
    buffer = torch.zeros(2048, dtype=torch.uint8)
    spans = SpanAssembler()
    got: dict[str, torch.Tensor] = {}
    for bucket in plan:
        pack_bucket(bucket, buffer, tensors)
        for slot in bucket.slots:
            if slot.spanning:
                spans.add(slot, buffer)
            else:
                got[slot.name] = slot_view(
                    buffer, slot.offset, slot.nbytes, slot.dtype, slot.shape
                ).clone()
        got.update((n, t.clone()) for n, t in spans.take(bucket.completes))
    assert len(spans) == 0 and spans.scratch_bytes >= 4000  # reused, sized by the largest group
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_disjoint_copies_fuse_the_small_ones_and_copy_every_byte(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small copies (same dtype) between disjoint destinations go in one fused launch after
    the big ones; a cast, a lone small copy and the big ones stay ``copy_``; every byte lands."""
    monkeypatch.setattr(packing, "LAUNCH_BOUND_BYTES", FUSE_BYTES)  # a batch of few copies
    big = FUSE_BYTES // 4 + 1  # float32 elements: just over the limit
    dsts = [torch.zeros(big), torch.zeros(3), torch.zeros(5), torch.zeros(4, dtype=torch.bfloat16)]
    srcs = [torch.randn(big), torch.randn(3), torch.randn(5), torch.randn(4)]  # the last casts
    plain, _, fused_dsts, fused_srcs = split_copies(dsts, srcs, disjoint=True)
    assert [d.numel() for d in plain] == [big, 4] and [d.numel() for d in fused_dsts] == [3, 5]
    assert [s.numel() for s in fused_srcs] == [3, 5]
    copy_many(dsts, srcs, disjoint=True)
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.to(dst.dtype))
    one_small = split_copies(dsts[:2], srcs[:2], disjoint=True)
    assert len(one_small[0]) == 2 and not one_small[2]  # nothing to fuse with


def test_copies_that_may_overlap_keep_their_order() -> None:
    """Without ``disjoint``, two small copies into the same memory run in order (the last one
    wins), as ``copy_`` one by one would."""
    dst = torch.zeros(4)
    first, last = torch.full((4,), 1.0), torch.full((4,), 2.0)
    split = split_copies([dst, dst[:2]], [first, last[:2]], disjoint=False)
    assert not split[2]
    copy_many([dst, dst[:2]], [first, last[:2]])
    assert dst.tolist() == [2.0, 2.0, 1.0, 1.0]


def test_copies_that_continue_each_other_coalesce_and_the_rest_do_not(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``coalesce``, two big copies whose destinations and sources both lie end to end
    in one storage become one copy; a strided source, and a broadcast (a source smaller than
    its destination, which would read past itself if merged), stay apart; every byte lands."""
    monkeypatch.setattr(packing, "LAUNCH_BOUND_BYTES", FUSE_BYTES)  # a batch of few copies
    half = FUSE_BYTES // 4 + 1  # float32 elements: each copy too big to fuse
    dst, src = torch.zeros(2 * half), torch.randn(2 * half)
    merged = split_copies([dst[:half], dst[half:]], [src[:half], src[half:]],
                          disjoint=True, coalesce=True)
    assert len(merged[0]) == 1 and merged[0][0].numel() == 2 * half
    apart = split_copies([dst[:half], dst[half:]], [src[:half], src[half:]], disjoint=True)
    assert len(apart[0]) == 2
    grid = torch.randn(half, 2)
    strided = split_copies([dst[:half], dst[half:]], [grid[:, 0], src[half:]],
                           disjoint=True, coalesce=True)
    assert len(strided[0]) == 2
    small = torch.zeros(8)
    row = torch.tensor([10.0, 11, 12, 13, 14])
    copy_split = split_copies([small[:4], small[4:]], [row[:1], row[1:]],
                              disjoint=True, coalesce=True)
    assert len(copy_split[2]) + len(copy_split[0]) == 2  # the broadcast stays apart
    copy_many([small[:4], small[4:]], [row[:1], row[1:]], disjoint=True)
    run_copies(copy_split)
    assert small.tolist() == [10.0, 10, 10, 10, 11, 12, 13, 14]


def test_bucket_spans_copy_what_pack_bucket_packs() -> None:
    """The address ranges a backend copies itself (the CUDA sender's driver memcpy) put every
    byte where ``pack_bucket`` does: spanning pieces and both ends of a bucket included."""
    tensors = {n: t.contiguous() for n, t in model_tensors().items()}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes=2048)
    assert any(slot.spanning for bucket in plan for slot in bucket.slots)
    packed, copied = torch.zeros(2048, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)
    for bucket in plan:
        packed.fill_(7)
        copied.fill_(7)
        pack_bucket(bucket, packed, tensors)
        spans = bucket_spans(bucket, copied, tensors)
        assert spans is not None
        for dst, src, nbytes in spans:
            ctypes.memmove(dst, src, nbytes)
        assert torch.equal(packed, copied), bucket.index


def test_the_small_slots_fused_and_the_rest_as_spans_pack_the_whole_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA sender's split (``fused_slots``) of a bucket bound by its launches (its slots
    average less than ``LAUNCH_BOUND_BYTES``): the slots of at most that in one fused
    ``pack_bucket``, the rest as address ranges; together they write every byte that
    ``pack_bucket`` writes, and each slot is in exactly one of the two. A bucket of big slots
    is all address ranges."""
    monkeypatch.setattr(packing, "SENDER_LAUNCH_BOUND_COPIES", 3)  # four slots: launch-bound
    monkeypatch.setattr(packing, "LAUNCH_BOUND_BYTES", 16 << 20)  # whatever the environment
    big = packing.LAUNCH_BOUND_BYTES // 4 + 1  # float32 elements
    tensors = {"a": torch.arange(3.0), "big": torch.rand(big), "b": torch.rand(5, 2),
               "c": torch.full((7,), 2.0)}
    (bucket,) = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()],
                             bucket_bytes=packing.LAUNCH_BOUND_BYTES + (1 << 16))
    one_by_one, fused = fused_slots(bucket)
    assert fused is not None
    assert [s.name for s in one_by_one.slots] == ["big"]
    assert sorted(s.name for s in fused.slots) == ["a", "b", "c"]
    packed = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    split = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, packed, tensors)
    spans = bucket_spans(one_by_one, split, tensors)
    assert spans is not None and len(spans) == 1
    for dst, src, nbytes in spans:
        ctypes.memmove(dst, src, nbytes)
    pack_bucket(fused, split, tensors)
    assert torch.equal(packed, split)
    for slots in (bucket.slots[:1], tuple(s for s in bucket.slots if s.name in ("big", "a"))):
        alone, nothing = fused_slots(dataclasses.replace(bucket, slots=slots))
        assert nothing is None and alone.slots == slots  # one slot; big on average


def test_a_batch_of_copies_bound_by_its_launches_fuses_them_up_to_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many copies averaging less than ``LAUNCH_BOUND_BYTES`` (a mixture's experts) fuse up to
    it; a batch of big copies, or of few, fuses only those of at most ``FUSE_BYTES``."""
    monkeypatch.setattr(packing, "LAUNCH_BOUND_BYTES", 16 << 20)  # whatever the environment
    mib = 1 << 20
    assert fuse_limit([3 * mib] * 18_000 + [400 * mib]) == 16 * mib
    assert fuse_limit([40 * mib] * 300 + [4096] * 100) == FUSE_BYTES  # a dense 7B's
    assert fuse_limit([3 * mib] * 300) == 16 * mib  # a 0.5B's: bound by its launches too
    assert fuse_limit([3 * mib] * 40) == FUSE_BYTES  # too few to be bound by launches
    # The sender's driver copies cost a tenth of ``copy_``'s: its bar is higher.
    sender = packing.SENDER_LAUNCH_BOUND_COPIES
    assert fuse_limit([3 * mib] * 300, copies=sender) == FUSE_BYTES
    assert fuse_limit([3 * mib] * 18_000, copies=sender) == 16 * mib
    assert fuse_limit([]) == FUSE_BYTES
    monkeypatch.setattr(packing, "LAUNCH_BOUND_COPIES", 3)
    dsts = [torch.empty(FUSE_BYTES // 4 + 1) for _ in range(3)]  # each just over FUSE_BYTES
    srcs = [torch.rand(d.numel()) for d in dsts]
    assert len(split_copies(dsts, srcs, disjoint=True)[2]) == 3  # launch-bound: fused
    big = [torch.empty(16 * mib), torch.empty(16 * mib)]  # float32: 64 MiB each
    assert split_copies(dsts + big, srcs + [torch.rand(b.numel()) for b in big],
                        disjoint=True)[2] == []


def test_bucket_spans_leave_to_pack_bucket_what_needs_torch() -> None:
    """A strided source, another dtype than the plan's (a cast), another shape, a tensor
    subclass with a layout of its own, a lazy view, or a buffer too short: no address ranges
    for that bucket."""
    source = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    (bucket,) = plan_buckets([TensorMeta.of("w", source)], bucket_bytes=1024)
    buffer = torch.zeros(1024, dtype=torch.uint8)
    assert bucket_spans(bucket, buffer, {"w": source}) == [
        (buffer.data_ptr(), source.data_ptr(), 256)
    ]
    assert bucket_spans(bucket, buffer, {"w": torch.nn.Parameter(source)}) is not None

    class Wrapped(torch.Tensor):
        pass

    for other in (
        source.t(),
        source.half(),
        source.reshape(4, 16),
        source.as_subclass(Wrapped),
        torch._neg_view(source),  # lazy views: contiguous, but their bytes are not their values
        torch._efficientzerotensor((8, 8)),
    ):
        assert bucket_spans(bucket, buffer, {"w": other}) is None
    assert bucket_spans(bucket, buffer[:255], {"w": source}) is None  # never past the buffer


def test_a_read_of_the_whole_maps_onto_a_piece_or_is_refused() -> None:
    """``Part.source_view``: a read of the whole tensor (as ``as_strided`` takes it) as the
    same read of the piece. Rows shift; a column block maps runs within its columns and
    row-major blocks, and refuses what crosses its columns or rows it lacks."""
    rows = Part(whole=(6, 4), offset=8)  # rows 2.. of a 6 x 4 tensor
    assert rows.source_view((2, 4), (4, 1), 12, 16) == ((2, 4), (4, 1), 4)
    assert rows.source_view((2, 4), (4, 1), 4, 16) is None  # row 1: not held
    assert rows.source_view((2, 4), (4, 1), 20, 16) is None  # past the piece
    block = Part(whole=(6, 4), offset=0, columns=(2, 4))  # whole[:, 2:4], 6 x 2
    assert block.source_view((6, 2), (4, 1), 2, 12) == ((6, 2), (2, 1), 0)
    assert block.source_view((2, 1), (4, 1), 11, 12) == ((2, 1), (2, 1), 5)  # rows 2-3, col 3
    assert block.source_view((2,), (1,), 6, 12) == ((2,), (1,), 2)  # a run in row 1
    assert block.source_view((6, 3), (4, 1), 1, 12) is None  # column 1: not held
    assert block.source_view((3,), (1,), 2, 12) is None  # runs into the next row
    assert block.source_view((6, 2), (8, 1), 2, 12) is None  # every other row: not mapped
    assert block.source_view((7, 2), (4, 1), 2, 12) is None  # a row past the piece
