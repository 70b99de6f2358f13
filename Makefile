# Everything a fresh machine needs: `make demo` and `make test` each build the
# virtual environment first (Python 3.11+, vLLM 0.33.0 from PyPI, ~5 min once).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean-venv

$(STAMP): pyproject.toml
	scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,mooncake,ray]'
	touch $(STAMP)

# Replay the bundled #51295 fixture through vLLM's real scheduler and check it.
demo: $(STAMP)
	$(BIN)/replayer check fixtures/scenarios/vllm51295_turn1_24577.yaml

# The test suite CI runs.
test: $(STAMP)
	PY=$(BIN)/python scripts/run-tests.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/replay_conversation.py

clean-venv:
	rm -rf $(VENV)
