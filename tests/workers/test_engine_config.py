"""``EngineConfig.engine_args``: any vLLM ``EngineArgs`` keyword, passed through.

Checked against the installed vLLM's own ``EngineArgs`` when the config is built (a typo
fails the Serve build, not a replica's start), rendered into the workers' engine keywords
and into the command line of vLLM's own server (parsed back here with vLLM's parser), and
every Serve config in ``ray-configs/``, the worked examples in ``ray-configs/examples/``
included, validated the way ``tests/cluster/test_configs.py`` validates them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tests.cluster.test_configs import _kind, check_serve_config
from workers.deployment import WorkerArgs, build_app
from workers.engines.config import OWNED_ENGINE_ARGS, EngineConfig

CONFIGS = Path(__file__).resolve().parents[2] / "ray-configs"
# Every Serve config, as paths under ray-configs/ (the examples are one folder down).
ALL_SERVE_CONFIGS = sorted(
    str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml") if _kind(p) == "serve"
)
EXAMPLES = sorted(p.name for p in (CONFIGS / "examples").glob("*.yaml"))


def _load(name: str) -> Any:
    return yaml.safe_load((CONFIGS / name).read_text())


def _engine(name: str) -> EngineConfig:
    return WorkerArgs.model_validate(_load(name)["applications"][0]["args"]).engine


@pytest.fixture(scope="module")
def engine_args_fields() -> dict[str, dataclasses.Field[Any]]:
    """vLLM's own EngineArgs fields (the test needs vLLM, as the check it tests does)."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    return {f.name: f for f in dataclasses.fields(arg_utils.EngineArgs)}


