"""Copy the head of a finished reference run into pretrained/, with its eval results, learning curve and a README.

    make reference                      # runs/reference: regenerate, precompute, train, eval (T=0 and T=1)
    python scripts/ship_reference_head.py

The README states what the head is, how it was made, and what `mtptrain eval` measured with it; the results
files are the eval's own, without the generated conversations.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from learning_curve import plot, table, validations  # scripts/learning_curve.py

from mtptrain.eval.report import methods_table
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.report_lines import run_line

EVALS = {"eval": "temperature 0", "eval-t1": "temperature 1"}


def readme(config: dict, curve: list[dict], evals: dict[str, dict], size: int) -> str:
    head, target, train = config["head"], config["target"], config["train"]
    norms = head["norms"] + (", EAGLE-3.1 norms (fc_norm, norm_output)" if head.get("fc_norm") else "")
    recipe = train["recipe"]["train"]
    validated = next((r for r in curve if r["step"] == train["steps"]), {})
    agreement = [validated[f"val/acc_{i}"] for i in range(1, head["ttt_steps"] + 1) if f"val/acc_{i}" in validated]
    chosen = config.get("validation")
    lines = [
        f"# {target['name']} EAGLE-3 head (reference run)",
        "",
        f"An `{head['kind']}` head for `{target['name']}` (fingerprint `{target['fingerprint']}`): one decoder "
        f"layer over the target's layers {head['feature_layers']} and its last layer {head['last_layer']}, "
        f"norms {norms}, {head['ttt_steps']} training-time-test steps, a draft vocabulary of "
        f"{head['draft_vocab_size']} tokens. Weights in bfloat16, {size / 2**20:.1f} MiB.",
        "",
        "Reproduce it with `make pretrained`: `make reference` (recipes/reference.yaml: ShareGPT conversations and "
        "requests the target wrote itself, all answered by the target; precompute, train, eval), then "
        "`python scripts/ship_reference_head.py`. `mtptrain eval` on the embedded default uses this head whenever "
        "the recipe's own head has not been trained yet.",
        "",
        f"Training: optimizer {recipe['optimizer']}, lr {recipe['lr']}, {train['steps']} steps, "
        f"{train['tokens']:,} tokens seen."
        + (f" Exported from step {chosen['step']}, the best chain tau of the validations through the engine "
           f"({chosen['tau_chain']:.2f} on held-out prompts)." if chosen else "")
        + (" Teacher-forced top-1 agreement with the target on the held-out conversations, per position: "
           + " / ".join(f"{v:.3f}" for v in agreement) + "." if agreement else ""),
        "",
        "What this CPU-scale training buys and what limits it: docs/reference-run.md in the repository.",
    ]
    for name, results in evals.items():
        lines += ["", f"## MT-bench, {EVALS[name]}", "", run_line(results), "tau is tokens per target forward, bonus "
                  "included; speedup is against the baseline of the same run.", ""]
        lines += methods_table(results)
    if curve:
        lines += ["", "## Learning curve", "", "The validations while training (`scripts/learning_curve.py`): the "
                  "head drafting in the engine on held-out prompts, greedy, and its teacher-forced agreement "
                  "(learning-curve.png).", "", table(curve)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/reference", help="the reference run directory")
    parser.add_argument("--out", default=str(PRETRAINED_HEAD))
    args = parser.parse_args()
    run, out = Path(args.run), Path(args.out)
    head = run / "train" / "head"
    missing = [p for p in (head / "config.json", head / "model.safetensors", run / "train" / "metrics.jsonl",
                           *(run / n / "results.json" for n in EVALS)) if not p.is_file()]
    if missing:
        raise SystemExit(f"error: {', '.join(map(str, missing))} missing: run `make reference` first")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(head / name, out / name)
    evals = {}
    for name in EVALS:
        results = json.loads((run / name / "results.json").read_text())
        results.pop("conversations", None)
        results.pop("files", None)
        (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
        evals[name] = results
    config = json.loads((head / "config.json").read_text())
    curve = validations(run / "train")
    size = (head / "model.safetensors").stat().st_size
    if curve:
        plot(curve, out / "learning-curve.png")
    (out / "README.md").write_text(readme(config, curve, evals, size))
    print(f"shipped {head} -> {out}")


if __name__ == "__main__":
    main()
