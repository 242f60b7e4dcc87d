"""structlog, configured once per process: JSON in production, pretty on a TTY.

charserve's own loggers render and write a line in structlog alone: a request's log
line costs no standard-library record, caller lookup, handler or second record in the
formatter, and is encoded by msgspec (a third of the time: about 10 µs a line against
30, in a plain process and in a Ray actor). Standard-library loggers (vLLM, Ray,
uvicorn) go through the same processors and renderer by way of a ``logging`` handler,
so one process writes one format. Context such as ``request_id`` is bound with
structlog's contextvars and carried in the Job, so worker logs join up with gateway
logs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

import msgspec
import structlog

_configured = False
_write_lock = threading.Lock()
# Values JSON has no form for (a dataclass msgspec knows aside) are written as repr().
_encoder = msgspec.json.Encoder(enc_hook=repr)
_SCALARS = (str, int, float, bool, type(None))


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and the standard library root logger (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    json_out = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    root = logging.getLogger()
    root.setLevel(level.upper())  # refuses an unknown level name
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json_out
        else structlog.dev.ConsoleRenderer()
    )
    exc_info = structlog.processors.format_exc_info if json_out else _identity
    structlog.configure(
        processors=[*shared, exc_info, renderer],
        logger_factory=_LineWriter,
        wrapper_class=structlog.make_filtering_bound_logger(root.level),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                exc_info,
                renderer,
            ],
        )
    )
    root.handlers[:] = [handler]


class _LineWriter:
    """structlog's logger for charserve's own lines: one rendered line to stderr.

    ``sys.stderr`` is read at each write, not kept, so a stream a test runner or Ray
    swapped in later is the one written to. A line that cannot be written (a closed
    stream) is dropped: logging must not fail the request that logs.
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "", *_: Any) -> None:
        self.name = name  # add_logger_name reads it

    def msg(self, message: str) -> None:
        """Write ``message`` and a newline, and flush."""
        with _write_lock:
            try:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):  # AttributeError: no stderr
                pass

    debug = info = warning = warn = error = err = exception = critical = fatal = msg


def _new_write_lock() -> None:
    """A forked child starts with a free lock (the parent's may have been held by a
    thread that does not exist in the child: vLLM forks its engine core)."""
    global _write_lock
    _write_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_write_lock)


def _dumps(event: Any, **_: Any) -> str:
    """The event as one line of ASCII JSON: msgspec's encoder (several times the
    standard library's speed); the standard library's, with ``repr`` for what has no
    JSON form, when msgspec refuses the event (say a cycle) or its line holds other
    than ASCII (msgspec does not escape it: a client's U+2028 in a
    field would split the line for a reader that splits on it)."""
    try:
        line = _encoder.encode(event)
        if line.isascii():
            return line.decode()
    except (TypeError, ValueError, RecursionError, msgspec.MsgspecError):
        pass
    try:
        return json.dumps(event, default=repr)
    except (TypeError, ValueError, RecursionError):
        # A nested key JSON has no form for, or a cycle: each top-level value that is
        # not a scalar as its repr.
        return json.dumps(
            {str(k): v if isinstance(v, _SCALARS) else repr(v) for k, v in event.items()}
        )


def _identity(
    logger: object, name: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    return event
