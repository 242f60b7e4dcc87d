"""``charserve keys create|list|revoke|limits``: API keys and per-tenant limits, in the
Redis the gateways use (``CHARSERVE_REDIS_URL``, or the running embedded stack's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

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
    limits = sub.add_parser("limits", help="set a tenant's requests/tokens per minute")
    limits.add_argument("--tenant", required=True)
    limits.add_argument("--rpm", type=int, default=0, help="requests per minute (0: none)")
    limits.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: none)")


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
                await api_keys.set_limits(args.tenant, Limits(args.rpm, args.tpm))
            return 0
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except (ValueError, RuntimeError) as exc:
        sys.stderr.write(f"charserve keys: {exc}\n")
        return 2
