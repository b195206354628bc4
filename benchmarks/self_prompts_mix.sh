#!/bin/bash
# Data-source arms at equal training tokens (docs/reference-run.md, "Requests the target writes itself"):
#   sharegpt   the first 5,000 regenerated ShareGPT conversations of the reference run (one epoch)
#   self       requests SmolLM2 writes itself (`mtptrain self-prompts`, Magpie), answered by `mtptrain regenerate`,
#              about as many tokens (one epoch)
#   mix        both stores as one (train.features as a list), for the sharegpt arm's training tokens
# Each is the reference recipe at train.lr 4e-3, evaluated by chain K=3 on the first 40 MT-bench first turns and on
# the 40 first turns of benchmarks/prompts/unseen-40.jsonl (64 tokens, greedy, one repeat). Every stage is a CLI
# run that resumes, so rerunning the script finishes what is missing. About 3 h on a 2-core CPU.
#
#   REFERENCE=runs/reference/regenerated.jsonl bash benchmarks/self_prompts_mix.sh [OUT=runs/self-prompts-mix]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/self-prompts-mix}
REFERENCE=${REFERENCE:?set REFERENCE to a regenerated ShareGPT file with at least 5,000 rows}
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m mtptrain.cli)
R=(--recipe recipes/reference.yaml --no-progress)
mkdir -p "$OUT"

# the ShareGPT store: the first 5,000 rows of the reference regeneration
if [ ! -s "$OUT/sharegpt.jsonl" ]; then
  head -n 5000 "$REFERENCE" > "$OUT/sharegpt.tmp" && mv "$OUT/sharegpt.tmp" "$OUT/sharegpt.jsonl"
fi
"${CLI[@]}" precompute "${R[@]}" --no-wandb --set data.regenerated="$OUT/sharegpt.jsonl" \
  --set data.max_conversations=5000 --set precompute.output_dir="$OUT/sharegpt-features"

# the self-prompts store: 7,600 requests sampled, those kept answered by the target
"${CLI[@]}" self-prompts "${R[@]}" --set self_prompts.output="$OUT/self-prompts.jsonl" --set self_prompts.count=7600
SELF=(--set data.source="$OUT/self-prompts.jsonl" --set data.max_conversations=100000
      --set data.regenerated="$OUT/self-regenerated.jsonl" --set precompute.output_dir="$OUT/self-features")
"${CLI[@]}" regenerate "${R[@]}" "${SELF[@]}"
"${CLI[@]}" precompute "${R[@]}" --no-wandb "${SELF[@]}"

# the mix trains for the sharegpt arm's tokens: the step count whose batch plan comes nearest
STEPS=$("$PY" - "$OUT" <<'EOF'
import sys
from mtptrain.features.stores import open_stores
from mtptrain.config import load_recipe
from mtptrain.train.data import steps_for_tokens
out = sys.argv[1]
wanted = sum(open_stores(f"{out}/sharegpt-features", "train", verify="size").lengths())
lengths = open_stores([f"{out}/sharegpt-features", f"{out}/self-features"], "train", verify="size").lengths()
print(steps_for_tokens(lengths, 8, load_recipe("recipes/reference.yaml").train.seed, wanted))
EOF
)

for arm in sharegpt self mix; do
  case $arm in
    sharegpt) data=(--set train.features="$OUT/sharegpt-features" --set train.epochs=1) ;;
    self) data=(--set train.features="$OUT/self-features" --set train.epochs=1) ;;
    mix) data=(--set "train.features=[$OUT/sharegpt-features, $OUT/self-features]" --set train.max_steps="$STEPS") ;;
  esac
  TRAIN=("${data[@]}" --set train.output_dir="$OUT/$arm/train" --set train.head_snapshots=false --set train.lr=4.0e-3)
  "${CLI[@]}" train "${R[@]}" --no-wandb "${TRAIN[@]}"
  for set in mtbench unseen; do
    prompts=mtbench; [ $set = unseen ] && prompts=benchmarks/prompts/unseen-40.jsonl
    if [ ! -s "$OUT/$arm/eval-$set/results.json" ]; then
      "${CLI[@]}" eval "${R[@]}" --no-wandb "${TRAIN[@]}" --set eval.head="$OUT/$arm/train/head" \
        --set eval.prompts=$prompts --set eval.methods=[chain] --set "eval.k=[3]" --set eval.max_prompts=40 \
        --set eval.max_turns=1 --set eval.repeats=1 --set eval.output_dir="$OUT/$arm/eval-$set"
    fi
  done
done
