"""One-copy pushes: receivers read the trainer's own storages through CUDA IPC handles.

``SharedStorages`` is the sender's cache of exported storages; ``WeightSender.push`` with
``one_copy=True`` sends what ``share`` returns in one message.

Invariants:

* only contiguous tensors on the sender's device are shared (``check_shareable``, before any
  message);
* a storage is exported once while it is kept, under a stable id (a receiver maps a descriptor
  once); keeping its tensor keeps its address from reuse by another storage;
* after a push, only the storages it listed are kept (receivers release the others then);
* a push of the same names as the last one, each tensor at the same address with the same
  shape and dtype, reuses the last push's message: its bytes are where that message says.
  The storages the last push listed are kept, so their memory stays allocated and nothing
  else can be allocated at those addresses; a tensor there is that memory, whatever storage
  object views it. (A kept storage resized in place, ``untyped_storage().resize_``, would
  break this: one-copy pushes need persistent tensors. Contiguity is checked before.) Each
  list ``share`` builds gets a new ``layout`` id (never reused), by which a receiver that
  holds it can be sent it again (``wire.Shared.repeat``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from asyncroll.transport import wire
from asyncroll.transport.backends import Backend, CudaIpcBackend
from asyncroll.transport.packing import dtype_name

__all__ = ["SharedStorages", "StorageKey", "check_shareable"]

StorageKey = tuple[str, int, int]
"""A storage by (device, address, bytes)."""
_Shared = tuple[list[wire.Storage], list[wire.SharedEntry], set[StorageKey]]
_Signature = tuple[list[str], list[int], list[torch.dtype], list[torch.Size]]
"""A push's names, and its tensors' addresses, dtypes and shapes."""
_ADDRESS = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def check_shareable(backend: Backend, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless every tensor can be read in place by the receivers."""
    if not isinstance(backend, CudaIpcBackend):
        raise ValueError(f"one-copy pushes need the cuda_ipc backend, not {backend.name}")
    for name, tensor in tensors.items():
        if tensor.device != backend.device:
            raise ValueError(
                f"one-copy push: {name!r} is on {tensor.device}, the sender on {backend.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"one-copy push: {name!r} is not contiguous")


class SharedStorages:
    """The trainer's storages exported for one-copy pushes, kept between pushes."""

    def __init__(self) -> None:
        self._kept: dict[StorageKey, tuple[int, torch.Tensor, bytes]] = {}
        """(id, the storage as a uint8 tensor, its descriptor) by key."""
        self._ids = 0
        self.layout = 0
        """The id of the list ``share`` returned last (0: none yet)."""
        self._last: tuple[_Signature, _Shared] | None = None
        """The last push's signature and what ``share`` made of it (7B: 339 tensors; on the
        CPU machine 0.9 ms of Python to share them again; the signature's reads and their
        comparison, one C loop each, 0.1 ms)."""

    def __len__(self) -> int:
        return len(self._kept)

    def __repr__(self) -> str:
        return f"<SharedStorages kept={len(self._kept)}>"

    def share(self, backend: CudaIpcBackend, tensors: Mapping[str, torch.Tensor]) -> _Shared:
        """The storages and entries of one shared push (exporting new storages), and the keys
        it uses."""
        signature = _signature(tensors)
        if self._last is not None and self._last[0] == signature:
            return self._last[1]
        shared = self._share(backend, tensors)
        self._last = (signature, shared)
        self.layout += 1
        return shared

    def _share(self, backend: CudaIpcBackend, tensors: Mapping[str, torch.Tensor]) -> _Shared:
        storages: dict[int, wire.Storage] = {}
        entries = []
        used = set()
        for name, tensor in tensors.items():
            if tensor.numel() == 0:  # no bytes, no storage to share
                entries.append(
                    wire.SharedEntry(
                        name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                        storage=-1, offset=0, nbytes=0,
                    )
                )
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
            if key not in self._kept:
                self._ids += 1
                whole, descriptor = backend.export_storage(tensor)
                self._kept[key] = (self._ids, whole, descriptor)
            ident, whole, descriptor = self._kept[key]
            used.add(key)
            storages.setdefault(
                ident, wire.Storage(id=ident, descriptor=descriptor, nbytes=whole.numel())
            )
            entries.append(
                wire.SharedEntry(
                    name=name,
                    dtype=dtype_name(tensor.dtype),
                    shape=list(tensor.shape),
                    storage=ident,
                    offset=int(tensor.storage_offset()) * tensor.element_size(),
                    nbytes=tensor.numel() * tensor.element_size(),
                )
            )
        return list(storages.values()), entries, used

    def keep_only(self, used: set[StorageKey]) -> None:
        """Forget every storage not in ``used`` (the receivers release those the push omits)."""
        for key in [key for key in self._kept if key not in used]:
            del self._kept[key]
            self._last = None  # its storages may be gone: share again

    def clear(self) -> None:
        self._kept.clear()
        self._last = None


def _signature(tensors: Mapping[str, torch.Tensor]) -> _Signature:
    values = list(tensors.values())
    return (
        list(tensors),
        list(map(_ADDRESS, values)),
        list(map(_DTYPE, values)),
        list(map(_SHAPE, values)),
    )
