"""What one push of the weight sender reports: its totals, and per bucket where its time went."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PushReport", "SenderBucketTimes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderBucketTimes:
    """One bucket's way through the sender, as ``time.perf_counter()`` stamps (on Linux one
    monotonic clock for every process of the machine: they line up with the receivers'
    ``ReceiverBucketTimes``)."""

    bucket: int
    waited: float
    """The wait for a free buffer began."""
    free: float
    """Every receiver of the buffer's last bucket had acked it."""
    loads_done: float
    """Their reads of it were done on the device (polled)."""
    queued: float
    """Our copies into it were queued."""
    copied: float
    """They were done (the bucket may be signalled)."""
    signalled: float
    """It was sent to every receiver."""
    acked: float = 0.0
    """Every receiver's ack of it was seen (a one-copy push's one message; 0: not stamped)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PushReport:
    """What one push moved and where its time went."""

    version: int
    bytes: int
    buckets: int
    tensors: int
    receivers: int
    seconds: float
    pack_seconds: float
    """Time packing buckets into staging buffers (in the worker thread)."""
    wait_seconds: float
    """Time waiting for receivers to release a buffer (and for the final acks)."""
    timeline: tuple[SenderBucketTimes, ...] = ()
    """Per bucket, where its time went (a one-copy push: its one message, as bucket 0)."""
    began: float = 0.0
    """When the push began (``time.perf_counter()``: it lines up with the receivers' stamps)."""
    ended: float = 0.0
    """When its End was sent to every receiver (0: not stamped)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
