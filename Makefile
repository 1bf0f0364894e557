# One venv in the repo root; every target installs what it needs if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch and torchvision come from this machine's local disk (pip's constraint file);
# the stamp is redone whenever setup.cfg changes.
$(STAMP): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# One worker per core (pytest-xdist), each test file whole on one worker: a file's module-scoped
# fixtures, referees and frozen objects (tests/conftest.py) stay its own.
test: $(STAMP)
	$(BIN)/ruff check lightning_replay benchmarks examples tests
	$(BIN)/ruff format --check lightning_replay benchmarks examples tests
	$(BIN)/python -m pytest -q -n auto --dist loadfile tests lightning_replay --doctest-modules

demo: $(STAMP)
	$(BIN)/python -m lightning_replay.demos.demo

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --suite quick --json benchmarks/results/quick-latest.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
