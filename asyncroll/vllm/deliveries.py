"""What a push delivered, summed over an engine's workers (their takes' answers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncroll.interfaces import Delivery

__all__ = ["summed"]


def summed(reports: Sequence[Any]) -> Delivery | None:
    """The workers' deliveries (``asyncroll.vllm.worker.delivery_of``) as one, or None if one is
    missing or they are of different pushes."""
    if not reports or not all(isinstance(r, dict) for r in reports):
        return None
    if len({r["version"] for r in reports}) != 1:
        return None
    return Delivery(
        version=reports[0]["version"],
        workers=len(reports),
        tensors=sum(r["tensors"] for r in reports),
        bytes=sum(r["bytes"] for r in reports),
        verified=sum(r["verified"][0] for r in reports),
        not_verifiable=sum(r["verified"][1] for r in reports),
    )
