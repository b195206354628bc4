"""Teacher-forced agreement of a trained head with the target on another text distribution.

    python benchmarks/head_agreement.py --head runs/reference/train/head --eval runs/reference/eval

Training reports top-1 agreement per draft position on its held-out split (ShareGPT). Eval measures
acceptance while the head drafts for real (MT-bench). This script separates the two gaps between those numbers:
it takes the baseline's own answers from an eval run (results.json: the target's greedy MT-bench answers, the
very tokens the head had to predict), precomputes their hidden states, and scores the head teacher-forced on
them, exactly as training validates. Then
  * held-out ShareGPT agreement vs MT-bench teacher-forced agreement = the shift between the two distributions;
  * MT-bench teacher-forced agreement vs eval acceptance = what drafting on its own outputs costs the head.
The training run's own validation split is scored again in the same run for reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtptrain.config import load_recipe
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore
from mtptrain.features.stores import open_stores
from mtptrain.heads import FrozenTarget
from mtptrain.heads.objective import step_weights
from mtptrain.export.source import load_head_directory
from mtptrain.target import load_target
from mtptrain.train.scoring import score_store


def eval_conversations(results: Path, out: Path) -> None:
    """The baseline's conversations of an eval run as a JSONL data source."""
    conversations = json.loads(results.read_text())["conversations"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for cid, messages in conversations.items():
            f.write(json.dumps({"id": cid, "messages": messages}) + "\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a number of tokens, 1 or more")
    return value


def answer_prefix(n: int):
    """A loss-mask transform keeping the first `n` tokens of every answer (each run of assistant tokens)."""
    def keep(mask: torch.Tensor) -> torch.Tensor:
        on = mask.bool()
        starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0))  # the first token of each answer
        index = torch.arange(on.shape[1]).expand_as(on)
        # each token's latest answer start, carried along the row (an answer token's own answer's start)
        first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        return (on & (index - first < n)).to(mask.dtype)
    return keep


def agreement(head, spec, store: FeatureStore, recipe, batch_size: int, prefix: int | None = None) -> list[float]:
    """Top-1 agreement per draft position, scored as training validates (float32, on the CPU); with `prefix`, on
    the first `prefix` tokens of each answer only."""
    window = score_store(head, spec, store, batch_size, step_weights(recipe.head.step_weights, spec.draft_positions),
                         spec.family.feature_weight(recipe.head), recipe.train.loss_chunk, torch.device("cpu"),
                         torch.float32, keep=answer_prefix(prefix) if prefix else None)
    sums = window.reduce(None)
    return [sums[f"train/acc_{p + 1}"] for p in range(spec.draft_positions)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--head", default="runs/reference/train/head")
    parser.add_argument("--eval", default="runs/reference/eval", help="an eval run directory (results.json)")
    parser.add_argument("--out", default="runs/analysis/eval-answers", help="where the answers' features go")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--report", help="where the JSON result goes (default: <out>/agreement.json)")
    parser.add_argument("--answer-prefix", type=positive_int, default=None,
                        help="also score the first N tokens of every answer only (the eval's answers are "
                        "eval.max_new_tokens long; training answers run longer, and later tokens draft more easily)")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    out = Path(args.out)
    eval_conversations(Path(args.eval) / "results.json", out / "answers.jsonl")
    # Every answer is scored (no validation split); no length cut beyond the recipe's own.
    answers = load_recipe(args.recipe, [f"data.source={out / 'answers.jsonl'}", "data.regenerated=null",
                                        "data.validation_fraction=0", "data.max_conversations=null",
                                        f"precompute.output_dir={out / 'features'}", "precompute.dtype=float32"])
    run_precompute(answers, show_progress=False)

    target = load_target(recipe.target)
    head, spec = load_head_directory(Path(args.head), FrozenTarget.of(target.model), target.identity())
    head.float().eval()
    layers = spec.layers
    stores = {"held-out: the training stores' validation split":
              open_stores(recipe.train.features, "validation", target=target, layers=layers, verify="size"),
              "MT-bench: the eval's baseline answers":
              FeatureStore(out / "features", "train", target=target, layers=layers, verify="size")}
    lines = [f"Teacher-forced top-1 agreement of {args.head} with the target, per draft position", "",
             "| data | conversations | agreement per position |", "|---|---|---|"]
    report = {}
    for name, store in stores.items():
        for prefix in (None, args.answer_prefix) if args.answer_prefix else (None,):
            acc = agreement(head, spec, store, recipe, args.batch_size, prefix)
            label = f"{name}, first {prefix} tokens of each answer" if prefix else name
            report[label] = acc
            lines.append(f"| {label} | {len(store)} | {' / '.join(f'{a:.3f}' for a in acc)} |")
    eval_results = json.loads((Path(args.eval) / "results.json").read_text())
    lines += ["", "Acceptance while drafting in that eval run (conditional on the previous position accepted):", ""]
    for m in eval_results["methods"]:
        if m["method"] == "chain":
            a = m["acceptance"]
            conditional = [a[0]] + [a[i] / a[i - 1] if a[i - 1] else 0.0 for i in range(1, len(a))]
            lines.append(f"- {m['label']}: {' / '.join(f'{x:.3f}' for x in conditional)}")
    text = "\n".join(lines) + "\n"
    (out / "agreement.md").write_text(text)
    (Path(args.report) if args.report else out / "agreement.json").write_text(json.dumps(report, indent=2))
    print(text)


if __name__ == "__main__":
    main()
