"""The hand-off of a claim's jobs to vLLM's engine core (workers/engines/vllm_engine.py,
``CoreHandOff``): the requests added in one loop turn are sent together, after the last
is prepared. No engine is started; the engine core client is a recorder."""

from __future__ import annotations

import asyncio

from vllm.v1.engine.async_llm import AsyncLLM

from workers.engines.vllm_engine import CoreHandOff


class Client:
    """Stands in for vLLM's engine core client: records what is sent, in order."""

    def __init__(self, events: list[str], fail: frozenset[str] = frozenset()) -> None:
        self.events = events
        self.fail = fail

    async def add_request_async(self, request: str) -> None:
        if request in self.fail:
            raise RuntimeError(f"engine core gone ({request})")
        self.events.append(f"send {request}")


async def _job(client: Client, events: list[str], request: str) -> None:
    # As AsyncLLM does for each job: prepare it (its processors), then add it.
    events.append(f"prepare {request}")
    await client.add_request_async(request)


async def test_a_turns_requests_are_sent_together_after_the_last_is_prepared() -> None:
    events: list[str] = []
    client = Client(events)
    CoreHandOff(client)
    jobs = [asyncio.create_task(_job(client, events, f"r{i}")) for i in range(3)]
    await asyncio.gather(*jobs)
    assert events == [
        "prepare r0",
        "prepare r1",
        "prepare r2",
        "send r0",
        "send r1",
        "send r2",
    ]
    # A job alone, later, is sent by itself.
    await _job(client, events, "r3")
    assert events[-2:] == ["prepare r3", "send r3"]


async def test_a_job_cancelled_before_the_send_is_never_sent() -> None:
    events: list[str] = []
    client = Client(events)
    CoreHandOff(client)
    stays = asyncio.create_task(_job(client, events, "stays"))
    leaves = asyncio.create_task(_job(client, events, "leaves"))
    await asyncio.sleep(0)  # both prepared, waiting for the turn's send
    leaves.cancel()
    await asyncio.gather(stays, leaves, return_exceptions=True)
    assert leaves.cancelled()
    assert [e for e in events if e.startswith("send")] == ["send stays"]


async def test_a_failed_send_reaches_its_own_job_and_the_others_still_go() -> None:
    events: list[str] = []
    client = Client(events, fail=frozenset({"r1"}))
    CoreHandOff(client)
    results = await asyncio.gather(
        *(_job(client, events, f"r{i}") for i in range(3)), return_exceptions=True
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], RuntimeError)
    assert [e for e in events if e.startswith("send")] == ["send r0", "send r2"]


def test_the_pinned_vllm_adds_requests_through_the_client_method_replaced() -> None:
    # The AsyncLLM of the pinned vLLM (not started); a version that stopped using the
    # method would leave the hand-off doing nothing, so the engine warns instead.
    llm = AsyncLLM.__new__(AsyncLLM)
    llm.engine_core = Client([])
    assert CoreHandOff.applies_to(llm)

    class Renamed:
        engine_core = Client([])

        async def _add_request(self, request: str) -> None:
            await self.engine_core.add_request_async(request)

    class Elsewhere(Renamed):
        async def _add_request(self, request: str) -> None:
            await self.engine_core.send(request)  # type: ignore[attr-defined]

    assert CoreHandOff.applies_to(Renamed())
    assert not CoreHandOff.applies_to(Elsewhere())
