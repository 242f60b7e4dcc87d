"""Serve configs as charserve reads them: a Ray Serve config file naming the worker
builder, completed with what the gateways and workers must agree on.

``charserve up`` and ``charserve deploy`` complete a file the same way
(:func:`load_serve_config`): every application's args get, unless the file sets them,

- ``redis_url`` (``CHARSERVE_REDIS_URL``, or the embedded Redis) and ``engine.model``
  (``CHARSERVE_MODEL``, when set);
- what a gateway and a worker must read alike: ``namespace``, ``heartbeat_ms`` and
  ``reply_log_ttl_s`` (the gateway's ``CHARSERVE_*`` of the same names);
- the queue autoscaling policy's ``policy_kwargs`` (``redis_url``, ``namespace``,
  ``queue_policy``, ``heartbeat_ms``) from its application's args, so the policy reads the
  queue the workers claim from.

Then the file is validated with Ray's own schema. ``charserve deploy`` also builds what
the cluster would build from it before anything is deployed: each application's args model
(:func:`check_app_args`) and each autoscaling policy (:func:`check_policies`), both named by
string. :func:`gateway_env` is the other direction: the gateway environment that matches a
completed config.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import ValidationError

from cluster.errors import ConfigError
from cluster.runtime.redis_client import redacted_url
from cluster.runtime.settings import Settings

log = structlog.get_logger(__name__)

# Named by string: the cluster package never imports workers.
BACKLOG_POLICY = "workers.scaling.policy:BacklogPolicy"
# Serve application builders -> the pydantic model each validates its ``args`` with (the
# replica validates them again when it starts; vLLM's EngineArgs check included).
APP_ARGS_MODELS = {"workers.deployment:build_app": "workers.deployment:WorkerArgs"}
# Args a gateway and its workers must agree on, filled from the gateway's settings.
SHARED_ARGS = ("namespace", "heartbeat_ms", "reply_log_ttl_s")
_POLICY_FIELDS_FROM_ARGS = {
    "redis_url": None,
    "namespace": "charserve",
    "queue_policy": "edf",
    "heartbeat_ms": 1_000,
}


# The checkout (or editable install) this module runs from: ``ray-configs/`` is beside it.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def config_path(path: str | Path) -> Path:
    """``path`` as given, or, when it is relative and not found from here, the same path
    in the checkout charserve runs from: ``charserve up`` works from any directory."""
    given = Path(path)
    if given.exists() or given.is_absolute():
        return given
    beside = _SOURCE_ROOT / given
    if beside.exists():
        return beside
    raise ConfigError(
        f"Serve config {str(path)!r} not found here nor in {_SOURCE_ROOT} "
        "(set CHARSERVE_SERVE_CONFIG to its path)"
    )


def load_serve_config(
    path: str | Path, settings: Settings, redis_url: str | None = None
) -> dict[str, Any]:
    """Read a Serve config and complete every application as the module docstring says
    (``redis_url`` overrides ``settings.redis_url``). Validated with Ray's own schema."""
    from ray.serve.schema import ServeDeploySchema

    config: dict[str, Any] = yaml.safe_load(config_path(path).read_text())
    redis_url = redis_url or settings.redis_url
    for app in config.get("applications", []):
        args = app.get("args") or {}
        app["args"] = args
        if not args.get("redis_url") and redis_url:  # absent or an explicit null
            args["redis_url"] = redis_url
        engine = args.setdefault("engine", {})
        if settings.model and not engine.get("model"):
            engine["model"] = settings.model
        for name in SHARED_ARGS:
            args.setdefault(name, getattr(settings, name))
    fill_policy_kwargs(config)
    ServeDeploySchema.model_validate(config)
    return config


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


def _import_attr(path: str) -> Any:
    """``module:attr`` (or ``module.attr``), imported."""
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def check_app_args(config: dict[str, Any]) -> None:
    """Validate each application's ``args`` with the model its builder validates them
    with (:data:`APP_ARGS_MODELS`), as the cluster will, so a bad value, or a key of
    ``engine.engine_args`` the installed vLLM does not know, fails the deploy here, with
    the model's message, rather than in a replica. Where that model cannot be imported (a
    gateway-only install has no ``workers`` package) the check is skipped, with a note in
    the log; where vLLM is missing, the model itself skips the checks that need it."""
    for app in config.get("applications", []):
        # Ray takes ``module:builder`` and ``module.builder`` alike.
        builder = str(app.get("import_path", "")).replace(":", ".")
        models = {name.replace(":", "."): model for name, model in APP_ARGS_MODELS.items()}
        model_path = models.get(builder)
        if model_path is None:
            continue
        try:
            model = _import_attr(model_path)
        except ImportError as exc:
            log.warning(
                "application args not checked: their model cannot be imported here",
                application=app.get("name"),
                model=model_path,
                error=str(exc),
            )
            continue
        try:
            model.model_validate(app.get("args") or {})
        except ValidationError as exc:
            raise ConfigError(f"application {app.get('name')!r}: {exc}") from exc


def check_policies(config: dict[str, Any]) -> None:
    """Build every class policy with its ``policy_kwargs``, as the Serve controller does,
    so bad kwargs fail the deploy here rather than in the controller."""
    for _, policy in _policies(config):
        target = _import_attr(policy["policy_function"])
        if inspect.isclass(target):
            try:
                target(**policy.get("policy_kwargs", {}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"autoscaling policy {policy['policy_function']}: {exc}") from exc


def gateway_env(config: dict[str, Any]) -> dict[str, str]:
    """The ``charserve gateway`` environment that matches the first application (the
    Redis URL with its password redacted)."""
    args = config["applications"][0].get("args", {})
    engine = args.get("engine", {})
    env = {"CHARSERVE_REDIS_URL": redacted_url(str(args.get("redis_url", "")))}
    for name in SHARED_ARGS:
        if name in args:
            env[f"CHARSERVE_{name.upper()}"] = str(args[name])
    for name in ("served_model_name", "max_model_len", "model"):
        if engine.get(name):
            env[f"CHARSERVE_{name.upper()}"] = str(engine[name])
    return env
