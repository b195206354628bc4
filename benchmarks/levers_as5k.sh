#!/bin/bash
# Training levers of issue 39 at equal data, on the side-by-side's store (docs/reference-run.md, "Again with this
# recipe's method, on 5,000 answer-start first turns"): the first 5,000 ShareGPT first turns answered greedily by the
# target, answers cut at 64 tokens. SOURCE names them; where it is missing, the script writes it first: `mtptrain
# regenerate` over the first ROWS (6,100) ShareGPT rows, one turn of 64 tokens, greedy (5,140 conversations; about
# 15 minutes on a 2-core Zen 4), then benchmarks/first_turns.py. Every arm trains the reference recipe's method at
# that comparison's settings (Muon at train.lr 4e-3, one epoch, the same seed and data order, engine validation at
# the end only, the last step exported) with its own overrides, and is evaluated by chain K=3 on the first 40
# MT-bench questions and on the 40 unseen requests, both turns x 64 tokens, greedy, one repeat. Every stage
# resumes: rerun the same command.
#
#   ARM=control bash benchmarks/levers_as5k.sh
#   ARM=ema99 EXTRA="--set train.ema_decay=0.99" bash benchmarks/levers_as5k.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/arms-as5k}
SOURCE=${SOURCE:-runs/answer-start/first-turns.jsonl}
ARM=${ARM:?name the arm: ARM=control, or ARM=name EXTRA="--set ..."}
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m mtptrain.cli)
R=(--recipe recipes/reference.yaml --no-progress --no-wandb)
read -r -a EXTRA <<< "${EXTRA:-}"
mkdir -p "$OUT"
if [ ! -s "$SOURCE" ]; then
  mkdir -p "$(dirname "$SOURCE")"
  regenerated="${SOURCE%.jsonl}.regenerated.jsonl"
  "${CLI[@]}" regenerate --recipe recipes/reference.yaml --no-progress --set data.max_conversations="${ROWS:-6100}" \
    --set regenerate.max_turns=1 --set regenerate.max_new_tokens=64 --set data.regenerated="$regenerated"
  "$PY" benchmarks/first_turns.py "$regenerated" "$SOURCE" --cut 64
  rm -rf "$regenerated.states"  # kept for a precompute of whole answers: this store's are cut
fi
DATA=(--set data.source="$SOURCE" --set data.regenerated=null --set data.max_conversations=5000
      --set precompute.output_dir="$OUT/features")
"${CLI[@]}" precompute "${R[@]}" "${DATA[@]}"
TRAIN=(--set train.features="$OUT/features" --set train.output_dir="$OUT/train-$ARM" --set train.epochs=1
       --set train.lr=4.0e-3 --set train.eval_every=1000 --set train.head_snapshots=false
       --set train.engine_eval.select_best=false "${EXTRA[@]}")
"${CLI[@]}" train "${R[@]}" "${DATA[@]}" "${TRAIN[@]}"
for set in mtbench unseen; do
  prompts=mtbench; [ $set = unseen ] && prompts=benchmarks/prompts/unseen-40.jsonl
  dir=$OUT/eval-$ARM-$set
  [ -s "$dir/results.json" ] && continue
  "${CLI[@]}" eval "${R[@]}" "${DATA[@]}" --set eval.head="$OUT/train-$ARM/head" --set eval.prompts=$prompts \
    --set eval.methods=[chain] --set "eval.k=[3]" --set eval.max_prompts=40 --set eval.max_new_tokens=64 \
    --set eval.repeats=1 --set eval.output_dir="$dir"
done
