"""Our EAGLE-3 trainer against vLLM's `speculators` (0.9.0) trainer, on the same store and training tokens.

    python benchmarks/peer_speculators.py --recipe recipes/reference.yaml --out runs/peer --epochs 1

1. `mtptrain precompute` (kept when complete), then `mtptrain speculators data`: the recipe's store
   (train.features) in speculators' offline format, with our draft vocabulary.
2. speculators' trainer, in its own environment (scripts/setup_interop.sh), on a CPU through
   scripts/speculators_train_cpu.py, for `--epochs` passes over the train split: its own method (optimizer,
   schedule, loss, TTT loss decay, frozen LM head) with our head's shape (TTT steps, feature layers, draft
   vocabulary, norm placement) so that its checkpoint is one our engine drafts with. Packed rows of
   `--total-seq-len` tokens, about our micro-batch's tokens.
3. `mtptrain speculators import`, then `mtptrain train` of our head for the same epochs (engine validation off,
   so the last step is exported, as speculators' last epoch is), and `mtptrain eval` of both heads on the same
   MT-bench prompts. Prints tau, acceptance per position and speedup side by side, with the tokens each trained
   on. Every stage is reused when the script runs again.

Settings of the evals only (both heads): `--eval-set eval.methods=[chain] --eval-set eval.repeats=2`.
A second run of ours against the same speculators head, with settings of our trainer only:
    ... --ours mtptrain-muon --ours-set train.optimizer=muon
speculators at another learning rate, against the same run of ours (the ablation of docs/reference-run.md):
    ... --lr 4e-3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mtptrain.config import Eagle3HeadConfig, load_recipe
from mtptrain.eval.run import finished_eval

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"


def cli(*args: str, sets: list[str] = ()) -> None:
    cmd = [sys.executable, "-m", "mtptrain.cli", *args, *[a for s in sets for a in ("--set", s)]]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def rate(text: str) -> str:
    """A learning rate as typed (it names speculators' run: speculators-lr4e-3), once it reads as a number."""
    if float(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text}: a learning rate is above 0")
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--out", default="runs/peer")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the train split, both trainers")
    parser.add_argument("--total-seq-len", type=int, default=2048, help="speculators: tokens per packed row")
    parser.add_argument("--lr", type=rate, default=None, help="speculators' learning rate (default: its own); its "
                        "run, head and eval get their own names under --out (speculators-lr4e-3), so an arm at "
                        "another rate reuses the store, its data and our run")
    parser.add_argument("--prompts", type=int, default=80, help="MT-bench questions evaluated")
    parser.add_argument("--k", default="[2,3,4]", help="chain lengths evaluated")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="recipe override, both trainers")
    parser.add_argument("--eval-set", action="append", default=[], dest="eval_sets",
                        help="recipe override for both evals only (eval.methods=[chain], eval.repeats=2: the "
                        "recipe's trees and three repeats take about 25 minutes a head for 80 questions on 2 cores)")
    parser.add_argument("--ours", default="mtptrain", help="name of our run under --out (a second run of ours "
                        "with other --ours-set settings gets another name)")
    parser.add_argument("--ours-set", action="append", default=[], dest="ours_sets",
                        help="recipe override for our trainer only (train.optimizer=muon, ...)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.out).resolve()
    recipe = load_recipe(Path(args.recipe), args.sets)
    load_recipe(Path(args.recipe), args.sets + args.eval_sets)  # a bad --eval-set stops here, before any training
    head = recipe.head
    if not isinstance(head, Eagle3HeadConfig):
        sys.exit(f"{args.recipe}: head.kind is {head.kind}; speculators trains EAGLE-3 heads: give an eagle3 recipe")
    cli("precompute", "--recipe", args.recipe, "--no-progress", "--no-wandb", sets=args.sets)  # kept when complete
    data = out / "speculators-data"
    if not (data / "mtptrain-speculators-data.json").is_file():
        cli("speculators", "data", "--recipe", args.recipe, "--out", str(data), "--no-progress", sets=args.sets)
    summary = json.loads((data / "mtptrain-speculators-data.json").read_text())
    subprocess.run(["bash", "scripts/setup_interop.sh"], cwd=REPO, check=True)
    from mtptrain.target import resolve_local_dir

    verifier, _ = resolve_local_dir(recipe.target)
    theirs_name = "speculators" if args.lr is None else f"speculators-lr{args.lr}"
    save = out / theirs_name
    if not (save / "checkpoint_best").exists() and not (save / f"epoch{args.epochs - 1}_end").exists():
        cmd = [str(SPECULATORS_PYTHON), "scripts/speculators_train_cpu.py", "--verifier-name-or-path", str(verifier),
               "--data-path", str(data), "--save-path", str(save), "--epochs", str(args.epochs),
               "--total-seq-len", str(args.total_seq_len), "--ttt-steps", str(head.ttt_steps),
               "--draft-vocab-size", str(summary["draft_vocab_size"]), "--target-layer-ids",
               *map(str, summary["target_layer_ids"]), "--no-norm-before-residual", "--no-norm-before-fc",
               *(["--fc-norm"] if head.fc_norm else []), "--norm-output" if head.norm_output else "--no-norm-output",
               "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--on-missing", "raise",
               "--num-workers", "0", "--train-data-ratio", repr(summary["train_data_ratio"]), "--seed", "0",
               "--checkpoint-freq", "1", *(["--lr", str(args.lr)] if args.lr else [])]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    theirs = out / f"{theirs_name}-head"
    last = save / f"epoch{args.epochs - 1}_end"
    cli("speculators", "import", str(last), "--out", str(theirs), "--recipe", args.recipe, sets=args.sets)
    ours_run = out / args.ours
    cli("train", "--recipe", args.recipe, "--no-wandb", "--no-progress",
        sets=args.sets + args.ours_sets + [f"train.output_dir={ours_run}", f"train.epochs={args.epochs}",
                                           "train.head_snapshots=false", "train.engine_eval.select_best=false"])
    rows = []
    for name, head_dir in ((args.ours, ours_run / "head"), (theirs_name, theirs)):
        sets = args.sets + args.eval_sets + [f"eval.head={head_dir}", f"eval.output_dir={out / f'eval-{name}'}",
                                             f"eval.max_prompts={args.prompts}", f"eval.k={args.k}"]
        results = finished_eval(load_recipe(Path(args.recipe), sets))  # kept when its settings and head match
        if results is None:
            cli("eval", "--recipe", args.recipe, "--no-wandb", "--no-progress", sets=sets)
            results = json.loads((out / f"eval-{name}" / "results.json").read_text())
        for method in results["methods"][1:]:
            rows.append((name, method["label"], method["tau"], method.get("speedup"),
                         " / ".join(f"{a:.2f}" for a in method.get("acceptance", []))))
    tokens = json.loads((ours_run / "head" / "config.json").read_text())["train"]["tokens"]
    print(f"\ntraining tokens: mtptrain {tokens:,}; speculators {args.epochs} x {summary['tokens']:,} (both splits "
          f"written; it trains on the first {summary['train']:,} rows)")
    print("| trainer | config | tau | speedup | acceptance per position |\n|---|---|---|---|---|")
    for name, label, tau, speedup, acceptance in rows:
        print(f"| {name} | {label} | {tau:.3f} | {speedup:.2f}x | {acceptance} |" if speedup else
              f"| {name} | {label} | {tau:.3f} | | {acceptance} |")


if __name__ == "__main__":
    main()
