# plait: two entry points for a fresh machine, `make demo` and `make test`.
# The CPU wheel of torch is installed first and pinned, so nothing pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed
DOCS := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict --quiet

.PHONY: install demo test test-all test-torch lint typecheck check bench bench-fused bench-fused-hf bench-memory race gpu-suite docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "torch==2.13.0"
	$(BIN)/python -m pip install -e ".[dev]" "torch==2.13.0"
	touch $(STAMP)

demo: install
	$(BIN)/plait demo

# The layer contract (pyproject's [tool.importlinter]), the suite, then the docs in strict
# mode. pytest's exit code 5 (no tests ran) fails the target like any other failure.
# `slow` tests (a few long emulated-cluster runs whose mechanisms shorter tests also hold)
# run in `make test-all`, so that `make test` stays within CI's time on two cores.
test: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -m "not slow"
	$(DOCS)

test-all: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
	$(DOCS)

# The suite on another torch release: `make test-torch VERSION=2.14.1` installs that torch
# and plait (editable, with the dev extra) into a venv of its own, .venv-torch-VERSION,
# then runs what `make test` runs there; the summary is kept in .venv-torch-VERSION/test.log.
# docs/install.md's support matrix records each release's result.
TORCH_VENV = .venv-torch-$(VERSION)
test-torch:
	@test -n "$(VERSION)" || { echo "usage: make test-torch VERSION=2.14.1" >&2; exit 2; }
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet "torch==$(VERSION)"
	$(TORCH_VENV)/bin/python -m pip install --quiet -e ".[dev]" "torch==$(VERSION)"
	$(TORCH_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	bash -o pipefail -c '$(TORCH_VENV)/bin/python -m pytest -q -m "not slow" \
		-p no:cacheprovider 2>&1 | tee $(TORCH_VENV)/test.log'

lint: install
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

check: lint typecheck test

bench: install
	$(BIN)/plait bench --workload resnet18 --strategies ssgd --nodes 4 --bandwidth slow,fast --out benchmarks/foundation

bench-fused: install
	$(BIN)/plait bench-fused --threads 1,2 --out benchmarks/hfta/grid

# The Hugging Face configs of examples/transformers_workloads.py as fused arrays (captured
# with torch.export) against plait's vmap fallback, the members one after another and
# torch.func's stack_module_state + vmap, at N = 4, 16, 32, on one thread and two (each
# strategy then also at its fastest count, the whole machine, as bench-fused); three
# invocations (the medians of RESULTS.md are over them), then each member's fidelity to a
# stock model at N = 16. About 13 minutes.
HF := examples/transformers_workloads.py
HF_MODELS := $(HF):gpt2,$(HF):bert,$(HF):llama,$(HF):resnet18
bench-fused-hf: install
	for i in 1 2 3; do $(BIN)/plait bench-fused --workload $(HF_MODELS) --n 4,16,32 --rounds 5 \
		--threads 1,2 --strategies fused,fallback,serial,vmap \
		--out benchmarks/hfta/hf-models-$$i; done
	$(BIN)/plait bench-fused --fidelity 10 --workload $(HF_MODELS) --n 16 \
		--out benchmarks/hfta/hf-fidelity

# The memory model against the meter on every plan shape the planner can choose
# (benchmarks/parallel/memory.sh: bundled and Hugging Face workloads, 4 ranks).
bench-memory: install
	PLAIT=$(BIN)/plait benchmarks/parallel/memory.sh

# Time to accuracy: the races of benchmarks/RESULTS.md (benchmarks/race/run.sh: the learning
# rates' tuning race, optimizers, compressors), then the 32-trial sweep fused vs trials one
# after another vs concurrent processes. Long: about an hour and a half on two cores.
race: install
	PLAIT=$(BIN)/plait benchmarks/race/run.sh
	$(BIN)/python -m plait.bench.fused.sweep_race --trials 32 --epochs 10 --repeats 3 \
		--concurrent 2 --out benchmarks/hfta/sweep-race

# The GPU suite (plait.bench.gpu_suite) for a lent GPU machine: bare (torch, the repository,
# no install step, nothing to download), so it runs from src/ with the machine's python3, in
# at most 9 minutes, into one folder (and GPU_SUITE_OUT.tar.gz beside it). Rehearse it on
# the CPU with `make gpu-suite PYTHON=.venv/bin/python GPU_SUITE_ARGS=--dry-run`.
GPU_SUITE_OUT ?= runs/gpu-suite
gpu-suite:
	PYTHONPATH=src $(PYTHON) -m plait.bench.gpu_suite --out $(GPU_SUITE_OUT) $(GPU_SUITE_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/; strict: broken links fail.
docs: install
	$(DOCS)

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
