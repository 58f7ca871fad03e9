"""The gate an engine adapter's requests wait at while the engine is paused, asleep or held.

Open or closed, like an ``asyncio.Event``; and a request waiting there can be aborted: its
``admit`` returns False, so it ends with ``finish_reason="abort"`` and no tokens without ever
reaching the engine (``aborted_segment``). Otherwise an abort meant for it would miss (the
engine does not know the request yet) and it would run in full once the gate opened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asyncroll.types import Segment

__all__ = ["AdmissionGate", "aborted_segment"]


class AdmissionGate:
    """Where an engine's requests wait to be admitted; ``abort`` lets waiting ones go."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._waiting: dict[str, asyncio.Future[None]] = {}

    def __repr__(self) -> str:
        state = "open" if self._open.is_set() else "closed"
        return f"<AdmissionGate {state} waiting={len(self._waiting)}>"

    def set(self) -> None:
        """Open: every waiting request is admitted (the engine's checks come after)."""
        self._open.set()

    def clear(self) -> None:
        """Close: requests from now on wait."""
        self._open.clear()

    def is_set(self) -> bool:
        return self._open.is_set()

    @property
    def waiting(self) -> int:
        """Requests waiting here now."""
        return len(self._waiting)

    async def admit(self, request_id: str) -> bool:
        """Wait until the gate is open: True; or until ``abort`` names ``request_id``: False.

        ``request_id`` must be unique among the requests waiting (an engine's live ids are)."""
        if self._open.is_set():
            return True
        aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = aborted
        try:
            # Open when we run again, not just opened: a gate opened and closed again in one
            # loop turn (a resume and the next pause) keeps its waiters.
            while not self._open.is_set():
                opened = asyncio.ensure_future(self._open.wait())
                try:
                    await asyncio.wait((opened, aborted), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    opened.cancel()
                if aborted.done():
                    return False
            return True
        finally:
            del self._waiting[request_id]

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """End the requests of ``request_ids`` waiting here; returns the others (for the
        engine to abort)."""
        others = []
        for request_id in request_ids:
            aborted = self._waiting.get(request_id)
            if aborted is None:
                others.append(request_id)
            elif not aborted.done():
                aborted.set_result(None)
        return others


def aborted_segment(request_id: str, num_prompt_tokens: int) -> Segment:
    """The segment of a request aborted before it produced a token (before it was admitted,
    or before the engine's first output)."""
    return Segment(
        request_id=request_id,
        token_ids=(),
        log_probs=(),
        global_steps=(),
        finish_reason="abort",
        num_prompt_tokens=num_prompt_tokens,
    )
