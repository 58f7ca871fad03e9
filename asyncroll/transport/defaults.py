"""The staging-buffer size of each backend, in one table."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES: Final = {
    "shm": 64 << 20,
    "cuda_ipc": 512 << 20,
    "sharded_cuda_ipc": 1 << 30,
    "broadcast": 1 << 30,
    "broadcast_cpu": 64 << 20,
}
"""Staging-buffer size by backend: 64 MiB saturates a CPU memcpy (and gloo); on a GPU a bucket
has a fixed cost of about half a millisecond (a round trip with Python on both ends), so
buckets are larger (docs/performance.md, "The transport alone": 512 MiB reaches 1.5-3x the
rate of 128 MiB on an H100; over NCCL between two GPUs 1 GiB buckets moved a 7B update 1-3 ms
faster than 512 MiB ones, the size vLLM's own NCCL path packs by default). A sharded trainer's
ranks (``DistributedWeightPusher`` on GPUs) gather or exchange a bucket's tensors before they
pack it, one collective call a bucket: at 7B (two H200s) 1 GiB buckets were faster than 512 MiB
ones in every variant of the same runs (27.6-29.8 against 30.0-41.2 ms); at 1.5B faster for
whole tensors, slower for column blocks, and not run for the default's rows ("Sharded trainer
into TP engines"). The sender's and the broadcast's own signatures default to ``cuda_ipc``'s; the
pushers pick by backend."""
