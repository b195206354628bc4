# Everything a fresh machine needs, from the project's own files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Overrides for the quickstart, e.g. make quickstart SET="data.max_conversations=50"
SET     ?=

.PHONY: setup quickstart reference pretrained test bench gpu-check clean

$(BIN)/mtptrain: pyproject.toml scripts/setup.sh
	VENV=$(VENV) PY=$(PY) bash scripts/setup.sh
	touch $@

setup: $(BIN)/mtptrain

quickstart: setup
	$(BIN)/mtptrain precompute --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain train --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain eval --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))

# The reference run (about 3 hours on a 2-core CPU, docs/reference-run.md): self-distilled data, EAGLE-3 head, MT-bench
# eval at temperature 0 (both turns), then the chain again at temperature 1 (first turns).
reference: setup
	$(BIN)/mtptrain pipeline --recipe recipes/reference.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain eval --recipe recipes/reference.yaml --set eval.temperature=1 --set eval.methods=[chain] \
		--set eval.k=[3] --set eval.max_turns=1 --set eval.output_dir=runs/reference/eval-t1 $(foreach s,$(SET),--set $(s))

# Replace the head shipped in pretrained/ by the one the reference run just trained (its README, eval results).
pretrained: reference
	$(BIN)/python scripts/ship_reference_head.py

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/precompute_throughput.py
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/engine_speed.py
	$(BIN)/python benchmarks/stage_speed.py

# The GPU acceptance check (docs/benchmarks.md, "GPU check"): about 25 minutes on one H100, offline; writes
# runs/gpu-check/gpu_check.json and gpu_check.md. On a machine without CUDA its GPU parts are recorded as not run;
# scripts/gpu_check.py --dry-run runs them on the CPU at a tiny size.
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf runs .pytest_cache
