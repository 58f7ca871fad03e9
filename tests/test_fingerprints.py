"""The GPU side of fingerprints: one Triton kernel reads every sample from a table of their
addresses, and must read exactly what ``torch.cat`` of the samples reads."""

from __future__ import annotations

import pytest
import torch

from asyncroll.fingerprints import SAMPLES, Fingerprinter, _joined

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_cuda_gather_kernel_reads_what_cat_reads(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [(300, 7), (5,), (64,), (1000, 33), (2, 3, 4)]
    tensors = {f"t{i}": (torch.randn(s, generator=g, device="cuda") * 50).to(dtype)
               for i, s in enumerate(sizes)}
    tensors["strided"] = (torch.randn(40, 50, device="cuda") * 50).to(dtype)[:, ::3]
    check = Fingerprinter()
    expected = check(tensors)  # through the kernel (one dtype, one device)
    prepared = check._last
    assert prepared is not None and prepared.table is not None  # the kernel ran
    plain = _joined(prepared.samples, dtype)
    assert b"".join(expected.values()) == plain
    assert all(len(f) <= SAMPLES * tensors[n].element_size() for n, f in expected.items())
    assert check.differing(tensors, expected) == []
    tensors["t3"][0, 0] += 1
    tensors["t1"].view(-1)[2] += 1  # a 5-element tensor: all sampled
    assert check.differing(tensors, expected) == ["t1", "t3"]


@needs_cuda
def test_cuda_tensors_on_two_devices_or_cpu_skip_the_kernel() -> None:
    mixed = {"gpu": torch.ones(100, device="cuda"), "cpu": torch.ones(100)}
    check = Fingerprinter()
    assert check(mixed)["gpu"] == check(mixed)["cpu"]
    assert check._last is not None and check._last.table is None
