"""Small asyncio helpers the transport and the update sequence share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["shielded"]

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

