"""OpenTelemetry tracing, off by default: one trace per request, from the gateway through
the queue to the worker that runs it.

A gateway opens one span per chat request (its parent is the client's ``traceparent``
header, when it sent one) and records admission, the enqueue, the wait in the queue and
the first token under it. The span's W3C ``traceparent`` travels in the job
(:attr:`cluster.wire.protocol.Job.traceparent`), and the worker that claims the job opens
its own span as that span's child: one trace id for the whole request, whichever
processes and hosts served it.

Tracing is on when ``CHARSERVE_TRACING`` says which exporter to use (``otlp``, or
``console`` to debug); everything else is OpenTelemetry's own environment: the OTLP
endpoint, headers and protocol (``OTEL_EXPORTER_OTLP_*``), the service name and resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER``)
and the batch exporter's bounds (``OTEL_BSP_*``). The gateway reads the setting from its
:class:`~cluster.runtime.settings.Settings`, workers from their environment.

Off, nothing here imports OpenTelemetry and callers hold ``None`` instead of a
:class:`Tracing` or a :class:`Trace`: the cost on the request path is one None check.
On, callers hold :class:`Trace` handles and never import OpenTelemetry themselves; spans
are never made "current" in OpenTelemetry's context, so parents are always explicit and no
other library's spans nest under charserve's by accident. Spans leave through a batch
processor's thread, so ending one on the event loop is a queue append.

One :class:`Tracing` serves a process (:func:`configure`); tests :func:`install` their own
(an in-memory exporter) before a gateway or worker starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal

import structlog

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

log = structlog.get_logger(__name__)

TracingMode = Literal["off", "otlp", "console"]
MODES: tuple[str, ...] = ("off", "otlp", "console")
# What a worker reads (the gateway's setting of the same name: Settings.tracing).
TRACING_ENV = "CHARSERVE_TRACING"
# service.name of each kind of process, unless OTEL_SERVICE_NAME (or service.name in
# OTEL_RESOURCE_ATTRIBUTES) names it.
GATEWAY_SERVICE = "charserve-gateway"
WORKER_SERVICE = "charserve-worker"

SpanKindName = Literal["internal", "server", "client", "producer", "consumer"]
AttributeValue = str | bool | int | float
Attributes = Mapping[str, AttributeValue]

# The W3C trace headers (``traceparent``, ``tracestate``) of the HTTP request being served,
# set by the gateway's edge middleware while tracing is on: the request's span becomes
# their child.
incoming_trace: ContextVar[Mapping[str, str] | None] = ContextVar(
    "charserve_incoming_trace", default=None
)


class Trace:
    """One span, as charserve's code handles it: set attributes, add events, record
    finished children, end it (once; later ends do nothing)."""

    __slots__ = ("_span", "_tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self._span = span

    @property
    def traceparent(self) -> str:
        """This span's W3C ``traceparent`` header value ("" for an invalid span)."""
        ctx = self._span.get_span_context()
        if not ctx.is_valid:
            return ""
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    @property
    def recording(self) -> bool:
        """False once ended, or when the sampler dropped this trace."""
        return self._span.is_recording()

    def set(self, attributes: Attributes) -> None:
        """Set attributes of the span."""
        self._span.set_attributes(attributes)

    def event(
        self, name: str, attributes: Attributes | None = None, at_ns: int | None = None
    ) -> None:
        """Add an event (now, or at ``at_ns`` on the wall clock)."""
        self._span.add_event(name, attributes, at_ns)

    def child(
        self,
        name: str,
        start_ns: int,
        end_ns: int | None = None,
        attributes: Attributes | None = None,
        *,
        error: str | None = None,
    ) -> None:
        """Record a finished child span from ``start_ns`` to ``end_ns`` (None: now): a
        step whose times are known afterwards costs no open span while it runs."""
        if not self._span.is_recording():
            return
        self._tracing.start(name, parent=self, attributes=attributes, start_ns=start_ns).end(
            error=error, at_ns=end_ns
        )

    def start_child(
        self, name: str, attributes: Attributes | None = None, kind: SpanKindName = "internal"
    ) -> Trace:
        """Open a child span (end it yourself)."""
        return self._tracing.start(name, parent=self, kind=kind, attributes=attributes)

    def end(self, *, error: str | None = None, at_ns: int | None = None) -> None:
        """End the span (status ERROR with ``error`` as its description when given);
        a span already ended is left as it is."""
        span = self._span
        if not span.is_recording():
            return
        if error is not None:
            span.set_status(self._tracing.error_status(error))
        span.end(at_ns)

    def exception(self, exc: BaseException) -> None:
        """Record ``exc`` as an exception event (its type, message and traceback)."""
        if self._span.is_recording():
            self._span.record_exception(exc)

    def fail(self, exc: BaseException) -> None:
        """End the span with ``exc`` recorded as an exception event and the error."""
        if not self._span.is_recording():
            return
        self._span.record_exception(exc)
        self.end(error=f"{type(exc).__name__}: {exc}")


