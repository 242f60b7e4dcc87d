"""Tracing (cluster/runtime/tracing.py): spans and their parents, the process's one
tracer, nothing loaded while off; and the job's ``traceparent`` on the wire."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cluster.runtime import tracing
from cluster.runtime.tracing import Tracing
from cluster.wire import protocol
from cluster.wire.protocol import Job

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
W3C = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


@pytest.fixture
def exported() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(provider), exporter
    provider.shutdown()


@pytest.fixture
def no_process_tracing() -> Iterator[None]:
    """The process's tracing is off before and after the test."""
    tracing.install(None)
    yield
    traces = tracing.current()
    tracing.install(None)
    if traces is not None:
        traces.shutdown()


def test_a_span_continues_a_traceparent_and_hands_on_its_own(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    traces, exporter = exported
    trace = traces.start("chat", parent=TRACEPARENT, kind="server", attributes={"a": 1})
    child_parent = trace.traceparent
    assert W3C.match(child_parent) and child_parent.split("-")[1] == TRACE_ID
    job = traces.start("job", parent=child_parent, kind="consumer")
    job.end()
    trace.end()
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    chat, worker = by_name["chat"], by_name["job"]
    assert chat.kind == SpanKind.SERVER and chat.attributes == {"a": 1}
    assert chat.parent is not None and f"{chat.parent.span_id:016x}" == PARENT_ID
    assert f"{chat.context.trace_id:032x}" == TRACE_ID == f"{worker.context.trace_id:032x}"
    assert worker.parent is not None and worker.parent.span_id == chat.context.span_id
    assert worker.kind == SpanKind.CONSUMER


def test_trace_state_is_kept_and_a_malformed_parent_starts_a_new_trace(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    traces, exporter = exported
    traces.start("a", parent={"traceparent": TRACEPARENT, "tracestate": "vendor=x"}).end()
    traces.start("b", parent="00-not-a-traceparent").end()
    root = traces.start("c")
    assert W3C.match(root.traceparent)
    root.end()
    a, b, c = sorted(exporter.get_finished_spans(), key=lambda s: s.name)
    assert a.context.trace_state.get("vendor") == "x"
    assert b.parent is None and c.parent is None
    assert f"{b.context.trace_id:032x}" != TRACE_ID


def test_children_events_errors_and_one_end(
    exported: tuple[Tracing, InMemorySpanExporter],
) -> None:
    traces, exporter = exported
    trace = traces.start("chat")
    trace.child("enqueue", 1_000, 2_000, {"x": "y"})
    trace.event("first token", {"n": 1})
    trace.end(error="boom")
    trace.end()  # a second end (and a late child) change nothing
    trace.child("late", 3_000)
    assert not trace.recording
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"chat", "enqueue"}
    enqueue, chat = spans["enqueue"], spans["chat"]
    assert (enqueue.start_time, enqueue.end_time) == (1_000, 2_000)
    assert enqueue.parent is not None and enqueue.parent.span_id == chat.context.span_id
    assert [e.name for e in chat.events] == ["first token"]
    assert chat.status.status_code == StatusCode.ERROR and chat.status.description == "boom"


def test_an_exception_is_recorded(exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    traces, exporter = exported
    traces.start("job").fail(ValueError("bad"))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.events[0].name == "exception"


@pytest.mark.usefixtures("no_process_tracing")
def test_the_process_has_one_tracing_and_off_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.configure("off", tracing.GATEWAY_SERVICE) is None
    monkeypatch.setenv("CHARSERVE_TRACING", "loud")
    with pytest.raises(ValueError, match="CHARSERVE_TRACING is one of off, otlp, console"):
        tracing.from_environment(tracing.WORKER_SERVICE)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configure("console", tracing.GATEWAY_SERVICE) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("CHARSERVE_TRACING", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-gateway")
    first = tracing.from_environment(tracing.WORKER_SERVICE)
    assert first is not None and tracing.current() is first
    assert first.provider.resource.attributes["service.name"] == "my-gateway"
    # Later calls, whatever their mode, return the process's one tracer.
    assert tracing.configure("otlp", tracing.GATEWAY_SERVICE) is first
    assert tracing.configure("off", tracing.GATEWAY_SERVICE) is first


@pytest.mark.usefixtures("no_process_tracing")
def test_otlp_follows_the_otel_protocol_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="'http/json' is not supported"):
        tracing.configure("otlp", tracing.WORKER_SERVICE)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    traces = tracing.configure("otlp", tracing.WORKER_SERVICE)
    assert traces is not None
    assert traces.provider.resource.attributes["service.name"] == "charserve-worker"


def test_nothing_loads_the_tracing_sdk_while_tracing_is_off() -> None:
    # redis-py imports parts of OpenTelemetry's API (and its metrics SDK) by itself, and a
    # worker's Ray Serve the tracing SDK; what charserve must not add is the tracing SDK,
    # the exporters and the propagator.
    code = (
        "import sys\n"
        "from cluster.runtime.settings import Settings\n"
        "from gateway.app import create_app\n"
        "import workers.loop.consumer\n"
        "create_app(Settings())\n"
        "loaded = [m for m in sys.modules if m.startswith(("
        "'opentelemetry.sdk.trace', 'opentelemetry.exporter', "
        "'opentelemetry.trace.propagation.tracecontext'))]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARSERVE_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _job(**fields: object) -> Job:
    values: dict[str, object] = {
        "id": "r1",
        "reply_to": "inbox",
        "model": "m",
        "prompt_token_ids": [1, 2],
        "max_tokens": 4,
        "sampling": {},
        "arrival_ms": 10,
        "deadline_ms": 20,
    }
    values.update(fields)
    return Job(**values)  # type: ignore[arg-type]


def test_a_job_carries_its_traceparent_and_an_older_job_reads_without_one() -> None:
    traced = _job(traceparent=TRACEPARENT)
    assert protocol.decode(protocol.encode(traced)) == traced
    # A v4 job (a gateway of the previous build): every field but the traceparent.
    plain = _job(resumable=True)
    fields = [getattr(plain, f.name) for f in dataclasses.fields(Job) if f.name != "traceparent"]
    v4 = msgpack.packb(["job", 4, *fields], use_bin_type=True)
    decoded = protocol.decode(v4)
    assert decoded == plain and isinstance(decoded, Job) and decoded.traceparent == ""
