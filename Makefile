# make test (what CI runs) and make run (the tiny Qwen3.6 MedPix recipe). Both create .venv if missing and install
# with torch pinned (constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# The tiny Qwen3.6 MedPix recipe: EP2 x CP2, FSDP2, selective AC and torch.compile at once on 4 CPU processes.
# `nemo-ac train` validates the recipe once, then execs torchrun (nemo_ac.launch: one-line failures).
RECIPE ?= recipes/tiny/qwen3_6_medpix_tiny.yaml
NPROC ?= 4
ARGS ?=
# Extras installed into .venv (CI adds automodel: EXTRAS=dev,automodel).
EXTRAS ?= dev
# `make test-torch`: the workaround regression tests (TESTS=all: the whole suite) on another torch release, in
# .venv-torch-$(TORCH) (scripts/test_torch.sh).
TORCH ?= 2.14.1
TESTS ?=

.PHONY: run test test-torch lint install clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

run: install
	OMP_NUM_THREADS=1 $(VENV)/bin/nemo-ac train $(RECIPE) --nproc-per-node $(NPROC) $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m nemo_ac.config.reference --check docs/config_reference.md

# Inductor compiles with a pool of min(32, cores) worker processes in every process that compiles; with 2-4 gloo
# ranks per test on a small CI machine the pools cost more than they save (tests/functional/test_compile_once.py on
# 2 cores: 120 s -> 98 s with one compile thread). Set TORCHINDUCTOR_COMPILE_THREADS to override.
test: lint
	TORCHINDUCTOR_COMPILE_THREADS=$${TORCHINDUCTOR_COMPILE_THREADS:-1} $(PY) -m pytest -q $(ARGS)

test-torch:
	PYTHON=$(PYTHON) bash scripts/test_torch.sh $(TORCH) $(TESTS) $(ARGS)

clean:
	rm -rf $(VENV) .venv-torch-* runs .pytest_cache .ruff_cache
