"""The gate an engine adapter's requests wait at while the engine is paused, asleep or held.

Open or closed, like an ``asyncio.Event``; and a request waiting there can be aborted: its
``admit`` returns False, so it ends with ``finish_reason="abort"`` and no tokens without ever
reaching the engine (``aborted_segment``). Otherwise an abort meant for it would miss (the
engine does not know the request yet) and it would run in full once the gate opened.

The gate also paces: at most ``per_turn`` requests pass in one turn of the event loop. A
rollout's callers start together, and each request admitted goes on at once to vLLM's front
end in the same turn (about 0.12 ms of the loop each on an H200 host: 189 of them made one
turn of 23 ms, issue 42); the rest pass over the turns that follow, in order, and can be
aborted while they wait.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from asyncroll.types import Segment

__all__ = ["AdmissionGate", "aborted_segment"]


class AdmissionGate:
    """Where an engine's requests wait to be admitted; ``abort`` lets waiting ones go.
    ``per_turn``: at most so many admitted in one turn of the loop (None: no bound)."""

    def __init__(self, per_turn: int | None = None) -> None:
        if per_turn is not None and per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, not {per_turn}")
        self._open = asyncio.Event()
        self._open.set()
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self.per_turn = per_turn
        self._used = 0
        """Requests admitted in this turn of the loop."""
        self._next: collections.deque[asyncio.Future[None]] = collections.deque()
        """Requests waiting for a turn's budget, first come first: each turn's goes to them
        before any request that comes later."""
        self._turn_due = False
        """``_new_turn`` is scheduled."""
        self.deferred = 0
        """Times a request waited a turn for the budget (statistics)."""

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
        """Wait until the gate is open and this turn's budget has room: True; or until
        ``abort`` names ``request_id``: False.

        ``request_id`` must be unique among the requests waiting (an engine's live ids are)."""
        if self._open.is_set() and self._take():
            return True
        loop = asyncio.get_running_loop()
        aborted: asyncio.Future[None] = loop.create_future()
        self._waiting[request_id] = aborted
        try:
            # Open when we run again, not just opened: a gate opened and closed again in one
            # loop turn (a resume and the next pause) keeps its waiters.
            while True:
                if self._open.is_set():
                    if self._take():
                        return True
                    turn: asyncio.Future[None] = loop.create_future()
                    self._next.append(turn)
                    self.deferred += 1
                    self._schedule_turn()
                    await turn  # admitted by ``_new_turn`` (an abort meanwhile: seen here)
                    if aborted.done():
                        return False
                    if self._open.is_set():
                        return True
                    continue  # closed meanwhile: wait for it to open again
                opened = asyncio.ensure_future(self._open.wait())
                try:
                    await asyncio.wait((opened, aborted), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    opened.cancel()
                if aborted.done():
                    return False
        finally:
            del self._waiting[request_id]

    def _take(self) -> bool:
        """One of this turn's admissions for a request that did not wait, if any is left and
        no request waits for one."""
        if self.per_turn is None:
            return True
        if self._next or self._used >= self.per_turn:
            return False
        self._used += 1
        self._schedule_turn()  # the budget comes back as the next turn begins
        return True

    def _schedule_turn(self) -> None:
        if not self._turn_due:
            self._turn_due = True
            asyncio.get_running_loop().call_soon(self._new_turn)

    def _new_turn(self) -> None:
        """A new turn's budget: to the requests waiting first, in the order they came."""
        self._turn_due = False
        self._used = 0
        assert self.per_turn is not None
        while self._next and self._used < self.per_turn:
            turn = self._next.popleft()
            if not turn.done():  # (a waiter cancelled meanwhile)
                turn.set_result(None)
                self._used += 1
        if self._used or self._next:
            self._schedule_turn()

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
