#!/bin/bash
# Temperature-1 answers as training data (issue 39's temperature-1 target). The head learns from the target's
# greedy answers, but at temperature 1 it drafts after sampled text, which greedy answers never show it. This arm
# answers the same requests as a control head's store again, sampled at TEMPERATURE, trains a head for the control's
# training tokens with the control's settings, and evaluates both heads on the same prompts at temperature 1 and 0
# (chain K=3, first turns of MT-bench's first PROMPTS questions, 64 tokens, one repeat).
#
# The control is the mtptrain head of the side-by-side on 5,000 answer-start first turns (greedy, 64-token answers;
# benchmarks/peer_speculators.py --out runs/peer-as5k, docs/reference-run.md); its source is SOURCE. Every stage
# resumes: rerun the script.
#
#   bash benchmarks/sampled_answers_arm.sh [OUT=runs/sampled-answers] [CONTROL=runs/peer-as5k/mtptrain]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/sampled-answers}
CONTROL=${CONTROL:-runs/peer-as5k/mtptrain}
SOURCE=${SOURCE:-runs/answer-start/first-turns.jsonl}
CONVERSATIONS=${CONVERSATIONS:-5000}
TEMPERATURE=${TEMPERATURE:-1.0}
PROMPTS=${PROMPTS:-40}
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m mtptrain.cli)
R=(--recipe recipes/reference.yaml --no-progress --no-wandb)
mkdir -p "$OUT"
[ -s "$CONTROL/head/config.json" ] || { echo "error: no control head in $CONTROL/head: run the side-by-side first" >&2; exit 1; }

DATA=(--set data.source="$SOURCE" --set data.max_conversations="$CONVERSATIONS"
      --set data.regenerated="$OUT/regenerated.jsonl" --set precompute.output_dir="$OUT/features")
"${CLI[@]}" regenerate "${R[@]}" "${DATA[@]}" --set regenerate.max_turns=1 --set regenerate.max_new_tokens=64 \
  --set regenerate.temperature="$TEMPERATURE"
"${CLI[@]}" precompute "${R[@]}" "${DATA[@]}"

# the control's training tokens, in this store's batch order
STEPS=$("$PY" - "$OUT" "$CONTROL" <<'EOF'
import json, sys
from mtptrain.config import load_recipe
from mtptrain.features.stores import open_stores
from mtptrain.train.data import steps_for_tokens
out, control = sys.argv[1:]
tokens = json.load(open(f"{control}/head/config.json"))["train"]["tokens"]
lengths = open_stores(f"{out}/features", "train", verify="size").lengths()
print(steps_for_tokens(lengths, 8, load_recipe("recipes/reference.yaml").train.seed, tokens))
EOF
)
"${CLI[@]}" train "${R[@]}" "${DATA[@]}" --set train.features="$OUT/features" --set train.output_dir="$OUT/train" \
  --set train.max_steps="$STEPS" --set train.lr=4e-3 --set train.head_snapshots=false \
  --set train.engine_eval.select_best=false

for temperature in 1 0; do
  for arm in control sampled; do
    head=$OUT/train/head; [ $arm = control ] && head=$CONTROL/head
    dir=$OUT/eval-$arm-t$temperature
    [ -s "$dir/results.json" ] && continue
    "${CLI[@]}" eval "${R[@]}" "${DATA[@]}" --set eval.head="$head" --set eval.temperature=$temperature \
      --set eval.methods=[chain] --set "eval.k=[3]" --set eval.max_prompts="$PROMPTS" --set eval.max_turns=1 \
      --set eval.max_new_tokens=64 --set eval.repeats=1 --set eval.output_dir="$dir"
  done
done