class Tracing:
    """A process's tracer (it exists only while tracing is on)."""

    def __init__(self, provider: TracerProvider) -> None:
        # Imported only here: a process with tracing off never loads the SDK's tracing.
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("charserve")
        # An empty context: a span given no parent is a root, whatever OpenTelemetry's
        # ambient context holds (vLLM or Ray may have made a span current).
        self._root = context.Context()
        self._with_span = trace.set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self._kinds: dict[str, Any] = {
            "internal": SpanKind.INTERNAL,
            "server": SpanKind.SERVER,
            "client": SpanKind.CLIENT,
            "producer": SpanKind.PRODUCER,
            "consumer": SpanKind.CONSUMER,
        }
        error = StatusCode.ERROR
        self.error_status: Callable[[str], Any] = lambda message: Status(error, message)

    @classmethod
    def exporting(cls, mode: TracingMode, service_name: str) -> Tracing:
        """A tracer exporting through a batch processor: ``otlp`` (OTLP over
        ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or ``OTEL_EXPORTER_OTLP_PROTOCOL``,
        ``http/protobuf`` by default, to ``OTEL_EXPORTER_OTLP_ENDPOINT``) or ``console``
        (stdout)."""
        from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names the
        # service when set; the kind of process does otherwise.
        named = SERVICE_NAME in OTELResourceDetector().detect().attributes
        resource = Resource.create({} if named else {SERVICE_NAME: service_name})
        # The sampler comes from OTEL_TRACES_SAMPLER (parent-based, always on by default).
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(_exporter(mode)))
        return cls(provider)

    def start(
        self,
        name: str,
        *,
        parent: Trace | Mapping[str, str] | str | None = None,
        kind: SpanKindName = "internal",
        attributes: Attributes | None = None,
        start_ns: int | None = None,
    ) -> Trace:
        """Open a span: a child of ``parent`` (a :class:`Trace`, W3C trace headers, or a
        ``traceparent`` value), or a root when there is none or it is malformed."""
        if isinstance(parent, Trace):
            ctx = self._with_span(parent._span, self._root)
        elif parent:
            carrier = {"traceparent": parent} if isinstance(parent, str) else parent
            ctx = self._propagator.extract(carrier, context=self._root)
        else:
            ctx = self._root
        span = self._tracer.start_span(
            name, context=ctx, kind=self._kinds[kind], attributes=attributes, start_time=start_ns
        )
        return Trace(self, span)

    def flush(self, timeout_ms: int = 5_000) -> bool:
        """Export every span ended so far (blocking, up to ``timeout_ms``)."""
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush and stop exporting."""
        self.provider.shutdown()


def _exporter(mode: TracingMode) -> SpanExporter:
    """The span exporter ``mode`` names, configured by OpenTelemetry's environment."""
    if mode == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            return HttpExporter()
    except ImportError as exc:
        raise RuntimeError(
            f"{TRACING_ENV}=otlp needs the OTLP exporter: pip install "
            f"opentelemetry-exporter-otlp ({exc})"
        ) from exc
    raise ValueError(
        f"OTLP protocol {protocol!r} is not supported for traces (grpc or http/protobuf)"
    )


_current: Tracing | None = None


def configure(mode: str, service_name: str) -> Tracing | None:
    """This process's tracing: set up by the first call whose ``mode`` is not ``off``
    (later calls return the same :class:`Tracing`, whatever their mode); None while off.
    ``OTEL_SDK_DISABLED=true`` keeps it off."""
    global _current
    if _current is not None or mode == "off":
        return _current
    if mode not in MODES:
        raise ValueError(f"{TRACING_ENV} is one of {', '.join(MODES)}, not {mode!r}")
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.warning("tracing stays off: OTEL_SDK_DISABLED=true", asked=mode)
        return None
    _current = Tracing.exporting(mode, service_name)  # type: ignore[arg-type]
    log.info(
        "tracing on",
        exporter=mode,
        endpoint=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    return _current


def from_environment(service_name: str) -> Tracing | None:
    """:func:`configure` from ``CHARSERVE_TRACING`` (what a worker reads; unset: off)."""
    return configure(os.environ.get(TRACING_ENV, "off").strip().lower() or "off", service_name)


def current() -> Tracing | None:
    """This process's tracing (None: off)."""
    return _current


def install(tracing: Tracing | None) -> None:
    """Make ``tracing`` this process's (None: off again), for tests and embedders; a
    gateway or worker built afterwards uses it."""
    global _current
    _current = tracing
