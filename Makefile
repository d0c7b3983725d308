# plait: two entry points for a fresh machine, `make demo` and `make test`.
# The CPU wheel of torch is installed first and pinned, so nothing pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed
DOCS := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict --quiet

.PHONY: install demo test lint typecheck check bench bench-fused docs clean

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
test: install
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q
	$(DOCS)

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

# The documentation site (mkdocs.yml, docs/) into site/; strict: broken links fail.
docs: install
	$(DOCS)

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
