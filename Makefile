# Two commands do all set-up on a fresh machine:  `make demo` (main job)  and  `make test` (test suite).
# `make test-fast` skips the tests marked slow (every module still covered); `make test-all` adds what `make test`
# leaves out (the heavy tests, the cases of slow grids off its sample); `make bench` runs every benchmark.
#
# Where it installs: the active virtualenv when one is active ($VIRTUAL_ENV), else a project venv in .venv (created
# here; `make clean` removes it). Nothing goes into the system interpreter.
# torch: one rule for `make` and a wheel install, the `torch` range in pyproject.toml (the versions tested); pip takes
# the newest build in it that it can find. On a machine without a GPU, install the CPU build first to avoid GBs of
# CUDA wheels: `pip install torch --index-url https://download.pytorch.org/whl/cpu`.
PYTHON ?= python3

ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := .venv/bin/python
endif
STAMP := $(dir $(PY)).oomdoctor-stamp

.PHONY: install demo test test-fast test-all lint format bench clean

.venv/bin/python:
	$(PYTHON) -m venv .venv

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m oomdoctor diagnose meta-llama/Llama-2-7b-hf --gpu-mem 24GB --seq-len 1024
	$(PY) -m oomdoctor tune meta-llama/Llama-2-7b-hf --gpu-mem 24GB --seq-len 1024 --global-batch 32 --output runs/demo/llama2-7b-24gb.yaml --force
	$(PY) -m oomdoctor train runs/demo/llama2-7b-24gb.yaml --dry-run
	$(PY) -m oomdoctor train configs/train/tiny-cpu.yaml --overwrite

# One pytest worker per core (pytest-xdist, at most 4; worksteal evens out the long torchrun tests) and one
# intra-op thread each: the tiny tensors gain nothing from more, and spinning threads cost on a shared box.
XDIST := -n auto --maxprocesses 4 --dist worksteal

# ruff (configured in pyproject.toml): lint, and the formatting checked; `make format` applies it.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m "not slow"

# Everything: the heavy tests and every case of every grid (make test leaves those out: tests/conftest.py).
test-all: $(STAMP)
	OOMDOCTOR_TEST_ALL=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST)

# Every benchmark in its quick mode (a smoke run of each table against its goal); drop --quick for the real figures.
bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b --quick"; $(PY) $$b --quick || exit 1; done

clean:
	rm -rf .venv runs .pytest_cache
