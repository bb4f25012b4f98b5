# Two commands do all set-up on a fresh machine:  `make demo` (main job)  and  `make test` (test suite).
# `make test-fast` skips the tests marked slow (about 2 minutes on 2 cores; every module still covered).
PYTHON ?= python3
STAMP := .venv-stamp

.PHONY: install demo test test-fast bench clean

# torch==2.13.0 first: a CPU build is on disk; the project's torch range keeps it (no CUDA wheels pulled).
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m oomdoctor diagnose meta-llama/Llama-2-7b-hf --gpu-mem 24GB --seq-len 1024
	$(PYTHON) -m oomdoctor tune meta-llama/Llama-2-7b-hf --gpu-mem 24GB --seq-len 1024 --global-batch 32 --output runs/demo/llama2-7b-24gb.yaml --force
	$(PYTHON) -m oomdoctor train runs/demo/llama2-7b-24gb.yaml --dry-run
	$(PYTHON) -m oomdoctor train configs/train/tiny-cpu.yaml --overwrite

# One pytest worker per core (pytest-xdist, at most 4; worksteal evens out the long torchrun tests) and one
# intra-op thread each: the tiny tensors gain nothing from more, and spinning threads cost on a shared box.
XDIST := -n auto --maxprocesses 4 --dist worksteal

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q $(XDIST) -m "not slow"

# Every benchmark in its quick mode (a smoke run of each table against its goal); drop --quick for the real figures.
bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b --quick"; $(PYTHON) $$b --quick || exit 1; done

clean:
	rm -rf $(STAMP) runs .pytest_cache
