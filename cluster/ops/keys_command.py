"""``charserve keys create|list|revoke|limits``: API keys and per-tenant limits, in the
Redis the gateways use (``CHARSERVE_REDIS_URL``, or the running embedded stack's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from cluster.ops.stack import admin_redis_url
from cluster.runtime.redis_client import connect
from cluster.runtime.settings import Settings
from cluster.wire.keys import Keys
from cluster.wire.tenants import ApiKeys, Limits


def add_arguments(keys: argparse.ArgumentParser) -> None:
    """Options of ``charserve keys``."""
    sub = keys.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create a key for a tenant and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a label for operators")
    sub.add_parser("list", help="list keys (ids and tenants, never the keys)")
    revoke = sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("id")
    limits = sub.add_parser(
        "limits",
        help="set a tenant's own limits (the fields given; the rest follow the gateway's "
        "CHARSERVE_TENANT_LIMITS), then print what it has stored",
    )
    limits.add_argument("--tenant", required=True)
    for name, field in Limits.model_fields.items():
        if name in ("classes", "budget_floor_ms"):
            continue
        kind = float if field.annotation in (float, "float") else int
        limits.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help=field.description
        )
    limits.add_argument(
        "--classes",
        default=None,
        help="comma-separated classes it may use (interactive,standard,batch)",
    )
    limits.add_argument(
        "--budget-floor",
        action="append",
        default=None,
        metavar="CLASS=MS",
        help="the least X-Latency-Budget-Ms it may ask in a class (repeatable)",
    )


def _given_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The limits fields given on the command line."""
    given: dict[str, Any] = {
        name: getattr(args, name)
        for name in Limits.model_fields
        if name not in ("classes", "budget_floor_ms") and getattr(args, name) is not None
    }
    if args.classes is not None:
        given["classes"] = [c.strip() for c in args.classes.split(",") if c.strip()]
    if args.budget_floor:
        floors = {}
        for item in args.budget_floor:
            cls, _, ms = item.partition("=")
            floors[cls.strip()] = int(ms)
        given["budget_floor_ms"] = floors
    return given


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Manage API keys in the Redis the gateways use."""

    async def run() -> int:
        redis = connect(admin_redis_url(settings), max_connections=4)
        api_keys = ApiKeys(redis, Keys(settings.namespace))
        try:
            if args.keys_command == "create":
                key, record = await api_keys.create(args.tenant, args.name)
                sys.stderr.write(f"key {record.id} for tenant {record.tenant}; shown once:\n")
                print(key)
            elif args.keys_command == "list":
                for record in await api_keys.list():
                    print(
                        json.dumps(
                            {
                                "id": record.id,
                                "tenant": record.tenant,
                                "name": record.name,
                                "created": record.created,
                            }
                        )
                    )
            elif args.keys_command == "revoke":
                if not await api_keys.revoke(args.id):
                    sys.stderr.write(f"no key with id {args.id}\n")
                    return 1
            else:
                own = await api_keys.limits(args.tenant) or {}
                own.update(_given_limits(args))
                await api_keys.set_limits(args.tenant, Limits.model_validate(own))
                print(json.dumps({"tenant": args.tenant, "limits": own}))
            return 0
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except (ValueError, RuntimeError) as exc:
        sys.stderr.write(f"charserve keys: {exc}\n")
        return 2
