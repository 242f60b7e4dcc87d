"""TurnBatch: the calls of one event-loop turn reach one send, and every caller is answered."""

from __future__ import annotations

import asyncio

import pytest

from cluster.wire.turns import Call, TurnBatch


async def test_the_calls_of_one_turn_go_in_one_send_each_with_its_own_reply() -> None:
    sends: list[list[int]] = []

    async def send(calls: list[Call[int]]) -> None:
        sends.append([c.item for c in calls])
        for c in calls:
            c.answer(ValueError(c.item) if c.item == 2 else c.item * 10)

    batch: TurnBatch[int] = TurnBatch(send)
    tasks = [asyncio.create_task(batch.call(i)) for i in range(4)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert sends == [[0, 1, 2, 3]]
    assert results[:2] == [0, 10] and results[3] == 30
    assert isinstance(results[2], ValueError)
    # A later turn's call is a send of its own.
    assert await batch.call(7) == 70
    assert sends[-1] == [7]


async def test_a_caller_that_left_is_seen_as_left_and_not_answered() -> None:
    seen: list[bool] = []
    release = asyncio.Event()

    async def send(calls: list[Call[int]]) -> None:
        await release.wait()
        seen.extend(c.left for c in calls)
        for c in calls:
            c.answer(c.item)

    batch: TurnBatch[int] = TurnBatch(send)
    stays = asyncio.create_task(batch.call(1))
    leaves = asyncio.create_task(batch.call(2))
    await asyncio.sleep(0.01)
    leaves.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await stays == 1
    assert seen == [False, True]
    with pytest.raises(asyncio.CancelledError):
        await leaves


async def test_no_caller_waits_when_the_send_answers_nobody_or_is_cancelled() -> None:
    async def silent(calls: list[Call[int]]) -> None:
        return None

    lone = TurnBatch(silent)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(lone.call(1), 5)

    hang = asyncio.Event()

    async def never(calls: list[Call[int]]) -> None:
        await hang.wait()

    stuck: TurnBatch[int] = TurnBatch(never)
    tasks = [asyncio.create_task(stuck.call(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    for flush in list(stuck._sending):  # the process stopping
        flush.cancel()
    done, pending = await asyncio.wait(tasks, timeout=5)
    assert not pending and all(t.cancelled() for t in done)
