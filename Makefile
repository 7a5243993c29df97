# Set-up lives here so that a fresh clone needs only `make demo` or `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= configs/tiny.yaml
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip setuptools wheel
	# torch is pinned to 2.13.0: pip takes its CPU wheel from local disk (an unpinned torch pulls CUDA)
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/smolflow run $(RECIPE)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
