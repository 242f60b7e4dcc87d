"""The one place charserve reaches into Ray Serve's private API: deploying a whole config
file the way ``serve deploy`` / ``serve run CONFIG`` do.

Ray's public API deploys applications built in Python (``serve.run``); a config file with
per-application ``import_path`` and ``args`` is deployed by the Serve controller's
``deploy_apps``, which Ray reaches through ``ray.serve._private.api.serve_start``. Both are
private, so :func:`check` verifies at start-up that they exist with the parameters used
here and fails with a clear message otherwise (a Ray upgrade that moved them), instead of
an ``AttributeError`` in the middle of a deploy.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import structlog

from cluster.errors import ConfigError

log = structlog.get_logger(__name__)


def check() -> None:
    """Raise :class:`ConfigError` unless this Ray has the private Serve API used here."""
    try:
        from ray.serve._private import api as serve_api
        from ray.serve._private.client import ServeControllerClient
    except ImportError as exc:
        raise ConfigError(f"this Ray has no Serve private API charserve uses: {exc}") from exc
    start = inspect.signature(serve_api.serve_start).parameters
    deploy = inspect.signature(ServeControllerClient.deploy_apps).parameters
    missing = [p for p in ("http_options", "proxy_location", "grpc_options") if p not in start]
    missing += [f"deploy_apps({p})" for p in ("config", "_blocking") if p not in deploy]
    if missing:
        import ray

        raise ConfigError(
            f"Ray {ray.__version__} changed the Serve API charserve deploys with "
            f"(missing: {', '.join(missing)}); install the Ray version charserve pins"
        )


def deploy(config: dict[str, Any], timeout_s: float = 900.0) -> None:
    """Deploy a Serve config on the connected Ray cluster and wait until it runs."""
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    check()
    schema = ServeDeploySchema.model_validate(config)
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
    )
    client.deploy_apps(schema, _blocking=False)
    names = [app.name for app in schema.applications]
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        states = {n: status[n].status if n in status else "NOT_STARTED" for n in names}
        if all(s == "RUNNING" for s in states.values()):
            log.info("serve applications running", apps=names)
            return
        failed = {n: status[n].message for n, s in states.items() if s == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"Serve deploy failed: {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve applications not running after {timeout_s:.0f}s: {states}")
        time.sleep(1.0)
