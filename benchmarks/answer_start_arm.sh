#!/bin/bash
# The answer-start arm (docs/reference-run.md, "What limits it"): MT-bench scores 64-token answers, whose first
# tokens draft worst, while a regenerated answer runs to 192 tokens. This arm trains on the first turns of the
# reference regeneration with every answer cut to its first 64 tokens (what `mtptrain regenerate` would have written
# with max_new_tokens 64, greedy), so the same training tokens hold about three times as many answer starts. It
# trains for the tokens of the 5,000-conversation ShareGPT arm at 2 TTT steps and lr 4e-3 (runs/ablations-5k-v2,
# arm ttt2-lr4x: 604 steps, 1,295,419 tokens; its MT-bench chain tau 1.73, unseen-40 1.75) with the same
# validation and selection, and is evaluated the same way: chain K=3 on the first 40 MT-bench first turns and on
# the 40 first turns of benchmarks/prompts/unseen-40.jsonl (64 tokens, greedy, one repeat). Every stage resumes:
# rerun the script.
#
# Without REFERENCE the arm regenerates its answers itself: `mtptrain regenerate` on the first ROWS ShareGPT rows
# with regenerate.max_turns 1 and max_new_tokens CUT, greedy (the same text as a cut 192-token greedy answer, at
# about a third of the decoding). Result (docs/reference-run.md, "Answer starts"): MT-bench chain tau 1.78 against
# 1.73, unseen-40 1.82 against 1.75, at equal training tokens.
#
# A training-only arm on the same store: ARM names its train/eval directories (train-ARM, eval-ARM-*) and EXTRA
# holds its overrides, e.g. ARM=vocab16k EXTRA="--set head.draft_vocab_size=16384".
#
#   [REFERENCE=runs/reference/regenerated.jsonl] [ARM=name EXTRA="--set ..."] bash benchmarks/answer_start_arm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/answer-start}
REFERENCE=${REFERENCE:-}
TOKENS=${TOKENS:-1295419}  # training tokens of the arm compared against (and CONVERSATIONS, below)
CUT=${CUT:-64}
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m mtptrain.cli)
R=(--recipe recipes/reference.yaml --no-progress)
ARM=${ARM:+-$ARM}
read -r -a EXTRA <<< "${EXTRA:-}"
mkdir -p "$OUT"
if [ -z "$REFERENCE" ]; then
  # 12,500 rows give a little more than the 10,600 first turns used below (14% of ShareGPT rows have none that fits)
  REFERENCE="$OUT/regenerated.jsonl"
  "${CLI[@]}" regenerate "${R[@]}" --set data.max_conversations="${ROWS:-12500}" --set regenerate.max_turns=1 \
    --set regenerate.max_new_tokens="$CUT" --set data.regenerated="$REFERENCE"
fi

# every conversation's first request and the first CUT tokens of its answer
[ -s "$OUT/first-turns.jsonl" ] || "$PY" benchmarks/first_turns.py "$REFERENCE" "$OUT/first-turns.jsonl" --cut "$CUT"
# about 130 tokens a sample: 10,600 first turns hold a little more than TOKENS in their training split
DATA=(--set data.source="$OUT/first-turns.jsonl" --set data.regenerated=null
      --set data.max_conversations="${CONVERSATIONS:-10600}"
      --set precompute.output_dir="$OUT/features")
"${CLI[@]}" precompute "${R[@]}" --no-wandb "${DATA[@]}"

# the step count whose micro-batches come nearest to TOKENS training tokens
STEPS=$("$PY" - "$OUT" "$TOKENS" <<'EOF'
import sys
from mtptrain.config import load_recipe
from mtptrain.features.stores import open_stores
from mtptrain.train.data import steps_for_tokens
lengths = open_stores(f"{sys.argv[1]}/features", "train", verify="size").lengths()
print(steps_for_tokens(lengths, 8, load_recipe("recipes/reference.yaml").train.seed, int(sys.argv[2])))
EOF
)
TRAIN=(--set "train.features=$OUT/features" --set train.output_dir="$OUT/train$ARM" --set train.max_steps="$STEPS"
       --set train.head_snapshots=false --set train.lr=4.0e-3 --set train.eval_every=200
       --set train.engine_eval.select_best=true "${EXTRA[@]}")
"${CLI[@]}" train "${R[@]}" --no-wandb "${DATA[@]}" "${TRAIN[@]}"
for set in mtbench unseen; do
  prompts=mtbench; [ $set = unseen ] && prompts=benchmarks/prompts/unseen-40.jsonl
  if [ ! -s "$OUT/eval$ARM-$set/results.json" ]; then
    "${CLI[@]}" eval "${R[@]}" --no-wandb "${DATA[@]}" "${TRAIN[@]}" --set eval.head="$OUT/train$ARM/head" \
      --set eval.prompts=$prompts --set eval.methods=[chain] --set "eval.k=[3]" --set eval.max_prompts=40 \
      --set eval.max_turns=1 --set eval.repeats=1 --set eval.output_dir="$OUT/eval$ARM-$set"
  fi
done
