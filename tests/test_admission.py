"""The admission gate engines share: open/closed, and aborts of requests waiting there."""

from __future__ import annotations

import asyncio
import collections

from asyncroll.admission import AdmissionGate


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


async def test_a_gate_opened_and_closed_in_one_turn_keeps_its_waiters() -> None:
    """A resume and the next pause in one loop turn: the waiter is not admitted into the
    paused engine; it is once the gate stays open."""
    gate = AdmissionGate()
    gate.clear()
    waiter = asyncio.ensure_future(gate.admit("a"))
    await _waiting(gate, 1)
    for _ in range(10):  # and it waits on the gate itself by now
        await asyncio.sleep(0)
    gate.set()
    gate.clear()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiter.done() and gate.waiting == 1
    gate.set()
    assert await waiter


async def test_at_most_per_turn_pass_in_one_turn_of_the_loop_in_order_and_all_pass() -> None:
    # A burst of 100 requests in one turn passes 10 a turn, in the order they came; one
    # aborted while it waits for its turn does not pass.
    gate = AdmissionGate(per_turn=10)
    loop = asyncio.get_running_loop()
    turn = 0
    ticking = True

    def tick() -> None:  # counts the loop's turns
        nonlocal turn
        turn += 1
        if ticking:
            loop.call_soon(tick)

    loop.call_soon(tick)
    passed: list[tuple[int, int]] = []

    async def request(i: int) -> bool:
        admitted = await gate.admit(f"r{i}")
        if admitted:
            passed.append((i, turn))
        return admitted

    results = await asyncio.gather(
        *(request(i) for i in range(50)), _abort_later(gate, "r77"),
        *(request(i) for i in range(50, 100)),
    )
    ticking = False
    assert results[:50] + results[51:] == [i != 77 for i in range(100)]
    assert [i for i, _ in passed] == [i for i in range(100) if i != 77]
    per_turn = collections.Counter(t for _, t in passed)
    assert max(per_turn.values()) == 10 and len(per_turn) >= 10
    assert gate.waiting == 0 and gate.deferred > 0


async def _abort_later(gate: AdmissionGate, request_id: str) -> bool:
    await asyncio.sleep(0)
    assert gate.abort([request_id]) == []  # it was waiting for its turn
    return True


async def test_a_paced_gate_closed_meanwhile_holds_its_waiters_until_it_opens() -> None:
    gate = AdmissionGate(per_turn=1)
    first = asyncio.ensure_future(gate.admit("a"))
    second = asyncio.ensure_future(gate.admit("b"))
    await asyncio.sleep(0)
    assert first.done() and not second.done()
    gate.clear()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not second.done()
    gate.set()
    assert await second is True


async def test_requests_waiting_for_a_turn_pass_before_any_that_come_later() -> None:
    # A steady stream of new requests, as many a turn as the budget, never overtakes the ones
    # already waiting: each turn's budget goes to the waiting first, in the order they came.
    gate = AdmissionGate(per_turn=4)
    order: list[int] = []

    async def request(i: int) -> None:
        assert await gate.admit(f"r{i}")
        order.append(i)

    tasks = [asyncio.ensure_future(request(i)) for i in range(8)]  # one turn: 4 wait
    for turn in range(1, 11):  # then 4 more each turn
        await asyncio.sleep(0)
        tasks += [asyncio.ensure_future(request(8 * turn + i)) for i in range(4)]
    await asyncio.gather(*tasks)
    assert order == sorted(order)
