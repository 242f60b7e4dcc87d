"""The gateway application: wiring only.

``create_app()`` is a factory (uvicorn ``--factory``) so settings are read in the serving
process, never at import time. Its lifespan starts the process's
:class:`~gateway.services.Services`; the routes live with their features (chat,
characters, batches, probes), the edge (ids, body bound, API keys) in one middleware, and
every error leaves through one set of handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from cluster.runtime import tracing
from cluster.runtime.logs import configure_logging
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from gateway.batches import routes as batch_routes
from gateway.characters import routes as character_routes
from gateway.chat import routes as chat_routes
from gateway.chat import tokenize as token_routes
from gateway.http import probes
from gateway.http.handlers import install_error_handlers
from gateway.http.middleware import EdgeMiddleware
from gateway.http.openapi import document_errors
from gateway.services import Services
from gateway.streaming.socket_writer import RAW_SEND


class GatewayApp(FastAPI):
    """FastAPI that keeps the server's own ``send`` in the scope (:data:`RAW_SEND`): the
    chat route's streams write tokens through it (:mod:`gateway.streaming.socket_writer`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        try:
            await super().__call__(scope, receive, send)
        finally:
            # uvicorn's request cycle holds the scope, and ``send`` holds the cycle: drop
            # the key so reference counting frees the request when it ends.
            scope.pop(RAW_SEND, None)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway app; settings default to the environment."""
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_format)
    # None while tracing is off (the default): nothing then imports OpenTelemetry's SDK.
    traces = tracing.configure(settings.tracing, tracing.GATEWAY_SERVICE)
    keys = Keys(settings.namespace)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = services = await Services.start(settings, keys)
        try:
            yield
        finally:
            await services.close()
            if traces is not None:
                # The batch processor would export what is left at exit; a flush here
                # loses none of it when the process is stopped harder.
                await asyncio.to_thread(traces.flush)

    app = GatewayApp(title="charserve", version="0.1.0", lifespan=lifespan)
    # Read by the HTTP protocol (gateway.http.server) for every connection.
    app.state.header_timeout_s = settings.header_timeout_s
    for router in (
        chat_routes.router(),
        token_routes.router(),
        character_routes.router(),
        batch_routes.router(),
        probes.router(),
    ):
        app.include_router(router)
    app.add_middleware(
        EdgeMiddleware, max_body_bytes=settings.max_body_bytes, trace_context=traces is not None
    )
    install_error_handlers(app)
    document_errors(app)
    return app
