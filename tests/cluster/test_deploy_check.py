"""``charserve deploy`` validates each application's args locally, with the model the
replicas validate them with: a typo in ``engine.engine_args`` (checked against the
installed vLLM) fails before anything reaches the cluster; where the model cannot be
imported (a gateway-only install) the check is skipped with a note in the log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from cluster.errors import ConfigError
from cluster.ops.deploy import prepare_config
from cluster.runtime.settings import Settings

CONFIGS = Path(__file__).resolve().parents[2] / "ray-configs"
SETTINGS = Settings(redis_url="redis://127.0.0.1:6379/0")


def _config_with(tmp_path: Path, **engine: Any) -> Path:
    """ray-configs/gpu.yaml with ``engine`` merged into its application's engine."""
    config = yaml.safe_load((CONFIGS / "gpu.yaml").read_text())
    config["applications"][0]["args"]["engine"].update(engine)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_typo_in_engine_args_fails_the_deploy_locally(tmp_path: Path) -> None:
    # The keys are checked against the installed vLLM: a gateway-only install has none.
    pytest.importorskip("vllm", reason="engine_args are checked against the installed vLLM")
    path = _config_with(tmp_path, engine_args={"quantisation": "awq"})
    with pytest.raises(ConfigError) as failure:
        prepare_config(path, SETTINGS)
    message = str(failure.value)
    assert "application 'charserve'" in message
    assert "engine.engine_args" in message
    assert "'quantisation'" in message and "did you mean 'quantization'" in message


def test_a_bad_engine_value_fails_the_deploy_locally(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.max_model_len"):
        prepare_config(_config_with(tmp_path, max_model_len="lots"), SETTINGS)


def test_good_engine_args_pass(tmp_path: Path) -> None:
    config = prepare_config(_config_with(tmp_path, engine_args={"quantization": "awq"}), SETTINGS)
    assert config["applications"][0]["args"]["engine"]["engine_args"] == {"quantization": "awq"}


def test_without_the_workers_package_the_args_check_is_skipped_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "workers.deployment", None)  # import raises ImportError
    path = _config_with(tmp_path, engine_args={"quantisation": "awq"})
    with capture_logs() as logs:
        prepare_config(path, SETTINGS)
    notes = [e for e in logs if e["event"].startswith("application args not checked")]
    assert [(n["application"], n["model"]) for n in notes] == [
        ("charserve", "workers.deployment:WorkerArgs")
    ]
