"""The weight sender's staging buffers: allocated once, reused by every push, freed when safe.

``Staging`` owns the buffers a push packs its buckets into, the one thread that packs into
them, the buckets of the last push's layout with each buffer's typed views for them, and who
holds each buffer (the receivers sent its bucket that have not acked it yet).

Invariants:

* the buffers are allocated once, one at a time: a failure frees those made before it;
* a buffer is held from its bucket's signal until every receiver it was sent to has acked that
  bucket or left; an ack of another push or bucket changes nothing;
* the views belong to the last push's layout (a push of another layout drops them), and they
  go before the buffers;
* once released, the packing thread has stopped: no copy is queued into a buffer after that;
* a buffer that copies may still be queued into is never freed (``_QUARANTINE``).
"""

from __future__ import annotations

import logging
from collections.abc import Set
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncroll.transport.backends import Backend, StagingBuffer
from asyncroll.transport.openmp import one_openmp_thread
from asyncroll.transport.plan import Bucket, GroupOf, TensorMeta, plan_buckets

__all__ = ["Staging", "Views"]

log = logging.getLogger(__name__)

Views = dict[tuple[int, int, torch.dtype, tuple[int, ...]], torch.Tensor]
"""One buffer's typed views for the slots of a layout (``pack_bucket``)."""

_QUARANTINE: list[StagingBuffer] = []
"""Staging buffers closed with copies still queued into them: never freed (see ``release``)."""


class Staging:
    """The sender's staging buffers, their packing thread, views and holders."""

    def __init__(
        self,
        backend: Backend,
        *,
        nonce: str,
        count: int,
        bucket_bytes: int,
        group_of: GroupOf,
        close_timeout: float,
    ) -> None:
        self._backend = backend
        self._bucket_bytes = bucket_bytes
        self._group_of = group_of
        self._close_timeout = close_timeout
        self.count = count
        """Buffers allocated (they stay counted once released)."""
        self._holders: list[set[bytes]] = [set() for _ in range(count)]
        self._holding: list[tuple[int, int] | None] = [None] * count
        """Per buffer, the (push, bucket) it holds."""
        self._loaders: list[list[bytes]] = [[] for _ in range(count)]
        self._plan: tuple[tuple[TensorMeta, ...], list[Bucket]] | None = None
        """The last push's layout and its buckets: the next push of the same layout reuses
        them, and the views below."""
        self.views: list[Views] = [{} for _ in range(count)]
        """Per buffer, its typed views for the slots of the last layout."""
        self.buffers: list[StagingBuffer] = []
        self.packer = ThreadPoolExecutor(1, thread_name_prefix="asyncroll-pack",
                                         initializer=one_openmp_thread)
        """The one thread that packs into the buffers (FIFO); on the host its copies run
        single-threaded: an OpenMP team of its own would slow the trainer's
        (``one_openmp_thread``)."""
        try:
            for i in range(count):  # one at a time: a failure releases those made before it
                self.buffers.append(backend.allocate(nonce=nonce, index=i, nbytes=bucket_bytes))
            self.copy_events = backend.export_copy_events(count) if backend.async_copies else []
            """Handles of our per-buffer copy events, for the welcome ([]: none)."""
        except BaseException:
            self.release()
            raise

    def __repr__(self) -> str:
        return f"<Staging {len(self.buffers)} of {self.count}x{self._bucket_bytes}>"

    def descriptors(self) -> list[bytes]:
        """How a receiver maps each buffer."""
        return [buffer.descriptor for buffer in self.buffers]

    def plan_for(self, metas: tuple[TensorMeta, ...]) -> list[Bucket]:
        """The buckets of a push of ``metas`` (the last push's, when the layout is the same)."""
        if self._plan is None or self._plan[0] != metas:
            buckets = plan_buckets(metas, bucket_bytes=self._bucket_bytes, group_of=self._group_of)
            self._plan = (metas, buckets)
            for views in self.views:
                views.clear()
        return self._plan[1]

    # ---------------------------------------------------------------- who holds each buffer

    def hold(
        self, index: int, *, push: int, bucket: int, holders: set[bytes], loaders: list[bytes]
    ) -> None:
        """Buffer ``index`` now holds ``bucket`` of ``push`` until each of ``holders`` acks it;
        ``loaders`` are the receivers whose load events must fire before it is rewritten."""
        self._holding[index] = (push, bucket)
        self._holders[index] = holders
        self._loaders[index] = loaders

    def acked(self, identity: bytes, *, push: int, bucket: int) -> None:
        index = bucket % len(self._holders)
        if self._holding[index] == (push, bucket):
            self._holders[index].discard(identity)

    def left(self, identity: bytes) -> None:
        """A receiver left: it holds no buffer any more."""
        for holders in self._holders:
            holders.discard(identity)

    def is_free(self, index: int) -> bool:
        return not self._holders[index]

    def holders(self, index: int) -> Set[bytes]:
        return self._holders[index]

    def holding(self, index: int) -> tuple[int, int] | None:
        """The (push, bucket) that buffer ``index`` holds, if any ever."""
        return self._holding[index]

    def loaders(self, index: int) -> list[bytes]:
        """The receivers last sent buffer ``index`` whose load events it waits for."""
        return self._loaders[index]

    # ---------------------------------------------------------------- the buffers' end

    def unlink(self) -> None:
        """Unlink the buffers' names (receivers keep their mappings)."""
        for buffer in self.buffers:
            buffer.unlink()

    def release(self) -> None:
        """Stop the packing thread, then free the buffers (unless copies are still queued into
        them). Synchronous and idempotent."""
        self.packer.shutdown(wait=True)  # no copies are queued after this
        self.views, self._plan = [], None  # views of the buffers go before the buffers
        if self._copies_pending():
            # Copies into these buffers are still queued (a push was cut short while the device
            # was busy); were the memory given back to the allocator, they could write into
            # someone else's tensor.
            log.warning("keeping %d staging buffers with copies still queued", len(self.buffers))
            _QUARANTINE.extend(self.buffers)
        else:
            for buffer in self.buffers:
                buffer.close()
        self.buffers = []

    def _copies_pending(self) -> bool:
        """Whether copies into the buffers are still running after ``close_timeout``."""
        if not self.buffers or not self._backend.async_copies:
            return False
        try:
            self._backend.finish_copies(self._backend.mark_copies(), within=self._close_timeout)
        except Exception:  # a timeout, or a broken device: either way, do not free
            return True
        return False
