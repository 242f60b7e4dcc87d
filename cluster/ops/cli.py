"""The ``charserve`` command line.

- ``charserve up``: the embedded stack (what ``make run`` runs).
- ``charserve gateway``: gateway processes alone, against ``CHARSERVE_REDIS_URL``.
- ``charserve deploy --config FILE``: deploy a Serve config to a running Ray cluster
  (``RAY_ADDRESS``); see ``cluster.ops.deploy``.
- ``charserve keys create|list|revoke|limits``: API keys and per-tenant limits.
- ``charserve prepare-model``: convert the bundled model once; print its folder.
- ``charserve bench``: the streaming load generator (see ``cluster.bench.load``).
- ``charserve bench-mixed``: interactive beside batch, EDF against FIFO (``cluster.bench.mixed``).
- ``charserve bench-sessions``: multi-turn sessions, affinity against none
  (``cluster.bench.sessions``).
- ``charserve bench-peers``: charserve against vLLM's own server, one at a time or
  together, by vLLM's client and ours (``cluster.bench.peers``).
- ``charserve bench-tenants``: one tenant floods, another chats beside it
  (``cluster.bench.tenants``).
- ``charserve backfill``: character dialogues through a gateway (``cluster.backfill``).
- ``charserve bench-backfill``: the backfill against vLLM's offline ``LLM.chat``, and
  interactive latency beside it (``cluster.bench.backfill``).

This is the composition root: it names the gateway app by import string only, so the
``cluster`` package never imports ``gateway`` or ``workers``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

import structlog

from cluster.ops import keys_command
from cluster.runtime.logs import configure_logging
from cluster.runtime.settings import Settings

log = structlog.get_logger(__name__)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_up(settings: Settings) -> int:
    """Run the embedded stack until Ctrl-C or SIGTERM."""
    from cluster.ops.stack import LocalStack, StackConflict
    from cluster.runtime.redis_client import redacted_url

    signal.signal(signal.SIGTERM, _raise_interrupt)
    stack = LocalStack(settings)
    code = 0
    try:
        stack.start()
        log.info(
            "charserve ready",
            url=stack.base_url,
            model=settings.served_model_name,
            redis_url=redacted_url(stack.redis_url),
        )
        sys.stderr.write(f"charserve ready on {stack.base_url}\n")
        sys.stderr.flush()
        code = stack.wait()
    except StackConflict as exc:
        log.error("charserve cannot start", reason=str(exc))
        code = 1
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        stack.stop()
        log.info("stopped")
    return code


def cmd_gateway(settings: Settings) -> int:
    """Serve the gateway with uvicorn (``CHARSERVE_GATEWAY_WORKERS`` processes)."""
    import uvicorn

    if not settings.redis_url:
        sys.stderr.write("charserve gateway needs CHARSERVE_REDIS_URL\n")
        return 2
    uvicorn.run(
        "gateway.app:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.gateway_workers,
        # uvloop, accepting every waiting connection in one turn, and httptools with a
        # header-read timeout (named by string: cluster never imports gateway).
        loop="gateway.http.accept:new_event_loop",
        http="gateway.http.server:HeaderTimeoutProtocol",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


def cmd_prepare_model(settings: Settings) -> int:
    """Prepare the bundled model (or resolve CHARSERVE_MODEL) and print its path."""
    from cluster.runtime.bundled_model import resolve_model

    print(resolve_model(settings.model))
    return 0


def _version() -> str:
    """The installed distribution's version (a checkout not installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("charserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``charserve`` console script."""
    parser = argparse.ArgumentParser(prog="charserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"charserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run the embedded stack on this machine")
    sub.add_parser("gateway", help="run gateway processes against a shared Redis")
    sub.add_parser("prepare-model", help="prepare the bundled model and print its folder")
    deploy = sub.add_parser("deploy", help="deploy a Serve config to a running Ray cluster")
    deploy.add_argument("--config", required=True, help="Serve config (ray-configs/*.yaml)")
    deploy.add_argument("--address", default=None, help="Ray cluster (default: $RAY_ADDRESS)")
    deploy.add_argument("--timeout-s", type=float, default=900.0, help="wait for RUNNING (s)")
    keys_command.add_arguments(sub.add_parser("keys", help="API keys and per-tenant limits"))
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server")
    from cluster.backfill import cli as backfill
    from cluster.bench import backfill as bench_backfill
    from cluster.bench import mixed as bench_mixed
    from cluster.bench import peers as bench_peers
    from cluster.bench import sessions as bench_sessions
    from cluster.bench import tenants as bench_tenants
    from cluster.bench.load import add_arguments

    add_arguments(bench)
    bench_mixed.add_arguments(
        sub.add_parser("bench-mixed", help="interactive chat beside a saturating batch load")
    )
    bench_sessions.add_arguments(
        sub.add_parser("bench-sessions", help="multi-turn sessions, affinity against none")
    )
    bench_peers.add_arguments(
        sub.add_parser(
            "bench-peers", help="charserve against vLLM's own server, one at a time or together"
        )
    )
    bench_tenants.add_arguments(
        sub.add_parser("bench-tenants", help="one tenant floods, another chats beside it")
    )
    backfill.add_arguments(
        sub.add_parser("backfill", help="generate character dialogues through a gateway")
    )
    bench_backfill.add_arguments(
        sub.add_parser(
            "bench-backfill",
            help="backfill against vLLM's offline LLM.chat, and interactive TTFT beside it",
        )
    )
    args = parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_level, settings.log_format)
    if args.command == "up":
        return cmd_up(settings)
    if args.command == "gateway":
        return cmd_gateway(settings)
    if args.command == "prepare-model":
        return cmd_prepare_model(settings)
    if args.command == "deploy":
        from cluster.ops import deploy as deploy_cmd

        return deploy_cmd.run(args.config, args.address, args.timeout_s, settings)
    if args.command == "keys":
        return keys_command.run(settings, args)
    if args.command == "bench-mixed":
        return bench_mixed.run(args)
    if args.command == "bench-sessions":
        return bench_sessions.run(args)
    if args.command == "bench-peers":
        return bench_peers.run(args)
    if args.command == "bench-tenants":
        from cluster.ops.stack import admin_redis_url

        try:
            redis_url = admin_redis_url(settings)
        except RuntimeError:
            redis_url = ""  # enough with --key-a, --key-b and --no-memory
        return bench_tenants.run(args, redis_url, settings.namespace)
    if args.command == "backfill":
        return backfill.run(args)
    if args.command == "bench-backfill":
        return bench_backfill.run(args)
    from cluster.bench.load import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