@pytest.fixture(scope="module")
def vllm_server_parser(engine_args_fields: dict[str, Any]) -> argparse.ArgumentParser:
    """The parser ``python -m vllm.entrypoints.openai.api_server`` reads its flags with."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser())
    return parser


def _refusal(engine_args: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        EngineConfig(engine_args=engine_args)
    return str(caught.value)


# -- what reaches vLLM ------------------------------------------------------------------


def test_engine_args_reach_vllm_beside_the_typed_settings(
    engine_args_fields: dict[str, Any],
) -> None:
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    config = EngineConfig(
        device="cuda",
        max_model_len=4096,
        engine_args={"quantization": "awq", "speculative_config": speculative},
    )
    kwargs = config.engine_kwargs("/models/m")
    assert kwargs["quantization"] == "awq"
    assert kwargs["speculative_config"] == speculative
    assert kwargs["max_model_len"] == 4096 and kwargs["scheduling_policy"] == "priority"
    assert set(kwargs) <= set(engine_args_fields)
    # vLLM writes into the dicts it is given (the target model into speculative_config):
    # the config's own must not change with it.
    kwargs["speculative_config"]["target_model_config"] = object()
    assert config.engine_args["speculative_config"] == speculative


def test_no_engine_args_changes_nothing() -> None:
    config = EngineConfig()
    assert config.engine_args == {}
    assert "quantization" not in config.engine_kwargs("m")
    assert config.server_args("m", "127.0.0.1", 1)[-1] == "--enable-prefix-caching"


# -- what is refused --------------------------------------------------------------------


def test_a_typo_names_the_key_and_its_close_matches(engine_args_fields: dict[str, Any]) -> None:
    message = _refusal({"quantisation": "awq"})
    assert "'quantisation' is not an argument of vLLM" in message
    assert "did you mean 'quantization'" in message


def test_a_typo_inside_speculative_config_is_named(engine_args_fields: dict[str, Any]) -> None:
    message = _refusal({"speculative_config": {"method": "ngram", "num_speculative_token": 4}})
    assert "speculative_config: 'num_speculative_token' is not a field of vLLM's" in message
    assert "did you mean 'num_speculative_tokens'" in message
    # vLLM reads these dicts with kebab-case keys too.
    EngineConfig(engine_args={"speculative_config": {"num-speculative-tokens": 4}})


def test_a_typo_inside_a_config_class_dict_is_named(engine_args_fields: dict[str, Any]) -> None:
    message = _refusal({"compilation_config": {"cudagraph_mod": "FULL"}})
    assert "'cudagraph_mod' is not a field of vLLM's CompilationConfig" in message
    assert "'cudagraph_mode'" in message


@pytest.mark.parametrize("key", sorted(OWNED_ENGINE_ARGS))
def test_what_a_typed_field_sets_is_refused_in_engine_args(key: str) -> None:
    message = _refusal({key: 1})
    assert f"'{key}' cannot be set in engine_args" in message
    if key in EngineConfig.model_fields:
        assert f"set engine.{key}" in message  # one way to set a thing


def test_the_refused_keys_are_the_typed_fields_vllm_knows(
    engine_args_fields: dict[str, Any],
) -> None:
    # Every refusal names a real EngineArgs field (a vLLM rename would show here), and
    # every typed field that is also an EngineArgs field is refused in engine_args.
    assert set(OWNED_ENGINE_ARGS) <= set(engine_args_fields)
    typed = set(EngineConfig.model_fields) & set(engine_args_fields)
    assert typed <= set(OWNED_ENGINE_ARGS)


@pytest.mark.parametrize(
    ("engine_args", "expected"),
    [
        ({"trust_remote_code": "yes"}, "trust_remote_code is 'yes', not true or false"),
        ({"max_loras": 2.5}, "max_loras is 2.5, not an integer"),
        ({"max_loras": True}, "max_loras is True, not an integer"),
        ({"cpu_offload_gb": "4"}, "cpu_offload_gb is '4', not a number"),
        ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype is 'fp9', not one of 'auto'"),
        ({"max_lora_rank": True}, "max_lora_rank is True, not one of 1, 8"),
        ({"enable_lora": None}, "enable_lora may not be null"),
    ],
)
def test_values_are_checked_where_vllm_types_them_simply(
    engine_args_fields: dict[str, Any], engine_args: dict[str, Any], expected: str
) -> None:
    assert expected in _refusal(engine_args)


def test_values_vllm_accepts_are_accepted(engine_args_fields: dict[str, Any]) -> None:
    EngineConfig(
        engine_args={
            "cpu_offload_gb": 4,  # an integer where vLLM wants a float
            "kv_cache_dtype": "fp8",
            "max_lora_rank": 16,
            "tokenizer_mode": "my-plugin-mode",  # a Literal or any str
            "quantization": None,  # Optional
            "hf_overrides": {"rope_scaling": {"type": "yarn", "factor": 2.0}},
            "lora_target_modules": ["q_proj", "v_proj"],
        }
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (datetime.date(2024, 1, 1), "revision: a date is not a JSON value"),
        ({"nested": {1: "x"}}, "revision.nested: key 1 is not a string"),
        (["a", {1, 2}], "revision[1]: a set is not a JSON value"),
    ],
)
def test_values_must_be_json(value: Any, expected: str) -> None:
    # YAML turns an unquoted 2024-01-01 into a date: a revision needs quotes.
    assert expected in _refusal({"revision": value})


def test_vllm_internal_fields_are_refused() -> None:
    assert "'_api_process_count' is internal to vLLM" in _refusal({"_api_process_count": 2})


def test_every_problem_is_named_at_once(engine_args_fields: dict[str, Any]) -> None:
    message = _refusal({"quantisation": "awq", "seed": 1, "max_loras": "2"})
    assert "quantisation" in message and "'seed'" in message and "max_loras" in message


def test_without_vllm_only_the_checks_that_need_no_vllm_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The gateway-only install has no vLLM: the replica, which has, checks the rest.
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert EngineConfig(engine_args={"quantisation": "awq"}).engine_args == {"quantisation": "awq"}
    assert "set engine.max_model_len" in _refusal({"max_model_len": 4096})
    assert "not a JSON value" in _refusal({"revision": datetime.date(2024, 1, 1)})


# -- a Serve config with a typo fails the deploy -----------------------------------------


def _with_engine_args(name: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(_load(name))
    config["applications"][0]["args"]["engine"]["engine_args"] = engine_args
    return config


def test_a_typo_in_engine_args_fails_the_serve_build(engine_args_fields: dict[str, Any]) -> None:
    # build_app is what Serve's controller runs for `charserve deploy` / `charserve up`:
    # raising there marks the application DEPLOY_FAILED, which cluster.ops.ray_serve
    # reports as a failed deploy; the replica validates the same args again at its start.
    config = _with_engine_args("gpu.yaml", {"kv_cache_dtyp": "fp8"})
    with pytest.raises(ValidationError, match="did you mean 'kv_cache_dtype'"):
        build_app(config["applications"][0]["args"])
    with pytest.raises(ValueError, match="kv_cache_dtyp"):
        check_serve_config(config)


def test_a_typed_setting_in_engine_args_fails_the_serve_build() -> None:
    config = _with_engine_args("local-cpu.yaml", {"max_num_seqs": 8})
    with pytest.raises(ValidationError, match=r"set engine\.max_num_seqs"):
        build_app(config["applications"][0]["args"])


# -- vLLM's own server gets the same settings -------------------------------------------


def test_server_args_render_engine_args_as_vllm_flags() -> None:
    config = EngineConfig(
        engine_args={
            "quantization": "awq",
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
            "trust_remote_code": True,
            "enable_chunked_prefill": False,
            "disable_log_stats": False,  # store_true in vLLM: no --no- form
            "lora_target_modules": ["q_proj", "v_proj"],
            "cpu_offload_gb": 2.5,
            "tokenizer": None,  # no command-line form: vLLM's default
        }
    )
    args = config.server_args("m", "127.0.0.1", 8100)
    tail = args[args.index("--enable-prefix-caching") + 1 :]
    assert tail == [
        "--quantization",
        "awq",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4}',
        "--trust-remote-code",
        "--no-enable-chunked-prefill",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "--cpu-offload-gb",
        "2.5",
    ]


def test_vllm_parses_the_server_args_back(vllm_server_parser: argparse.ArgumentParser) -> None:
    engine_args: dict[str, Any] = {
        "quantization": "awq",
        "kv_cache_dtype": "fp8",
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
        "trust_remote_code": True,
        "enable_chunked_prefill": False,
        "lora_target_modules": ["q_proj", "v_proj"],
        "cpu_offload_gb": 2,
        "max_lora_rank": 16,
    }
    config = EngineConfig(engine_args=engine_args)
    parsed = vllm_server_parser.parse_args(config.server_args("m", "127.0.0.1", 8100))
    assert {name: getattr(parsed, name) for name in engine_args} == engine_args
    assert parsed.max_model_len == config.max_model_len and parsed.seed == config.seed

    config = EngineConfig(engine_args={"compilation_config": {"cudagraph_mode": "FULL"}})
    parsed = vllm_server_parser.parse_args(config.server_args("m", "127.0.0.1", 8100))
    assert parsed.compilation_config.cudagraph_mode.name == "FULL"


@pytest.mark.parametrize("value", [True, False])
def test_every_vllm_boolean_renders_as_a_flag_vllm_takes(
    vllm_server_parser: argparse.ArgumentParser,
    engine_args_fields: dict[str, Any],
    value: bool,
) -> None:
    flags = {
        action.dest
        for action in vllm_server_parser._actions
        if action.nargs == 0 and action.dest in engine_args_fields
    }
    names = sorted(flags - set(OWNED_ENGINE_ARGS))
    assert "trust_remote_code" in names and "disable_log_stats" in names
    config = EngineConfig(engine_args=dict.fromkeys(names, value))
    parsed = vllm_server_parser.parse_args(config.server_args("m", "127.0.0.1", 8100))
    assert {name: getattr(parsed, name) for name in names} == dict.fromkeys(names, value)


# -- every Serve config, the worked examples included ----------------------------------


def test_the_worked_examples_are_serve_configs() -> None:
    assert set(EXAMPLES) == {
        "gpu-awq.yaml",
        "gpu-fp8-kv-cache.yaml",
        "gpu-spec-ngram.yaml",
        "gpu-spec-draft-model.yaml",
    }
    assert {f"examples/{name}" for name in EXAMPLES} <= set(ALL_SERVE_CONFIGS)
    assert "gpu.yaml" in ALL_SERVE_CONFIGS


@pytest.mark.parametrize("name", ALL_SERVE_CONFIGS)
def test_every_serve_config_validates(name: str) -> None:
    # Ray's own schema, the replica's placement, our args (and so engine_args against
    # the installed vLLM), the policy kwargs: what tests/cluster/test_configs.py checks.
    check_serve_config(_load(name))


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_runs_cuda_vllm_on_a_hub_model_with_engine_args(name: str) -> None:
    app = _load(f"examples/{name}")["applications"][0]
    args = WorkerArgs.model_validate(app["args"])
    assert args.engine_kind == "vllm" and args.engine.device == "cuda"
    assert args.engine.model is not None and "/" in args.engine.model
    assert args.engine.engine_args
    assert app["deployments"][0]["autoscaling_config"]["min_replicas"] >= 1


def test_the_examples_set_what_they_show() -> None:
    assert _engine("examples/gpu-awq.yaml").engine_args == {"quantization": "awq"}
    assert _engine("examples/gpu-fp8-kv-cache.yaml").engine_args == {"kv_cache_dtype": "fp8"}
    ngram = _engine("examples/gpu-spec-ngram.yaml").engine_args["speculative_config"]
    assert ngram["method"] == "ngram"
    assert ngram["num_speculative_tokens"] == 4 and ngram["prompt_lookup_max"] == 4
    draft = _engine("examples/gpu-spec-draft-model.yaml").engine_args["speculative_config"]
    assert draft["method"] == "draft_model" and "/" in draft["model"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_starts_vllms_own_server_alike(
    vllm_server_parser: argparse.ArgumentParser, name: str
) -> None:
    # The benchmarks' reference server (workers/baselines/vllm_server.py) takes the same
    # settings from the same file.
    engine = _engine(f"examples/{name}")
    parsed = vllm_server_parser.parse_args(engine.server_args("m", "127.0.0.1", 8100))
    for key, value in engine.engine_args.items():
        assert getattr(parsed, key) == value, key


@pytest.mark.parametrize(
    ("eager", "setting", "expected"),
    [
        (False, None, None),  # vLLM's own default (ahead-of-time on, with torch 2.10+)
        (False, True, "1"),
        (False, False, "0"),
        (True, False, None),  # eager mode compiles nothing
    ],
)
def test_ahead_of_time_compilation_is_vllms_default_unless_set(
    eager: bool, setting: bool | None, expected: str | None
) -> None:
    for device in ("cpu", "cuda"):
        config = EngineConfig(device=device, enforce_eager=eager, aot_compile=setting)
        assert config.env().get("VLLM_USE_AOT_COMPILE") == expected


def test_the_default_cpu_config_compiles_ahead_of_time_as_vllm_does() -> None:
    # What make run serves: compiled, with vLLM's ahead-of-time default (off, each token
    # cost about 9% more at one stream: docs/benchmarks.md, session 16).
    config = yaml.safe_load((CONFIGS / "local-cpu.yaml").read_text())
    engine = EngineConfig.model_validate(config["applications"][0]["args"]["engine"])
    assert not engine.enforce_eager
    assert "VLLM_USE_AOT_COMPILE" not in engine.env()
