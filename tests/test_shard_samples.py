"""A sharded update's fingerprint samples, taken together (``held_samples``, ``_sample_blob``):
the same bytes as one tensor at a time (``asyncroll.fingerprints``' sampling), without a device
call per tensor. Pure: a world of one rank, and the rows' arithmetic for any rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncroll.distributed import (
    _HeldSamples,
    _sample_blob,
    held_samples,
    held_window,
)
from asyncroll.fingerprints import SAMPLES, sampled


def _positions(n: int) -> list[int]:
    """Where a fingerprint samples a tensor of ``n`` elements (as ``sampled`` reads it)."""
    return sampled(torch.arange(n)).tolist()


@pytest.mark.parametrize("n", [0, 1, 7, SAMPLES, SAMPLES + 1, 127, 128, 1000, 4097, 65536])
def test_each_rank_holds_the_samples_of_its_rows(n: int) -> None:
    """For every split of ``n`` elements into ranks' rows (``torch.chunk``'s: the last ranks
    may hold fewer, or none), ``held_window`` names exactly the samples at positions each rank
    holds, and the ranks' windows cover every sample once."""
    positions = _positions(n)
    for world, row in itertools.product((1, 2, 3, 4, 8), (1, 2, 5)):
        if n % row:
            continue
        rows = n // row
        chunk = -(-rows // world) if rows else 0
        covered: list[int] = []
        for rank in range(world):
            start = min(rows, rank * chunk) * row
            held = min(rows, (rank + 1) * chunk) * row - start
            first, end = held_window(n, start, held)
            expected = [i for i, p in enumerate(positions) if start <= p < start + held]
            assert list(range(first, end)) == expected, (n, world, row, rank)
            covered += expected
        assert sorted(covered) == list(range(len(positions)))


@pytest.mark.usefixtures("world_of_one")
def test_the_blob_holds_what_each_tensor_samples_alone() -> None:
    """Many tensors of mixed shapes and dtypes, ``DTensor`` rows and whole tensors, cast or
    not, in one blob: each tensor's bytes equal what a fingerprint samples of the full tensor
    (``asyncroll.fingerprints.sampled``; a world of one holds every sample), cast, in order,
    the blob widened to int32 for the all-reduce. (Several ranks: ``tests/test_distributed.py``
    adds the ranks' samples up against the full tensors' fingerprints.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    generator = torch.Generator().manual_seed(0)
    tensors: list[torch.Tensor] = []
    fulls: list[torch.Tensor] = []
    dtypes: list[torch.dtype] = []
    for i, shape in enumerate([(3,), (64,), (65, 3), (128, 40), (7, 11, 13), (0, 4), (1,)]):
        value = torch.randn(shape, generator=generator)
        sharded = distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)
        sharded.to_local().copy_(value)
        tensors += [torch.nn.Parameter(sharded), value.to(torch.bfloat16)]
        fulls += [value, value.to(torch.bfloat16)]
        dtypes += [torch.bfloat16 if i % 2 else torch.float32, torch.float32]
    held = [held_samples(t, rank=0) for t in tensors]
    assert all(h is not None for h in held)
    blob = _sample_blob([h for h in held if h is not None], dtypes)
    assert blob.dtype == torch.int32
    at = 0
    for full, dtype in zip(fulls, dtypes, strict=True):
        expected = sampled(full).to(dtype).contiguous().view(torch.uint8)
        size = expected.numel()
        assert torch.equal(blob[at : at + size].to(torch.uint8), expected), full.shape
        at += size
    assert at == blob.numel()


def test_a_rank_holding_no_sample_adds_zeros() -> None:
    """A rank whose rows hold none of a tensor's samples (or a whole tensor on a rank other
    than 0) still gives the tensor's full width, as zeros: the ranks' blobs line up."""
    blob = _sample_blob([_HeldSamples(5, 0, None), _HeldSamples(2, 1, torch.tensor([3.0]))],
                        [torch.bfloat16, torch.float32])
    assert blob.numel() == 5 * 2 + 2 * 4
    assert not blob[:14].any()
    assert torch.equal(blob[14:].to(torch.uint8), torch.tensor([3.0]).view(torch.uint8))
    assert held_samples(torch.ones(10), rank=1) == _HeldSamples(10, 0, None)
    assert _sample_blob([], []).numel() == 0
