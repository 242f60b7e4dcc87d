"""Every file in ``ray-configs/`` validated with Ray's own schema classes, and with ours.

- Serve configs: ``ServeDeploySchema`` (which also imports the autoscaling policy),
  ``ReplicaConfig.create`` per deployment (the controller's check that the replica actor
  fits in its first placement-group bundle), our ``WorkerArgs`` for the app args and
  ``BacklogConfig`` for the policy kwargs, plus the rules the GPU path relies on.
- ``cluster.yaml``: Ray's autoscaler ``prepare_config`` + ``validate_config`` (what
  ``ray up`` runs before it touches a cloud).
- ``rayservice.yaml``: the ``serveConfigV2`` string as a Serve config, the RayCluster spec
  through the KubeRay autoscaler's own parser (which ends in ``validate_config``), and the
  Redis URL and model agreeing between the workers, the policy and the gateway.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve._private.config import ReplicaConfig
from ray.serve.schema import ServeDeploySchema

from cluster.errors import ConfigError
from cluster.ops.deploy import prepare_config as prepare_deploy
from cluster.ops.serve_config import BACKLOG_POLICY, config_path, gateway_env, load_serve_config
from cluster.runtime.settings import Settings
from workers.deployment import WorkerArgs, graceful_shutdown_timeout_s
from workers.scaling.backlog import BacklogConfig

CONFIGS = Path(__file__).resolve().parents[2] / "ray-configs"


def _load(name: str) -> Any:
    return yaml.safe_load((CONFIGS / name).read_text())


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((CONFIGS / name).read_text()) if d]


def _kind(path: Path) -> str:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if len(docs) == 1 and "applications" in docs[0]:
        return "serve"
    if len(docs) == 1 and "provider" in docs[0]:
        return "cluster"
    if docs and all("kind" in d and "apiVersion" in d for d in docs):
        return "kubernetes"
    return "unknown"


SERVE_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if _kind(p) == "serve")
GPU_CONFIGS = [n for n in SERVE_CONFIGS if n.startswith("gpu")]


def test_every_config_is_one_that_these_tests_validate() -> None:
    kinds = {p.name: _kind(p) for p in CONFIGS.glob("*.yaml")}
    assert "unknown" not in kinds.values(), kinds
    assert {"local-cpu.yaml", "simulated.yaml", "gpu.yaml", "gpu-tp2.yaml"} <= set(SERVE_CONFIGS)
    assert kinds["cluster.yaml"] == "cluster"
    assert kinds["rayservice.yaml"] == "kubernetes"


def check_serve_config(config: dict[str, Any]) -> None:
    """Everything a Serve config of ours must satisfy before a cluster sees it."""
    schema = ServeDeploySchema.model_validate(config)
    assert schema.proxy_location == "Disabled"  # the gateway is the only front door
    for app in config["applications"]:
        assert app["import_path"] == "workers.deployment:build_app"
        args = WorkerArgs.model_validate(app.get("args", {}))
        for deployment in app.get("deployments", []):
            assert deployment["name"] == "CharserveWorker"
            actor = deployment.get("ray_actor_options", {})
            ReplicaConfig.create(
                "workers.deployment:WorkerReplica",
                ray_actor_options=copy.deepcopy(actor),
                placement_group_bundles=deployment.get("placement_group_bundles"),
                placement_group_strategy=deployment.get("placement_group_strategy"),
            )
            if "graceful_shutdown_timeout_s" in deployment:
                # A stopping replica must be able to drain before Serve kills it.
                assert deployment["graceful_shutdown_timeout_s"] >= graceful_shutdown_timeout_s(
                    args
                )
            policy = (deployment.get("autoscaling_config") or {}).get("policy")
            if policy is not None:
                assert policy["policy_function"] == BACKLOG_POLICY
                BacklogConfig.model_validate(policy.get("policy_kwargs", {}))
            check_gpu_placement(args, deployment)


def check_gpu_placement(args: WorkerArgs, deployment: dict[str, Any]) -> None:
    """One replica per GPU; tensor parallelism through one GPU bundle per shard."""
    engine = args.engine
    actor = deployment.get("ray_actor_options", {})
    bundles = deployment.get("placement_group_bundles")
    if engine.device != "cuda":
        assert not actor.get("num_gpus") and not bundles
        return
    if engine.tensor_parallel_size == 1:
        assert actor.get("num_gpus") == 1 and not bundles
        assert engine.executor_backend() is None
        return
    gpu_bundles = [b for b in bundles or [] if b.get("GPU")]
    assert len(gpu_bundles) == engine.tensor_parallel_size
    assert all(b["GPU"] == 1 for b in gpu_bundles)  # vLLM: at most one GPU per bundle
    assert not actor.get("num_gpus")  # the GPUs are the workers', not the replica actor's
    assert deployment.get("placement_group_strategy") == "STRICT_PACK"
    assert engine.engine_kwargs(engine.model or "m")["distributed_executor_backend"] == "ray"


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_validates(name: str) -> None:
    check_serve_config(_load(name))


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_runs_cuda_vllm_on_a_real_model(name: str) -> None:
    app = _load(name)["applications"][0]
    args = WorkerArgs.model_validate(app["args"])
    assert args.engine_kind == "vllm" and args.engine.device == "cuda"
    assert args.engine.model is not None and "/" in args.engine.model  # a Hub model id
    assert args.engine.served_model_name
    autoscaling = app["deployments"][0]["autoscaling_config"]
    assert autoscaling["min_replicas"] >= 1  # the policy reads the queue, not Serve traffic


def test_a_bundle_that_cannot_hold_the_replica_is_refused() -> None:
    config = _load("gpu-tp2.yaml")
    deployment = config["applications"][0]["deployments"][0]
    deployment["placement_group_bundles"][0] = {"GPU": 1}  # no CPU for the actor
    with pytest.raises(ValueError, match="first bundle"):
        check_serve_config(config)


def test_a_typo_in_the_app_args_is_refused() -> None:
    config = _load("gpu.yaml")
    config["applications"][0]["args"]["engine"]["tensor_paralel_size"] = 2
    with pytest.raises(ValueError, match="tensor_paralel_size"):
        check_serve_config(config)


def _cluster_config() -> dict[str, Any]:
    return prepare_config(copy.deepcopy(_load("cluster.yaml")))


def test_cluster_config_validates_with_the_autoscaler_schema() -> None:
    config = _cluster_config()
    validate_config(config)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not head["resources"].get("GPU") and head["resources"]["CPU"] == 0
    assert any(t["resources"].get("GPU") for t in types.values())


def test_cluster_config_has_gpus_for_the_largest_gpu_deployment() -> None:
    types = _cluster_config()["available_node_types"]
    for name in GPU_CONFIGS:
        deployment = _load(name)["applications"][0]["deployments"][0]
        args = WorkerArgs.model_validate(_load(name)["applications"][0]["args"])
        per_replica = args.engine.tensor_parallel_size
        fits = [
            t["max_workers"] * (int(t["resources"].get("GPU", 0)) // per_replica)
            for t in types.values()
        ]
        assert max(fits) >= deployment["autoscaling_config"]["max_replicas"], name


def test_cluster_config_typo_is_refused() -> None:
    config = _load("cluster.yaml")
    config["available_node_types"]["gpu_l4"]["max_worker"] = 3
    with pytest.raises(Exception, match="max_worker"):
        validate_config(prepare_config(config))


def _rayservice() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    docs = _documents("rayservice.yaml")
    services = [d for d in docs if d["kind"] == "RayService"]
    assert len(services) == 1
    return services[0], docs


def test_rayservice_serve_config_validates() -> None:
    service, _ = _rayservice()
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    check_serve_config(serve_config)
    app = serve_config["applications"][0]
    # KubeRay posts this string as it is: nothing fills the Redis in for it.
    policy_kwargs = app["deployments"][0]["autoscaling_config"]["policy"]["policy_kwargs"]
    assert policy_kwargs["redis_url"] == app["args"]["redis_url"]
    assert policy_kwargs["namespace"] == app["args"]["namespace"]


def test_rayservice_cluster_parses_with_the_kuberay_autoscaler() -> None:
    service, _ = _rayservice()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"].startswith("2.")
    assert cluster["enableInTreeAutoscaling"] is True
    ray_cr = {"metadata": {"name": "charserve", "namespace": "default"}, "spec": cluster}
    autoscaling = _derive_autoscaling_config_from_ray_cr(copy.deepcopy(ray_cr))
    types = autoscaling["available_node_types"]
    assert types["headgroup"]["resources"].get("GPU", 0) == 0
    gpus = sum(t["max_workers"] * t["resources"].get("GPU", 0) for t in types.values())
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    deployment = serve_config["applications"][0]["deployments"][0]
    assert gpus >= deployment["autoscaling_config"]["max_replicas"]


def test_rayservice_ships_a_redis_and_a_gateway_that_agree_with_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, docs = _rayservice()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "charserve-redis"), ("Service", "charserve-redis")} <= kinds
    assert {("Deployment", "charserve-gateway"), ("Service", "charserve-gateway")} <= kinds
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    args = WorkerArgs.model_validate(app["args"])
    assert args.redis_url == "redis://charserve-redis:6379/0"
    gateway = next(d for d in docs if d["metadata"]["name"] == "charserve-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    for name, value in env.items():  # read as the gateway reads them: from its environment
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.redis_url == args.redis_url
    assert settings.namespace == args.namespace
    assert settings.model == args.engine.model
    assert settings.served_model_name == args.engine.served_model_name
    assert settings.max_model_len == args.engine.max_model_len
    # A shared gateway: keys required, and every tenant under limits.
    assert settings.auth == "keys"
    assert settings.tenant_limits.max_running > 0


# -- charserve deploy's completion of a config ------------------------------------------


def test_deploy_fills_redis_namespace_and_policy_kwargs() -> None:
    settings = Settings(redis_url="redis://10.0.0.5:6379/0", namespace="prod")
    config = prepare_deploy(CONFIGS / "gpu.yaml", settings)
    app = config["applications"][0]
    assert app["args"]["redis_url"] == "redis://10.0.0.5:6379/0"
    assert app["args"]["namespace"] == "prod"
    kwargs = app["deployments"][0]["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["redis_url"] == "redis://10.0.0.5:6379/0"
    assert kwargs["namespace"] == "prod"
    assert kwargs["queue_policy"] == "edf" and kwargs["heartbeat_ms"] == 1000
    assert kwargs["target_utilization"] == 0.75  # the file's own settings stay
    check_serve_config(config)


def test_deploy_refuses_a_config_without_redis() -> None:
    with pytest.raises(ConfigError, match="no Redis"):
        prepare_deploy(CONFIGS / "gpu.yaml", Settings(redis_url=None))


def test_deploy_refuses_bad_policy_kwargs(tmp_path: Path) -> None:
    config = _load("gpu.yaml")
    policy = config["applications"][0]["deployments"][0]["autoscaling_config"]["policy"]
    policy["policy_kwargs"]["target_utilisation"] = 0.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="target_utilisation"):
        prepare_deploy(path, Settings(redis_url="redis://127.0.0.1:6379/0"))


def test_deploy_prints_the_matching_gateway_environment_without_secrets() -> None:
    settings = Settings(redis_url="rediss://app:s3cret@redis.internal:6380/0")
    env = gateway_env(prepare_deploy(CONFIGS / "gpu.yaml", settings))
    assert env["CHARSERVE_REDIS_URL"] == "rediss://app:***@redis.internal:6380/0"
    assert env["CHARSERVE_MODEL"] == "Qwen/Qwen2.5-7B-Instruct"
    assert env["CHARSERVE_SERVED_MODEL_NAME"] == "qwen2.5-7b-instruct"
    assert env["CHARSERVE_MAX_MODEL_LEN"] == "8192"


def test_up_and_deploy_give_workers_the_settings_a_gateway_shares() -> None:
    settings = Settings(
        redis_url="redis://127.0.0.1:1/0", namespace="cell-7", heartbeat_ms=250, reply_log_ttl_s=99
    )
    config = load_serve_config(CONFIGS / "local-cpu.yaml", settings)
    args = WorkerArgs.model_validate(config["applications"][0]["args"])
    assert (args.namespace, args.heartbeat_ms, args.reply_log_ttl_s) == ("cell-7", 250, 99)
    env = gateway_env(config)
    assert env["CHARSERVE_NAMESPACE"] == "cell-7"
    assert env["CHARSERVE_HEARTBEAT_MS"] == "250" and env["CHARSERVE_REPLY_LOG_TTL_S"] == "99"
    # What the file sets itself stays.
    assert args.queue_policy == "edf" and args.batch_reserve_slots == 16


def test_the_default_serve_config_is_found_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    found = config_path("ray-configs/local-cpu.yaml")
    assert found.is_file() and found.is_absolute()
    with pytest.raises(ConfigError, match="not found"):
        config_path("ray-configs/nope.yaml")


def test_the_command_line_runs_as_a_module_and_says_its_version() -> None:
    # charserve up starts its gateways with ``python -m cluster.ops.cli``: the module must
    # work as __main__, not only through the console script.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cluster.ops.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("charserve ")
