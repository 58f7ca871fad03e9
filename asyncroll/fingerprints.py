"""Fingerprints of tensors: a cheap, exact check that a push delivered what the trainer sent.

A fingerprint is the bytes of 64 of a tensor's elements at fixed, evenly spread positions
(element ``i * (n // 64)``; all of a tensor of 64 elements or fewer): at most 512 bytes, and
comparing two costs nothing. Compare fingerprints of tensors of one dtype and shape (a receiver
checks those first). Equal tensors always have equal fingerprints, whatever device or process
computes them; a tensor that a training step moved (every element) almost surely a new one; a
corrupted element is seen when it is sampled (the sampled positions include the first element).

``Fingerprinter`` computes many at once with one gather and one copy to the host per device
and dtype. It keeps the strided sample views of contiguous tensors from one call to the next
(a view costs a few microseconds of Python; a 7B model has 339 tensors), only for the tensors
of the last call, so it never keeps a tensor alive longer than one call after its owner let go.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch

__all__ = ["SAMPLES", "Fingerprinter", "fingerprints", "holds_exactly"]

SAMPLES: Final = 64

_Key = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


class Fingerprinter:
    """``fingerprinter(tensors) -> {name: fingerprint}``; reuses the sample views of the
    tensors it saw in its last call."""

    def __init__(self) -> None:
        self._views: dict[_Key, torch.Tensor] = {}
        self._last: Mapping[str, torch.Tensor] | None = None
        """The mapping of the last call: passed again (the same object, unchanged: a caller
        that caches it says so), its sample views are reused without a look."""
        self._last_dtypes: Mapping[str, torch.dtype] | None = None
        self._last_samples: list[torch.Tensor] = []

    def __call__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> dict[str, bytes]:
        """``dtypes``: fingerprint a tensor as that dtype (its samples cast on the host), for
        a destination that holds a pushed tensor widened exactly (bf16 served as float32)."""
        if tensors is self._last and dtypes is self._last_dtypes:
            samples = self._last_samples  # the same tensors as last time: the same views
        else:
            samples = self._samples(tensors)
            self._last, self._last_dtypes, self._last_samples = tensors, dtypes, samples
        targets = [(dtypes or {}).get(name, t.dtype) for name, t in tensors.items()]
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            found = _to_host(samples, targets)
        return dict(zip(tensors, found, strict=True))

    def differing(
        self,
        tensors: Mapping[str, torch.Tensor],
        expected: Mapping[str, bytes],
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> list[str]:
        """The names (sorted) of ``tensors`` whose fingerprint (as ``dtypes``, see
        ``__call__``) is not ``expected[name]``: one comparison of all the bytes at once, and
        a look name by name only if that differs. Every name must be in ``expected``."""
        if tensors is self._last and dtypes is self._last_dtypes:
            samples = self._last_samples
        else:
            samples = self._samples(tensors)
            self._last, self._last_dtypes, self._last_samples = tensors, dtypes, samples
        wanted = b"".join([expected[name] for name in tensors])
        targets = [(dtypes or {}).get(name, t.dtype) for name, t in tensors.items()]
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            if len({(x.device, x.dtype, d) for x, d in zip(samples, targets, strict=True)}) == 1:
                if _joined(samples, targets[0]) == wanted:  # one group: no slicing at all
                    return []
            found = _to_host(samples, targets)
        return sorted(name for name, got in zip(tensors, found, strict=True)
                      if got != expected[name])

    def _samples(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        views: dict[_Key, torch.Tensor] = {}
        samples: list[torch.Tensor] = []
        # vLLM's parameters are a Python tensor subclass: skip its __torch_function__.
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            for tensor in tensors.values():
                if not tensor.is_contiguous():
                    samples.append(_sample(tensor))  # a copy: nothing to keep
                    continue
                key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
                       tensor.device)
                view = self._views.get(key)
                if view is None:
                    view = _sample(tensor)
                views[key] = view
                samples.append(view)
        self._views = views
        return samples

    def clear(self) -> None:
        self._views.clear()
        self._last, self._last_dtypes, self._last_samples = None, None, []


_WIDER: Final = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def holds_exactly(served: torch.dtype, pushed: torch.dtype) -> bool:
    """Whether a tensor served as ``served`` holds every ``pushed`` value exactly (the same
    dtype, or a wider float: then its fingerprint as ``pushed`` is the pushed one's)."""
    return served == pushed or served in _WIDER.get(pushed, ())


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """The fingerprint of each tensor (see the module doc)."""
    return Fingerprinter()(tensors)


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """The sampled elements: a strided view of a contiguous tensor (no copy)."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n <= SAMPLES:
        return flat
    return flat[:: n // SAMPLES][:SAMPLES]


def _joined(samples: list[torch.Tensor], as_dtype: torch.dtype) -> bytes:
    """The bytes of every sample in order, as ``as_dtype`` (one gather, one copy to the
    host)."""
    joined = torch.cat(samples).cpu() if len(samples) > 1 else samples[0].cpu()
    if joined.dtype != as_dtype:
        joined = joined.to(as_dtype)
    return joined.contiguous().view(torch.uint8).numpy().tobytes()


def _to_host(samples: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[bytes]:
    """Each sample's bytes as ``dtypes[i]``, in order: one gather, one copy to the host and
    one conversion to bytes per (device, dtype, as dtype), then slices (no torch call per
    tensor: a 7B model has 339)."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, (sample, dtype) in enumerate(zip(samples, dtypes, strict=True)):
        groups.setdefault((sample.device, sample.dtype, dtype), []).append(i)
    out: list[bytes] = [b""] * len(samples)
    for (_device, _dtype, as_dtype), members in groups.items():
        parts = [samples[i] for i in members]
        blob = _joined(parts, as_dtype)
        width = as_dtype.itemsize
        at = 0
        for i, part in zip(members, parts, strict=True):
            end = at + part.numel() * width
            out[i] = blob[at:end]
            at = end
    return out
