# Everything a fresh machine needs, from the project's own files.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Overrides for the quickstart and the reference run, e.g. make quickstart SET="data.max_conversations=50"
SET     ?=
# Options of the reference run's commands, e.g. make reference OPTS=--no-progress (a log file, not a terminal)
OPTS    ?=

.PHONY: setup quickstart reference pretrained test bench gpu-check clean

$(BIN)/mtptrain: pyproject.toml scripts/setup.sh
	VENV=$(VENV) PY=$(PY) bash scripts/setup.sh
	touch $@

setup: $(BIN)/mtptrain

quickstart: setup
	$(BIN)/mtptrain precompute --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain train --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain eval --recipe recipes/quickstart.yaml $(foreach s,$(SET),--set $(s))

# The reference run (about 5 h 15 min on a 2-core CPU, docs/reference-run.md): the target's requests
# (self-prompts) and their answers in a second feature store, then the pipeline (ShareGPT answered by the target,
# EAGLE-3 head trained on both stores, MT-bench eval at temperature 0, both turns), then chains again at temperature 1
# (first turns), the head drafting at 0.85 (accepted more than at 1), K=3 and K=5, each with and without a stop at
# 0.45 (the fastest at temperature 1: docs/reference-run.md, "What limits it"), and a 4-node tree of branch 2 whose
# children are drawn from the head (tau 5-6% above the chain's for one row more: on a Zen 4 1.20x against 1.18x).
# Both evals measure every chain and tree twice, from the head's weights and from int8 copies of them (the
# recipe's eval.draft_weights).
# Every command resumes where it stopped: rerun make reference.
# The second store's directory (prompts.jsonl, regenerated.jsonl, features/), as recipes/reference.yaml names it.
SELF_DIR ?= runs/reference/self
SELF := --set self_prompts.output=$(SELF_DIR)/prompts.jsonl --set data.source=$(SELF_DIR)/prompts.jsonl \
	--set data.max_conversations=100000 --set data.regenerated=$(SELF_DIR)/regenerated.jsonl \
	--set precompute.output_dir=$(SELF_DIR)/features
STORES := --set "train.features=[runs/reference/features, $(SELF_DIR)/features]"
reference: setup
	$(BIN)/mtptrain self-prompts --recipe recipes/reference.yaml $(OPTS) $(SELF) $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain regenerate --recipe recipes/reference.yaml $(OPTS) $(SELF) $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain precompute --recipe recipes/reference.yaml $(OPTS) $(SELF) $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain pipeline --recipe recipes/reference.yaml $(OPTS) $(STORES) $(foreach s,$(SET),--set $(s))
	$(BIN)/mtptrain eval --recipe recipes/reference.yaml $(OPTS) $(STORES) --set eval.temperature=1 \
		--set eval.methods=[chain,tree] --set "eval.k=[3,5]" --set "eval.chain.stops=[0,0.45]" \
		--set "eval.chain.draft_temperatures=[0.85]" --set "eval.tree.budgets=[4]" --set eval.tree.branch=2 \
		--set "eval.tree.draft_temperatures=[0.85]" \
		--set eval.max_turns=1 --set eval.output_dir=runs/reference/eval-t1 $(foreach s,$(SET),--set $(s))

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
