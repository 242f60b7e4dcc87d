"""What the edge put on a request for the routes: its id, its tenant, and header flags."""

from __future__ import annotations

import uuid

from fastapi import Request

from gateway.http.errors import BadRequest


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


def request_id(request: Request) -> str:
    """The request's id, made by the server (set by
    :class:`gateway.http.middleware.EdgeMiddleware`)."""
    return str(getattr(request.state, "request_id", "") or new_request_id())


def client_request_id(request: Request) -> str | None:
    """The client's own ``X-Request-Id`` (a label and an idempotency key), if it sent one."""
    value = getattr(request.state, "client_request_id", None)
    return str(value) if value is not None else None


def tenant(request: Request) -> str:
    """The caller's tenant, set by the edge middleware from the API key."""
    return str(request.state.tenant)


def flag(request: Request, header: str) -> bool:
    """A ``true``/``false`` request header (absent: false); 400 for anything else."""
    value = request.headers.get(header)
    if value is None:
        return False
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise BadRequest(f"{header} must be true or false, not {value[:40]!r}", param=header)
    return text == "true"
