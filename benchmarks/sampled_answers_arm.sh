#!/bin/bash
# Temperature-1 answers as training data (issue 39's temperature-1 target). The head learns from the target's
# greedy answers, but at temperature 1 it drafts after sampled text, which greedy answers never show it. This arm
# answers the same requests as a control head's store again, sampled at TEMPERATURE, and trains two heads for the
# control's training tokens with the control's settings: "sampled" on the sampled answers, "mixed" on every request
# once, half of them with the greedy answer and half with the sampled one (training refuses the two stores
# together: they share their sample ids, the same requests answered twice). All three heads are evaluated on the
# same prompts at temperature 1 and 0 (chain K=3, first turns of MT-bench's first PROMPTS questions, 64 tokens,
# one repeat).
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
PROMPTS=${PROMPTS:-80}
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m mtptrain.cli)
R=(--recipe recipes/reference.yaml --no-progress --no-wandb)
mkdir -p "$OUT"
[ -s "$CONTROL/head/config.json" ] || { echo "error: no control head in $CONTROL/head: run the side-by-side first" >&2; exit 1; }

DATA=(--set data.source="$SOURCE" --set data.max_conversations="$CONVERSATIONS"
      --set data.regenerated="$OUT/regenerated.jsonl" --set precompute.output_dir="$OUT/features")
"${CLI[@]}" regenerate --recipe recipes/reference.yaml --no-progress "${DATA[@]}" --set regenerate.max_turns=1 \
  --set regenerate.max_new_tokens=64 --set regenerate.temperature="$TEMPERATURE"
"${CLI[@]}" precompute "${R[@]}" "${DATA[@]}"

# steps that train on the control's tokens, in the batch order of the stores named
steps_for() {
  "$PY" - "$CONTROL" "$@" <<'PYTHON'
import json, sys
from mtptrain.config import load_recipe
from mtptrain.features.stores import open_stores
from mtptrain.train.data import steps_for_tokens
control, stores = sys.argv[1], sys.argv[2:]
tokens = json.load(open(f"{control}/head/config.json"))["train"]["tokens"]
lengths = open_stores(stores if len(stores) > 1 else stores[0], "train", verify="size").lengths()
print(steps_for_tokens(lengths, 8, load_recipe("recipes/reference.yaml").train.seed, tokens))
PYTHON
}

train_arm() {  # its run directory, then its stores (a list for a mix of stores); the control's settings
  local run=$1; shift
  local stores; stores=$(IFS=,; echo "$*")
  "${CLI[@]}" train "${R[@]}" "${DATA[@]}" --set "train.features=[$stores]" --set train.output_dir="$run" \
    --set train.max_steps="$(steps_for "$@")" --set train.lr=4e-3 --set train.head_snapshots=false \
    --set train.engine_eval.select_best=false
}
train_arm "$OUT/train" "$OUT/features"

# mixed: each request once, every other one with its greedy answer (the control's source) and the rest with its
# sampled one, in the source's order; precomputed as a store of its own and trained the same way
MIX=$OUT/mixed
mkdir -p "$MIX"
[ -s "$MIX/source.jsonl" ] || "$PY" - "$SOURCE" "$OUT/regenerated.jsonl" "$CONVERSATIONS" "$MIX/source.jsonl" <<'PYTHON'
import itertools, json, os, sys
from pathlib import Path
from mtptrain.data.readers import read_jsonl
source, sampled, count, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def rows(path):  # a damaged line is named by file and line, never guessed at
    for row in read_jsonl(path):
        if row.problem or not isinstance(row.value, dict) or not isinstance(row.value.get("messages"), list) \
                or not isinstance(row.value.get("id"), str):
            sys.exit(f"error: {row.ref}: {row.problem[0] if row.problem else 'not a conversation with an id'}; "
                     "give files written by mtptrain regenerate")
        yield row.value

answers = {row["id"]: row["messages"] for row in rows(sampled)}
with open(out + ".part", "w") as sink:
    for i, row in enumerate(itertools.islice(rows(source), count)):
        if i % 2 and row["id"] not in answers:
            sys.exit(f"error: {sampled} has no answer for {row['id']!r}: finish the regeneration first")
        messages = row["messages"] if i % 2 == 0 else answers[row["id"]]
        sink.write(json.dumps({"id": row["id"], "messages": messages}) + "\n")
os.replace(out + ".part", out)
PYTHON
DATA=(--set data.source="$MIX/source.jsonl" --set data.regenerated=null --set data.max_conversations="$CONVERSATIONS"
      --set precompute.output_dir="$MIX/features")
"${CLI[@]}" precompute "${R[@]}" "${DATA[@]}"
train_arm "$OUT/train-mixed" "$MIX/features"

for temperature in 1 0; do
  for arm in control sampled mixed; do
    case $arm in control) head=$CONTROL/head ;; sampled) head=$OUT/train/head ;; mixed) head=$OUT/train-mixed/head ;; esac
    dir=$OUT/eval-$arm-t$temperature-p$PROMPTS
    [ -s "$dir/results.json" ] && continue
    "${CLI[@]}" eval "${R[@]}" "${DATA[@]}" --set eval.head="$head" --set eval.temperature=$temperature \
      --set eval.methods=[chain] --set "eval.k=[3]" --set eval.max_prompts="$PROMPTS" --set eval.max_turns=1 \
      --set eval.max_new_tokens=64 --set eval.repeats=1 --set eval.output_dir="$dir"
  done
done
