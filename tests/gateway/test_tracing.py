"""Tracing through the real gateway and a consumer: one request is one trace whose spans
cover the gateway and the worker, with their parents (an in-memory exporter)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cluster.runtime import tracing
from cluster.runtime.tracing import Tracing
from tests.gateway.conftest import Gateway
from tests.gateway.test_keepalive import BODY, STANDARD, slot_held, stack
from tests.polling import eventually

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
GATEWAY_SPANS = {"chat", "admission", "enqueue", "queue wait"}
WORKER_SPANS = {"job", "prefill"}


@dataclass
class Traced:
    gateway: Gateway
    exporter: InMemorySpanExporter


@pytest.fixture(scope="module")
async def traced(redis_url: str, model_path: str) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The gateway and the worker of this process both take it up (CHARSERVE_TRACING=otlp
    # would build an exporting one).
    tracing.install(Tracing(provider))
    try:
        async with stack(redis_url, model_path, tracing="otlp") as gw:
            yield Traced(gw, exporter)
    finally:
        tracing.install(None)
        provider.shutdown()


@pytest.fixture
async def http(traced: Traced) -> AsyncIterator[httpx.AsyncClient]:
    traced.exporter.clear()
    async with httpx.AsyncClient(base_url=traced.gateway.base_url, timeout=30) as client:
        yield client


async def spans_of(traced: Traced, request_id: str, names: set[str]) -> list[ReadableSpan]:
    """Every finished span of the trace whose gateway span is ``request_id``'s, once the
    spans ``names`` are all there (the worker's ends after the client got its reply)."""

    def found() -> list[ReadableSpan]:
        spans = traced.exporter.get_finished_spans()
        roots = [s for s in spans if (s.attributes or {}).get("charserve.request_id") == request_id]
        ids = {s.context.trace_id for s in roots}
        return [s for s in spans if s.context.trace_id in ids]

    async def complete() -> bool:
        return names <= {s.name for s in found()}

    await eventually(complete, timeout_s=10)
    return found()


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def check_tree(spans: Sequence[ReadableSpan], traced: Traced, request_id: str) -> ReadableSpan:
    """The shape every request's trace has; its gateway span."""
    chat, job = one(spans, "chat"), one(spans, "job")
    assert chat.kind == SpanKind.SERVER and job.kind == SpanKind.CONSUMER
    assert len({s.context.trace_id for s in spans}) == 1
    for name in ("admission", "enqueue", "queue wait", "job"):
        assert parent_of(one(spans, name)) == chat.context.span_id, name
    assert parent_of(one(spans, "prefill")) == job.context.span_id
    # The gateway's steps are in order, inside its span.
    admission, enqueue, wait = (one(spans, n) for n in ("admission", "enqueue", "queue wait"))
    assert chat.start_time is not None and chat.end_time is not None
    assert admission.end_time is not None and enqueue.start_time is not None
    assert enqueue.end_time is not None and wait.start_time is not None
    assert chat.start_time <= admission.start_time  # type: ignore[operator]
    assert admission.end_time <= enqueue.start_time and enqueue.end_time <= wait.start_time
    assert "first token" in [e.name for e in chat.events]
    assert {"first chunk published", "generation end"} <= {e.name for e in job.events}
    chat_attrs: dict[str, Any] = dict(chat.attributes or {})
    assert chat_attrs["charserve.outcome"] == "completed"
    assert chat_attrs["gen_ai.usage.output_tokens"] == 3
    assert dict(job.attributes or {})["charserve.request_id"] == request_id
    assert job.status.status_code == StatusCode.UNSET == chat.status.status_code
    # The engine was handed the worker span's context (vLLM's spans would nest under it).
    engine_job = traced.gateway.engine.jobs[request_id]
    ctx = job.context
    flags = int(ctx.trace_flags)
    assert engine_job.traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags:02x}"
    return chat


async def test_a_streamed_request_is_one_trace_under_the_clients(
    traced: Traced, http: httpx.AsyncClient
) -> None:
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    resp = await http.post("/v1/chat/completions", json=BODY, headers={"traceparent": parent})
    assert resp.status_code == 200 and "[DONE]" in resp.text
    request_id = resp.headers["x-request-id"]
    spans = await spans_of(traced, request_id, GATEWAY_SPANS | WORKER_SPANS)
    chat = check_tree(spans, traced, request_id)
    assert f"{chat.context.trace_id:032x}" == CLIENT_TRACE
    assert chat.parent is not None and f"{chat.parent.span_id:016x}" == CLIENT_SPAN


async def test_a_request_without_trace_headers_starts_its_own_trace(
    traced: Traced, http: httpx.AsyncClient
) -> None:
    body = {**BODY, "stream": False}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    request_id = resp.headers["x-request-id"]
    spans = await spans_of(traced, request_id, GATEWAY_SPANS | WORKER_SPANS)
    chat = check_tree(spans, traced, request_id)
    assert chat.parent is None and f"{chat.context.trace_id:032x}" != CLIENT_TRACE


async def test_a_queued_stream_records_its_wait_and_its_keep_alives(
    traced: Traced, http: httpx.AsyncClient
) -> None:
    gw = traced.gateway
    async with slot_held(gw, http):
        reader = asyncio.create_task(http.post("/v1/chat/completions", json=BODY, headers=STANDARD))
        await asyncio.sleep(1.0)
    resp = await reader
    request_id = resp.headers["x-request-id"]
    spans = await spans_of(traced, request_id, GATEWAY_SPANS | WORKER_SPANS)
    chat = check_tree(spans, traced, request_id)
    assert "keep-alives started" in [e.name for e in chat.events]
    wait = one(spans, "queue wait")
    assert wait.end_time is not None and wait.start_time is not None
    assert (wait.end_time - wait.start_time) / 1e9 >= 0.8


async def test_a_refused_request_is_an_error_span_without_a_job(
    traced: Traced, http: httpx.AsyncClient
) -> None:
    resp = await http.post("/v1/chat/completions", json={**BODY, "model": "nope"})
    assert resp.status_code == 404
    request_id = resp.headers["x-request-id"]
    spans = await spans_of(traced, request_id, {"chat"})
    (chat,) = spans
    assert chat.status.status_code == StatusCode.ERROR
    attrs: dict[str, Any] = dict(chat.attributes or {})
    assert attrs["http.response.status_code"] == 404 and attrs["error.type"] == "model_not_found"
