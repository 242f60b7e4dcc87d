"""Start vLLM's own OpenAI server with exactly the engine settings of a Serve config.

For side-by-side benchmarks: ``python -m workers.baselines.vllm_server --port 8100`` reads the
engine args of ``ray-configs/local-cpu.yaml`` (or ``--config``) and runs
``vllm.entrypoints.openai.api_server`` with the same model, lengths, batch size, prefix
caching, eager mode and KV cache size as the workers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from cluster.runtime.bundled_model import resolve_model
from workers.engines.config import EngineConfig


def engine_config_from(path: str | Path) -> EngineConfig:
    """The engine settings of the first application in a Serve config."""
    config = yaml.safe_load(Path(path).read_text())
    return EngineConfig.model_validate(config["applications"][0].get("args", {}).get("engine", {}))


def command(config: EngineConfig, host: str, port: int) -> list[str]:
    """The command line that starts vLLM's OpenAI server."""
    model = resolve_model(config.model or os.environ.get("CHARSERVE_MODEL"))
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *config.server_args(model, host, port),
    ]


def main() -> None:
    """Replace this process with vLLM's server."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="ray-configs/local-cpu.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    config = engine_config_from(args.config)
    argv = command(config, args.host, args.port)
    os.environ.update(config.env())
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
