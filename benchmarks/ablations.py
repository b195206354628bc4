"""Ablations of the reference run, each arm trained on the same data with the same budget, then evaluated.

Arms (every one trains `--epochs` passes over the same conversations, same seed, same batch plan):
  eagle3            the reference head (EAGLE-3, regenerated answers)
  eagle3-original   the same head on the original ShareGPT answers instead of the target's own
  eagle-restored    EAGLE-1/2 head with RMSNorm restoration (head.norms: restored)
  eagle-stripped    EAGLE-1/2 head with the original norm-free placement (head.norms: stripped)
  mtp               DeepSeek-style MTP, `--mtp-depths` chained depths
and, by name (--arms), one change each to the EAGLE-3 head at the same training tokens:
  eagle3-plain-norms / eagle3-3.1-norms   without / with the EAGLE-3.1 norms (head.fc_norm, head.norm_output)
  eagle3-lk-hybrid / eagle3-tv            an acceptance-aware loss (train.loss) instead of KL
  eagle3-ttt2 / eagle3-ttt6               2 / 6 training-time-test steps
  eagle3-vocab4k / eagle3-vocab16k        a draft vocabulary of 4,096 / 16,384 tokens
  eagle3-muon                             Muon on the weight matrices instead of AdamW (train.optimizer)
  eagle3-frozen-lm-head                   the draft LM head kept at the target's rows (train.draft_lm_head)
  eagle3-equal-steps                      every TTT step weighted alike instead of 0.8^k (head.step_weights)
  eagle3-speculators-method               the three above together
  eagle3-fp8-store                        features stored as float8 with a scale per row (precompute.dtype)
  eagle3-reachable                        positions 2.. scored only where the earlier ones hit (train.reachable)
  eagle3-lr1e-3 / -lr2e-3 / -lr4e-3       the peak learning rate (train.lr)
  eagle3-ttt2-lr4e-3                      2 TTT steps at lr 4e-3 (1.5 times the tokens/s of 4 steps on a CPU)
and a learning curve: tau of the reference run's head snapshots (train.head_snapshots) against the
training tokens each had seen.

Every arm is evaluated by `mtptrain eval` on the same MT-bench prompts with chain drafting (K from `--k`,
MTP capped at its depths) against the autoregressive baseline of its own run; tau, acceptance per
position and teacher-forced agreement are compared. Each arm's own validation split holds other text when
its data differ, so every head is also scored teacher-forced on the same two texts: the reference store's
held-out answers and the baseline answers of a reference eval run (benchmarks/head_agreement.py). Each
stage is a real CLI run, so finished arms are reused when the script is run again (train resumes or
skips, an eval with the same head and settings is kept).

    python benchmarks/ablations.py --recipe recipes/reference.yaml --out runs/ablations
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mtptrain.config import MTPHeadConfig, Recipe, load_recipe
from mtptrain.eval.run import finished_eval
from mtptrain.features.stores import open_stores
from mtptrain.train.data import BatchPlan

REPO = Path(__file__).resolve().parents[1]

ARMS = {
    "eagle3": [],
    "eagle3-original": ["data.regenerated=null"],
    # another family's head replaces the recipe's head section (its eagle3 settings are not the new kind's)
    "eagle-restored": ["head={kind: eagle, norms: restored}"],
    "eagle-stripped": ["head={kind: eagle, norms: stripped}"],
    "mtp": ["head={kind: mtp}"],
    # methods that learn more per token (the EAGLE-3 head with one change each, at the same training tokens)
    "eagle3-plain-norms": ["head.fc_norm=false", "head.norm_output=false"],
    "eagle3-3.1-norms": ["head.fc_norm=true", "head.norm_output=true"],
    "eagle3-lk-hybrid": ["train.loss=lk-hybrid"],
    "eagle3-tv": ["train.loss=tv"],
    "eagle3-ttt2": ["head.ttt_steps=2"],
    "eagle3-ttt6": ["head.ttt_steps=6"],
    "eagle3-vocab4k": ["head.draft_vocab_size=4096"],
    "eagle3-vocab16k": ["head.draft_vocab_size=16384"],
    # how the head is optimised (what speculators' trainer does differently from ours by default)
    "eagle3-muon": ["train.optimizer=muon"],
    "eagle3-frozen-lm-head": ["train.draft_lm_head=frozen"],
    "eagle3-equal-steps": ["head.step_weights=[1,1,1,1]"],
    "eagle3-speculators-method": ["train.optimizer=muon", "train.draft_lm_head=frozen", "head.step_weights=[1,1,1,1]"],
    # storage below bfloat16 (its own store: features-fp8 under --out)
    "eagle3-fp8-store": ["precompute.dtype=float8_e4m3fn"],
    # GRIFFIN's token-alignable training: a later draft position learns only where a greedy chain reaches it
    "eagle3-reachable": ["train.reachable=true"],
    # the peak learning rate (under Muon also the base of its matrices' rates), by value
    "eagle3-lr1e-3": ["train.lr=1e-3"],
    "eagle3-lr2e-3": ["train.lr=2e-3"],
    "eagle3-lr4e-3": ["train.lr=4e-3"],
    "eagle3-ttt2-lr4e-3": ["head.ttt_steps=2", "train.lr=4e-3"],
}
DEFAULT_ARMS = ["eagle3", "eagle3-original", "eagle-restored", "eagle-stripped", "mtp"]


def cli(*args: str, sets: list[str]) -> None:
    cmd = [sys.executable, "-m", "mtptrain.cli", *args, *[a for s in sets for a in ("--set", s)]]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def eval_sets(args, head: Path, out: Path) -> list[str]:
    return [f"eval.head={head}", "eval.methods=[chain]", f"eval.k={args.k}", f"eval.max_prompts={args.prompts}",
            f"eval.max_turns={args.turns}", f"eval.max_new_tokens={args.tokens}", f"eval.output_dir={out}"]


def evaluate(args, sets: list[str]) -> dict:
    """The results of `mtptrain eval` with these overrides: an earlier run's where it finished with the same
    settings and head weights, else run now."""
    recipe = load_recipe(args.recipe, sets)
    results = finished_eval(recipe)
    if results is None:
        cli("eval", "--recipe", args.recipe, "--no-wandb", "--no-progress", sets=sets)
        results = json.loads((Path(recipe.eval.output_dir) / "results.json").read_text())
    return results


def tokens_seen(run: Path, steps: int) -> int:
    """Training tokens of a finished single-process run, from its batch plan (as the trainer draws it)."""
    recipe = load_recipe(run / "recipe.yaml")
    cfg = recipe.train
    lengths = open_stores(cfg.features, "train", verify="size").lengths()
    plan = BatchPlan(lengths, cfg.micro_batch_size, cfg.seed, 1, 0, steps, cfg.grad_accum)
    return plan.tokens_through(steps)


def chain_rows(results: dict) -> list[dict]:
    return [m for m in results["methods"] if m["method"] == "chain" and "stop" not in m]  # all K drafted


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--out", default="runs/ablations")
    parser.add_argument("--epochs", type=float, default=1.5, help="training passes per arm")
    parser.add_argument("--mtp-depths", type=int, default=3)
    parser.add_argument("--k", default="[3,5]", help="chain draft lengths evaluated")
    parser.add_argument("--prompts", type=int, default=20, help="MT-bench questions")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per turn")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help="comma-separated arms, of " + ", ".join(ARMS))
    parser.add_argument("--curve", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate the reference run's head snapshots (learning curve)")
    parser.add_argument("--agreement-eval", default="runs/reference/eval",
                        help="an eval run whose baseline answers every arm is scored on, teacher-forced "
                        "(benchmarks/head_agreement.py); empty to skip")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="extra recipe override")
    args = parser.parse_args()
    unknown = [a for a in arm_names(args) if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    return args


def arm_names(args) -> list[str]:
    return [a for a in args.arms.split(",") if a]


# Arms whose data differ from the reference's: the override that makes their store, and the store's name.
OWN_STORE = {"data.regenerated=null": "original", "precompute.dtype=float8_e4m3fn": "fp8"}


def store_of(arm: str) -> str:
    return next((name for override, name in OWN_STORE.items() if override in ARMS[arm]), "regenerated")


def prepare_stores(args, arms: list[str], base: Recipe, out: Path) -> dict[str, str]:
    """The data of the arms: the reference's store (regenerated answers), and one store for each arm whose data
    differ (the original answers; float8 storage)."""
    recipe_sets = ["--recipe", args.recipe]
    stores = {"regenerated": base.precompute.output_dir,
              **{name: str(out / f"features-{name}") for name in OWN_STORE.values()}}
    if arms and base.data.regenerated:
        cli("regenerate", *recipe_sets, "--no-progress", sets=args.sets)
    for override, name in [(None, "regenerated"), *OWN_STORE.items()]:
        if any(store_of(a) == name for a in arms):
            own = [override, f"precompute.output_dir={stores[name]}"] if override else []
            cli("precompute", *recipe_sets, "--no-progress", sets=args.sets + own)
    return stores


def run_arm(args, arm: str, stores: dict[str, str], out: Path) -> dict:
    """Trains and evaluates one arm (reusing what a previous run finished); its row of the report."""
    overrides = ARMS[arm]
    store = stores[store_of(arm)]
    run_dir = out / arm
    sets = args.sets + overrides + [f"train.features={store}", f"train.output_dir={run_dir / 'train'}",
                                    f"train.epochs={args.epochs}", "train.head_snapshots=false"]
    if isinstance(load_recipe(args.recipe, args.sets + overrides).head, MTPHeadConfig):
        sets.append(f"head.mtp_depths={args.mtp_depths}")
    cli("train", "--recipe", args.recipe, "--no-wandb", "--no-progress", sets=sets)
    head = run_dir / "train" / "head"
    results = evaluate(args, sets + eval_sets(args, head, run_dir / "eval"))
    agreement = score_agreement(args, head, run_dir / "agreement.json", out)
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    return {"arm": arm, "steps": summary["steps"], "tokens": tokens_seen(run_dir / "train", summary["steps"]),
            "val_acc": [v for k, v in sorted(summary.items()) if k.startswith("val/acc_")],
            "agreement": json.loads(agreement.read_text()) if agreement.is_file() else None,
            "chains": chain_rows(results)}


def score_agreement(args, head: Path, agreement: Path, out: Path) -> Path:
    """One yardstick for every arm: the reference store's held-out answers and the reference eval's MT-bench
    answers, teacher-forced (each arm's own validation split holds other text when its data differ)."""
    if args.agreement_eval and not agreement.is_file():
        subprocess.run([sys.executable, "benchmarks/head_agreement.py", "--recipe", args.recipe, "--head", str(head),
                        "--eval", args.agreement_eval, "--out", str(out / "eval-answers"), "--report",
                        str(agreement)], cwd=REPO, check=True)
    return agreement


def learning_curve(args, base: Recipe, out: Path) -> list[dict]:
    """tau of the reference run's head snapshots against the training tokens each had seen."""
    curve = []
    snapshots = sorted((Path(base.train.output_dir) / "snapshots").glob("step-*")) if args.curve else []
    for snap in snapshots:
        info = json.loads((snap / "config.json").read_text())
        results = evaluate(args, args.sets + eval_sets(args, snap, out / "curve" / snap.name))
        curve.append({"step": info["train"]["steps"], "tokens": info["train"]["tokens"],
                      "chains": chain_rows(results)})
    return curve


def write_report(args, rows: list[dict], curve: list[dict], out: Path, seconds: float) -> None:
    """ablations.md and ablations.json in --out; the report printed."""
    report = format_report(rows, curve, args, seconds)
    (out / "ablations.md").write_text(report)
    (out / "ablations.json").write_text(json.dumps({"arms": rows, "curve": curve, "args": vars(args)}, indent=2))
    print(report)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    base = load_recipe(args.recipe, args.sets)
    started = time.perf_counter()
    arms = arm_names(args)
    stores = prepare_stores(args, arms, base, out)
    rows = [run_arm(args, arm, stores, out) for arm in arms]
    curve = learning_curve(args, base, out)
    write_report(args, rows, curve, out, time.perf_counter() - started)


def format_report(rows: list[dict], curve: list[dict], args, seconds: float) -> str:
    lines = [f"Chain drafting on {args.prompts} MT-bench questions x {args.turns} turn(s) x {args.tokens} tokens, "
             f"greedy ({seconds / 60:.0f} min in all)", ""]
    if rows:
        budget = next((o for o in args.sets if o.startswith("train.max_steps=")), f"{args.epochs} epochs")
        lines += [f"Arms: {budget} each, same seed and data order; validation agreement is each arm's own "
                  "held-out split; the agreement columns score every arm on the same text, teacher-forced "
                  f"(benchmarks/head_agreement.py, answers of {args.agreement_eval}).", ""]
        ref = next((r for r in rows if r["arm"] == "eagle3"), rows[0])
        lines += ["| arm | steps | tokens | own validation agreement | agreement, held-out regenerated | "
                  "agreement, MT-bench answers | chain | tau | vs " + ref["arm"] + " | acceptance per position | "
                  "speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        ref_tau = {c["k"]: c["tau"] for c in ref["chains"]}
        for r in rows:
            common = list((r["agreement"] or {}).values())
            shared = [" / ".join(f"{a:.3f}" for a in acc) for acc in common] if common else ["-", "-"]
            for c in r["chains"]:
                ratio = c["tau"] / ref_tau[c["k"]] if c["k"] in ref_tau else float("nan")
                lines.append(f"| {r['arm']} | {r['steps']} | {r['tokens']:,} | "
                             f"{' / '.join(f'{a:.3f}' for a in r['val_acc'])} | {shared[0]} | {shared[1]} | "
                             f"{c['label']} | {c['tau']:.2f} | {ratio:.2f}x | "
                             f"{' / '.join(f'{a:.2f}' for a in c['acceptance'])} | {c['speedup']:.2f}x |")
        lines.append("")
    if curve:
        lines += ["Learning curve (reference run's head snapshots):", "",
                  "| step | training tokens | chain | tau | acceptance per position |", "|---|---|---|---|---|"]
        for point in curve:
            for c in point["chains"]:
                lines.append(f"| {point['step']} | {point['tokens']:,} | {c['label']} | {c['tau']:.2f} | "
                             f"{' / '.join(f'{a:.2f}' for a in c['acceptance'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
