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
# pytest-xdist workers for `make test`, each test file on one worker (--dist loadfile: a module's fixtures run once).
# A functional test leaves cores idle while its ranks start up, wait on gloo or wait for the rank that compiles a
# graph for the node; a second worker fills them (the whole suite: 2,087 s serial, 1,332 s with 2 on 2 cores).
TEST_WORKERS ?= 2
# `make test-torch`: the workaround regression tests (TESTS=all: the whole suite) on another torch release, in
# .venv-torch-$(TORCH) (scripts/test_torch.sh).
TORCH ?= 2.14.1
TESTS ?=

.PHONY: run test test-torch lint install clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --no-compile -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

run: install
	OMP_NUM_THREADS=1 $(VENV)/bin/nemo-ac train $(RECIPE) --nproc-per-node $(NPROC) $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m nemo_ac.config.reference --check docs/config_reference.md

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-torch:
	PYTHON=$(PYTHON) bash scripts/test_torch.sh $(TORCH) $(TESTS) $(ARGS)

clean:
	rm -rf $(VENV) .venv-torch-* runs .pytest_cache .ruff_cache
