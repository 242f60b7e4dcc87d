"""``/health`` (liveness), ``/ready`` (readiness) and ``/metrics`` (Prometheus): the
routes an orchestrator and a scraper call, outside ``/v1`` and its API keys."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from redis.exceptions import RedisError

from cluster.runtime.prometheus import CONTENT_TYPE, read_worker_metrics, render_all
from gateway.http.openapi import ok
from gateway.services import services

log = structlog.get_logger(__name__)


class Health(BaseModel):
    """``GET /health``."""

    status: Literal["ok"]


class Ready(BaseModel):
    """``GET /ready`` when ready."""

    status: Literal["ready"]
    workers: int


class NotReady(BaseModel):
    """``GET /ready`` when not ready, and why."""

    status: Literal["unavailable"]
    reason: Literal["redis", "inbox", "no_workers"]


HEALTH_RESPONSES = ok(Health, "The process answers.")
READY_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ok(Ready, "Redis answers, the inbox is subscribed and a worker is claiming."),
    503: {"model": NotReady, "description": "Not ready, and why."},
}


def router() -> APIRouter:
    """The probe routes."""
    api = APIRouter()

    @api.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @api.get("/ready", responses=READY_RESPONSES)
    async def ready(request: Request) -> JSONResponse:
        """Readiness: Redis answers, the inbox is subscribed, and a worker is claiming
        (as both its heartbeat and the gateway's admission see it)."""
        s = services(request)
        fresh_ms = s.clock.now_ms() - 3 * s.settings.heartbeat_ms
        try:
            workers = await s.redis.zcount(s.keys.workers, fresh_ms, "+inf")
        except RedisError:
            return JSONResponse({"status": "unavailable", "reason": "redis"}, status_code=503)
        if not s.inbox.subscribed.is_set():
            return JSONResponse({"status": "unavailable", "reason": "inbox"}, status_code=503)
        # Ready only when admission would admit too: it reads the capacity snapshot
        # (refreshed every 100 ms), which can lag the heartbeats read above, and a client
        # that saw 200 here must not get 503 ``no_workers`` on its next request.
        workers = min(workers, s.capacity.current.workers)
        if workers == 0:
            return JSONResponse({"status": "unavailable", "reason": "no_workers"}, status_code=503)
        return JSONResponse({"status": "ready", "workers": workers})

    @api.get("/metrics", include_in_schema=False)
    async def metrics_page(request: Request) -> Response:
        """Prometheus metrics: this gateway's (every process of it, when it runs several
        on this port), plus every live worker's (and its vLLM engine's) as the workers last
        exported them, labelled by ``replica``."""
        s = services(request)
        try:
            texts = await read_worker_metrics(s.redis, s.keys)
        except RedisError:
            texts = {}
        if s.metrics_group is None:
            body = await asyncio.to_thread(render_all, s.metrics.registry, texts)
            return Response(body, media_type=CONTENT_TYPE)
        try:
            body = await s.metrics_group.page(texts)
        except RedisError as exc:
            # This process's counts alone would read as counters going down (a false
            # reset to rate()); a failed scrape reads as what it is.
            log.warning("gateway metrics unavailable", error=str(exc))
            return Response("metrics unavailable: Redis\n", status_code=503)
        return Response(body, media_type=CONTENT_TYPE)

    return api
