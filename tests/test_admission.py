"""The admission gate engines share: open/closed, and aborts of requests waiting there."""

from __future__ import annotations

import asyncio

from asyncroll.admission import AdmissionGate, aborted_segment


async def _waiting(gate: AdmissionGate, count: int) -> None:
    for _ in range(100):  # each waiter registers in its task's first step
        if gate.waiting >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{count} never waited")


async def test_an_open_gate_admits_at_once_and_a_closed_one_when_it_opens() -> None:
    gate = AdmissionGate()
    assert await gate.admit("a") and gate.waiting == 0
    gate.clear()
    waiter = asyncio.ensure_future(gate.admit("b"))
    await _waiting(gate, 1)
    assert not waiter.done()
    gate.set()
    assert await waiter and gate.waiting == 0


async def test_abort_lets_only_the_named_waiters_go_and_returns_the_rest() -> None:
    gate = AdmissionGate()
    gate.clear()
    a, b = asyncio.ensure_future(gate.admit("a")), asyncio.ensure_future(gate.admit("b"))
    await _waiting(gate, 2)
    assert gate.abort(["a", "running", "a"]) == ["running"]  # twice is once
    assert await a is False and not b.done() and gate.waiting == 1
    gate.set()
    assert await b is True


async def test_a_cancelled_waiter_leaves_the_gate() -> None:
    gate = AdmissionGate()
    gate.clear()
    waiter = asyncio.ensure_future(gate.admit("a"))
    await _waiting(gate, 1)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled() and gate.waiting == 0
    assert gate.abort(["a"]) == ["a"]  # not waiting any more: the engine's to abort


def test_the_segment_of_a_request_aborted_at_the_gate_is_empty() -> None:
    segment = aborted_segment("r", 4)
    assert segment.finish_reason == "abort" and segment.num_prompt_tokens == 4
    assert segment.token_ids == segment.log_probs == segment.global_steps == ()
