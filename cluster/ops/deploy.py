"""``charserve deploy``: put a Serve config on a Ray cluster that is already running.

The cluster comes from ``ray up ray-configs/cluster.yaml``, KubeRay, or ``ray start`` by
hand; this command only deploys the workers onto it (``RAY_ADDRESS``) and returns. The
gateway runs elsewhere (``charserve gateway``) against the same Redis, so the config is
completed the way ``charserve up`` completes it (:mod:`cluster.ops.serve_config`), every
application's args are validated with the model the replicas validate them with (so a typo
in ``engine.engine_args`` fails here, not in a replica), every autoscaling policy is built
once (as the Serve controller will build it, so a bad ``policy_kwargs`` fails here, not in
the controller), and it is deployed the way ``serve deploy`` does it. The last line
printed is the gateway environment that matches what was deployed.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import structlog
import yaml

from cluster.errors import ConfigError
from cluster.ops import ray_serve
from cluster.ops.serve_config import (
    check_app_args,
    check_policies,
    gateway_env,
    load_serve_config,
)
from cluster.runtime.settings import Settings

log = structlog.get_logger(__name__)


def prepare_config(path: str | Path, settings: Settings) -> dict[str, Any]:
    """Read a Serve config and complete it for a deploy against ``settings``' Redis."""
    config = load_serve_config(path, settings)
    for app in config.get("applications", []):
        if not app["args"].get("redis_url"):
            raise ConfigError(
                f"application {app.get('name')!r} has no Redis: set CHARSERVE_REDIS_URL "
                "or args.redis_url in the config"
            )
    check_app_args(config)
    check_policies(config)
    return config


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
        ray_serve.deploy(config, timeout_s)
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
