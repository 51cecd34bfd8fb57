# The README's two commands. Both create .venv if missing and install with torch pinned (constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# The tiny Qwen3.6 MedPix recipe: EP2 x CP2, FSDP2, selective AC and torch.compile at once on 4 CPU processes.
RECIPE ?= recipes/tiny/qwen3_6_medpix_tiny.yaml
NPROC ?= 4
ARGS ?=

.PHONY: run test lint install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m nemo_ac.train $(RECIPE) $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m nemo_ac.config.reference --check docs/config_reference.md

test: lint
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
