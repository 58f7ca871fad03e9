"""The staging-buffer size of each backend, in one table."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES: Final = {
    "shm": 64 << 20,
    "cuda_ipc": 512 << 20,
    "broadcast": 1 << 30,
    "broadcast_cpu": 64 << 20,
}
"""Staging-buffer size by backend: 64 MiB saturates a CPU memcpy (and gloo); on a GPU a bucket
has a fixed cost of about half a millisecond (a round trip with Python on both ends), so
buckets are larger (docs/performance.md, "The transport alone": 512 MiB reaches 1.5-3x the
rate of 128 MiB on an H100; over NCCL between two GPUs 1 GiB buckets moved a 7B update 1-3 ms
faster than 512 MiB ones, the size vLLM's own NCCL path packs by default). The sender's and the
broadcast's own signatures default to ``cuda_ipc``'s; the pushers pick by backend."""
