"""``charserve deploy``: put a Serve config on a Ray cluster that is already running.

The cluster comes from ``ray up ray-configs/cluster.yaml``, KubeRay, or ``ray start`` by
hand; this command only deploys the workers onto it (``RAY_ADDRESS``) and returns. The
gateway runs elsewhere (``charserve gateway``) against the same Redis, so the config is
completed here the way ``charserve up`` completes it:

- every application's ``args.redis_url`` (from ``CHARSERVE_REDIS_URL``) and
  ``args.namespace`` (from ``CHARSERVE_NAMESPACE``) unless the file sets them, and
  ``args.engine.model`` from ``CHARSERVE_MODEL`` when set;
- the queue autoscaling policy's ``policy_kwargs`` (``redis_url``, ``namespace``,
  ``queue_policy``, ``heartbeat_ms``) from its application's args, so the policy reads
  the queue the workers claim from.

Then the config is validated with Ray's own schema, every policy is built once (as the
Serve controller will build it, so a bad ``policy_kwargs`` fails here, not in the
controller), and it is deployed the way ``serve deploy`` does it. The last line printed
is the gateway environment that matches what was deployed.
"""

from __future__ import annotations

import inspect
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import structlog
import yaml

from cluster.errors import ConfigError
from cluster.ops.stack import deploy, engine_settings, load_serve_config
from cluster.runtime.settings import Settings

log = structlog.get_logger(__name__)

# Named by string: the cluster package never imports workers.
BACKLOG_POLICY = "workers.scaling.policy:BacklogPolicy"
_POLICY_FIELDS_FROM_ARGS = {
    "redis_url": None,
    "namespace": "charserve",
    "queue_policy": "edf",
    "heartbeat_ms": 1_000,
}


def _policies(config: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(application, policy) for every deployment with a custom autoscaling policy."""
    found = []
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []) or []:
            autoscaling = deployment.get("autoscaling_config") or {}
            policy = autoscaling.get("policy")
            if isinstance(policy, dict) and policy.get("policy_function"):
                found.append((app, policy))
    return found


def fill_policy_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Give the queue policy of each deployment its application's Redis, namespace,
    queue policy and heartbeat, unless the policy sets them itself. Returns ``config``."""
    for app, policy in _policies(config):
        if policy["policy_function"] != BACKLOG_POLICY:
            continue
        kwargs = policy.setdefault("policy_kwargs", {})
        args = app.get("args", {})
        for name, default in _POLICY_FIELDS_FROM_ARGS.items():
            value = args.get(name, default)
            if value is not None:
                kwargs.setdefault(name, value)
    return config


def check_policies(config: dict[str, Any]) -> None:
    """Build every class policy with its ``policy_kwargs``, as the Serve controller does
    (Ray imports the policy while validating anyway), so bad kwargs fail the deploy here."""
    from ray._common.utils import import_attr

    for _, policy in _policies(config):
        target = import_attr(policy["policy_function"])
        if inspect.isclass(target):
            try:
                target(**policy.get("policy_kwargs", {}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"autoscaling policy {policy['policy_function']}: {exc}") from exc


def prepare_config(path: str | Path, settings: Settings) -> dict[str, Any]:
    """Read a Serve config and complete it for a deploy against ``settings``' Redis."""
    from ray.serve.schema import ServeDeploySchema

    # Fills args.redis_url and args.engine.model where the file leaves them out.
    config = load_serve_config(path, settings.redis_url or "", settings.model)
    for app in config.get("applications", []):
        args = app["args"]
        if not args.get("redis_url"):
            raise ConfigError(
                f"application {app.get('name')!r} has no Redis: set CHARSERVE_REDIS_URL "
                "or args.redis_url in the config"
            )
        args.setdefault("namespace", settings.namespace)
    fill_policy_kwargs(config)
    ServeDeploySchema.model_validate(config)
    check_policies(config)
    return config


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def gateway_env(config: dict[str, Any]) -> dict[str, str]:
    """The ``charserve gateway`` environment that matches the first application."""
    args = config["applications"][0].get("args", {})
    env = {
        "CHARSERVE_REDIS_URL": _redacted(str(args.get("redis_url", ""))),
        "CHARSERVE_NAMESPACE": str(args.get("namespace", "charserve")),
        **engine_settings(config),
    }
    model = args.get("engine", {}).get("model")
    if model:
        env["CHARSERVE_MODEL"] = str(model)
    return env


def run(config_path: str, address: str | None, timeout_s: float, settings: Settings) -> int:
    """Deploy ``config_path`` to the Ray cluster at ``address``; 0 when it runs."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        sys.stderr.write(
            "charserve deploy needs a running cluster: set RAY_ADDRESS (or --address)\n"
        )
        return 2
    try:
        config = prepare_config(config_path, settings)
    except (ValueError, OSError, yaml.YAMLError) as exc:  # ConfigError, schema, file
        sys.stderr.write(f"charserve deploy: {exc}\n")
        return 2
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        deploy(config, timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        sys.stderr.write(f"charserve deploy: {exc}\n")
        return 1
    finally:
        ray.shutdown()  # the Serve applications stay: they belong to the cluster
    names = [app["name"] for app in config["applications"]]
    env = gateway_env(config)
    log.info("deployed", applications=names, address=address)
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print(f"deployed {', '.join(names)}; serve it with: {line} charserve gateway")
    return 0
