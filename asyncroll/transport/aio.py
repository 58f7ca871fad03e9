"""Small asyncio helpers the transport and the update sequence share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

__all__ = ["inline", "near", "shielded"]

_T = TypeVar("_T")


async def shielded(awaitable: Awaitable[_T]) -> _T:
    """Run ``awaitable`` to completion even if our caller is cancelled meanwhile (cleanup I/O,
    a label that must land with the weights); then let the cancellation propagate, whatever
    the awaitable did."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


INLINE_HOST_BYTES = 1 << 20
"""Host work on fewer bytes runs on the loop (``near``): a thread's hop costs more."""


async def near(device: torch.device, work: Callable[[], _T], nbytes: int = 0) -> _T:
    """``work()`` on ``nbytes`` of tensors on ``device``, run to completion (shielded, as
    ``shielded``): on the loop for a GPU (kernel launches and a sync, less than a thread's
    hop) or for a few bytes (``INLINE_HOST_BYTES``), else in a thread (where the host does
    the work, which would hold the loop)."""
    if inline(device, nbytes):
        return work()
    return await shielded(asyncio.to_thread(work))


def inline(device: torch.device, nbytes: int) -> bool:
    """Whether ``near`` runs work on ``nbytes`` of ``device`` on the loop."""
    return device.type == "cuda" or nbytes < INLINE_HOST_BYTES
