"""The ack batcher: jobs that finish together are acked in one call, each caller gets
its own job's result, and a failed call fails every ack in it."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from workers.loop import acks
from workers.loop.acks import AckBatcher


class Queue:
    """Records each call; holds it open until ``release`` is set; refuses ids in ``lost``."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.lost: set[str] = set()
        self.fail: Exception | None = None

    async def ack_many(self, worker_id: str, finished: list[tuple[str, int]]) -> list[bool]:
        assert worker_id == "w1"
        self.calls.append(list(finished))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [job_id not in self.lost for job_id, _ in finished]


async def test_acks_that_arrive_together_go_in_one_call() -> None:
    queue = Queue()
    queue.lost = {"j3"}
    batcher = AckBatcher(queue, "w1")
    results = await asyncio.gather(*(batcher.ack(f"j{i}", i) for i in range(31)))
    assert queue.calls == [[(f"j{i}", i) for i in range(31)]]
    assert results == [i != 3 for i in range(31)]


async def test_acks_arriving_during_a_call_go_in_the_next_one() -> None:
    queue = Queue()
    queue.release.clear()
    batcher = AckBatcher(queue, "w1")
    first = asyncio.create_task(batcher.ack("a", 1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert queue.calls == [[("a", 1)]]  # a lone ack is sent at once
    later = [asyncio.create_task(batcher.ack(f"b{i}", 2)) for i in range(3)]
    await asyncio.sleep(0)
    assert len(queue.calls) == 1
    queue.release.set()
    assert await first
    assert all(await asyncio.gather(*later))
    assert queue.calls[1] == [(f"b{i}", 2) for i in range(3)]
    assert len(queue.calls) == 2


async def test_a_call_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acks, "MAX_ACKS_PER_CALL", 4)
    queue = Queue()
    batcher = AckBatcher(queue, "w1")
    assert all(await asyncio.gather(*(batcher.ack(f"j{i}") for i in range(10))))
    assert [len(c) for c in queue.calls] == [4, 4, 2]


async def test_a_failed_call_fails_each_ack_in_it_and_not_the_next() -> None:
    queue = Queue()
    queue.fail = RedisConnectionError("gone")
    batcher = AckBatcher(queue, "w1")
    outcomes = await asyncio.gather(batcher.ack("a"), batcher.ack("b"), return_exceptions=True)
    assert [type(o) for o in outcomes] == [RedisConnectionError, RedisConnectionError]
    queue.fail = None
    assert await batcher.ack("c")
    await batcher.close()


async def test_a_cancelled_waiter_does_not_stop_the_others() -> None:
    queue = Queue()
    queue.release.clear()
    batcher = AckBatcher(queue, "w1")
    gone = asyncio.create_task(batcher.ack("a"))
    kept = asyncio.create_task(batcher.ack("b"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    gone.cancel()
    queue.release.set()
    assert await kept
    with pytest.raises(asyncio.CancelledError):
        await gone
    await batcher.close()
    assert queue.calls == [[("a", 0), ("b", 0)]]
