"""The bucket plan of ``bench/_handoff_floor.py`` (the two-process floor that
``bench/weight_push.py`` sets beside our pipeline): it must lay the tensors out as a staged push
does, or the floor would time other copies than ours. (The floor itself needs CUDA; it checks
its own loads byte for byte and raises if a device wait did not hold.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from asyncroll.transport.plan import TensorMeta
from asyncroll.transport.plan import plan_buckets as ours


def _floor() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "_handoff_floor.py"
    spec = importlib.util.spec_from_file_location("bench_handoff_floor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_tensor_whole_in_order_and_aligned() -> None:
    sizes = [300, 1000, 10, 700, 256, 1, 1024]
    plan = _floor().plan_buckets(sizes, 1024)
    flat = [slot for bucket in plan for slot in bucket]
    assert [index for index, _, _ in flat] == list(range(len(sizes)))  # in order, each once
    assert [nbytes for _, _, nbytes in flat] == sizes
    for bucket in plan:
        assert bucket  # no empty bucket
        ends = 0
        for _, offset, nbytes in bucket:
            assert offset % 256 == 0 and offset >= ends  # aligned, no overlap
            ends = offset + nbytes
        assert ends <= 1024
    assert [[i for i, _, _ in b] for b in plan] == [[0], [1], [2, 3], [4, 5], [6]]


def test_a_tensor_larger_than_a_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than a bucket"):
        _floor().plan_buckets([10, 2048], 1024)


def test_the_same_bucket_count_as_a_staged_push_of_a_model() -> None:
    """For weight_push.py's model shapes the floor's buckets are asyncroll's (17 for 8 GiB at
    512 MiB on the GPU): the two time the same number of hand-offs."""
    import torch

    hidden, inter, vocab = 4096, 11008, 32000
    shapes = [(vocab, hidden), (vocab, hidden)]
    layer = [
        (hidden, hidden),
        (hidden // 4, hidden),
        (hidden // 4, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (1, hidden),
        (1, hidden),
    ]
    while sum(a * b * 2 for a, b in shapes) < 8.0 * (1 << 30):  # weight_push.py's 8 GiB
        shapes += layer
    metas = [
        TensorMeta(name=f"t{i}", dtype=torch.bfloat16, shape=shape)
        for i, shape in enumerate(shapes)
    ]
    bucket = 512 << 20
    floor = _floor().plan_buckets([m.nbytes for m in metas], bucket)
    assert len(floor) == len(ours(metas, bucket_bytes=bucket)) == 17
