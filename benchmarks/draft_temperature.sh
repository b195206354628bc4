#!/bin/bash
# The head drafting at a temperature of its own, at eval temperature 1 (issue 39's temperature-1 target;
# eval.chain.draft_temperatures, docs/reference-run.md "What limits it"). Verification reads the distribution each
# draft was drawn from, so outputs follow the target's law at any draft temperature; only acceptance moves. Five
# evals of HEAD on first turns, 64 tokens, each resumable (a finished one is skipped):
#   sweep   chain K=3 at draft temperatures 0.5 / 0.7 / 0.85 / 1, MT-bench, one repeat
#   tree    chain K=3 at 0.85 / 1 beside trees of branch 3, depth 4, 4 / 6 / 8 nodes, one repeat
#   tree-b1 a tree of branch 1, depth 3: the head's argmax as a deterministic chain, one repeat
#   stop    chain K=5 stop 0.3 at 0.75 / 0.85 / 1, REPEATS interleaved repeats
#   stop-high  chain K=5 stop 0.3 and 0.45 at 0.85, REPEATS repeats
#   final   chains K=3 and K=5 stop 0.45 at 0.85 and 1, 3 repeats: the T=1 speedup of the issue's goal
#   unseen  chain K=3 at 0.85 / 1 on benchmarks/prompts/unseen-40.jsonl, one repeat
# and, where the 5k heads of benchmarks/sampled_answers_arm.sh are on disk, chain K=3 at 0.85 / 1 with each
# (5k-control: greedy answers, 5k-sampled: answers sampled at T=1): whether the two levers stack.
#
#   bash benchmarks/draft_temperature.sh [OUT=runs/draft-temp] [HEAD=pretrained/smollm2-135m-instruct-eagle3]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/draft-temp}
HEAD=${HEAD:-pretrained/smollm2-135m-instruct-eagle3}
REPEATS=${REPEATS:-2}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
T=(--recipe recipes/reference.yaml --no-progress --no-wandb --set eval.max_new_tokens=64 --set eval.repeats=1
   --set eval.temperature=1 --set eval.max_turns=1)

run() {  # run NAME HEAD SETTINGS...: one eval into $OUT/NAME unless it finished before
    local name=$1 head=$2
    shift 2
    [ -s "$OUT/$name/results.json" ] && return
    "$PY" -m mtptrain.cli eval "${T[@]}" --set eval.head="$head" --set eval.output_dir="$OUT/$name" "$@"
}

run sweep "$HEAD" --set "eval.methods=[chain]" --set "eval.k=[3]" \
    --set "eval.chain.draft_temperatures=[0.5,0.7,0.85,1.0]"
run tree "$HEAD" --set "eval.methods=[chain,tree]" --set "eval.k=[3]" --set "eval.chain.draft_temperatures=[0.85,1.0]" \
    --set eval.tree.branch=3 --set eval.tree.depth=4 --set "eval.tree.budgets=[4,6,8]"
run tree-b1 "$HEAD" --set "eval.methods=[tree]" --set eval.tree.branch=1 --set eval.tree.depth=3 \
    --set "eval.tree.budgets=[3]"
run stop "$HEAD" --set "eval.methods=[chain]" --set "eval.k=[5]" --set "eval.chain.stops=[0.3]" \
    --set "eval.chain.draft_temperatures=[0.75,0.85,1.0]" --set eval.repeats="$REPEATS"
run stop-high "$HEAD" --set "eval.methods=[chain]" --set "eval.k=[5]" --set "eval.chain.stops=[0.3,0.45]" \
    --set "eval.chain.draft_temperatures=[0.85]" --set eval.repeats="$REPEATS"
run final "$HEAD" --set "eval.methods=[chain]" --set "eval.k=[3,5]" --set "eval.chain.stops=[0.45]" \
    --set "eval.chain.draft_temperatures=[0.85,1.0]" --set eval.repeats=3
run unseen "$HEAD" --set "eval.methods=[chain]" --set "eval.k=[3]" --set "eval.chain.draft_temperatures=[0.85,1.0]" \
    --set eval.prompts=benchmarks/prompts/unseen-40.jsonl
for arm in control:runs/peer-as5k/mtptrain/head sampled:runs/sampled-answers/train/head; do
    name=${arm%%:*} head=${arm#*:}
    if [ -s "$head/config.json" ]; then
        run "5k-$name" "$head" --set "eval.methods=[chain]" --set "eval.k=[3]" \
            --set "eval.chain.draft_temperatures=[0.85,1.0]"
    else
        echo "5k-$name: no head at $head (benchmarks/sampled_answers_arm.sh trains it); skipped"
    fi
done
for name in sweep tree tree-b1 stop stop-high final unseen 5k-control 5k-sampled; do
    [ -s "$OUT/$name/results.json" ] || continue
    "$PY" - "$OUT/$name/results.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]} (other load {results['machine']['other_load']:.3f} cores)")
for m in results["methods"]:
    acceptance = " / ".join(f"{a:.2f}" for a in m["acceptance"])
    print(f"  {m['label']:<36} tau {m['tau']:.2f}  {m['speedup']:.2f}x  {acceptance}")
PY
done
