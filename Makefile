# Everything a fresh machine needs, from the project's own files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Overrides for the quickstart, e.g. make quickstart SET="data.max_conversations=50"
SET     ?=

.PHONY: setup quickstart test bench clean

$(BIN)/mtptrain: pyproject.toml scripts/setup.sh
	VENV=$(VENV) PY=$(PY) bash scripts/setup.sh
	touch $@

setup: $(BIN)/mtptrain

quickstart: setup
	$(BIN)/mtptrain precompute --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain train --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain eval --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/precompute_throughput.py
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/engine_speed.py

clean:
	rm -rf runs .pytest_cache
