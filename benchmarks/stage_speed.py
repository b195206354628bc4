"""Throughput of `mtptrain regenerate` and `mtptrain precompute` on the target's runtime against the path they
took before it (transformers' forward in float32 with the W @ x.T swap), in one run.

    python benchmarks/stage_speed.py [--recipe recipes/reference.yaml] [--conversations 128]
                                     [--regenerate-conversations 1024] [--rounds 2]

Each stage runs for real (run_regenerate / run_precompute) on the recipe's data into a fresh directory,
alternately with the old settings and with the defaults (target.runtime and target.dtype auto, eval's
products measured), --rounds times each; tokens/s are the stages' own counts over their own timings
(regenerate: new tokens; precompute: tokens computed).

Precompute and the former regenerate path run on the first --conversations. Regenerate on the runtime runs
on the first --regenerate-conversations: it keeps every row busy, refilling a row as soon as its answer ends,
and a group of conversations ends with its last rows draining, so its speed depends on how many
conversations a group holds. The default, 1024, is one group of 8 x 128 rows as the reference run has twelve
of; the former path decodes batch by batch, each draining alone, so its speed does not grow with the count.

The regenerated files of both paths are compared on the conversations both wrote: greedy answers equal token
for token in float32, and in bfloat16 equal until a rounding near-tie, so the share of identical answers is
printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import torch

from mtptrain.config import load_recipe
from mtptrain.data.regenerate import run_regenerate
from mtptrain.dist import DistInfo, pick_device
from mtptrain.features.precompute import run_precompute
from mtptrain.machine import cpu_line, describe_cpu
from mtptrain.runtime.choice import choose
from mtptrain.target import load_config

# The former path with its own batch size: 64 rows, as the reference recipe had them (128 left-padded rows of
# transformers' forward decode fewer tokens/s: 103-109 against 132-138 on the same 128 conversations).
BEFORE = ["target.runtime=transformers", "target.dtype=float32", "regenerate.cpu_matmul=skinny",
          "regenerate.batch_size=64"]
AFTER = ["target.runtime=auto", "target.dtype=auto", "regenerate.cpu_matmul=auto"]


def regenerate(args, settings: list[str], conversations: int, out: Path) -> tuple[float, dict]:
    recipe = load_recipe(args.recipe, [f"data.max_conversations={conversations}",
                                       f"data.regenerated={out / 'regenerated.jsonl'}", *settings, *args.sets])
    summary = run_regenerate(recipe, show_progress=False)
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    answers = {row["id"]: [m["content"] for m in row["messages"] if m["role"] == "assistant"] for row in rows}
    return summary["tokens_this_run"] / summary["seconds_this_run"], answers


def precompute(args, settings: list[str], out: Path) -> float:
    recipe = load_recipe(args.recipe, [f"data.max_conversations={args.conversations}", "data.regenerated=null",
                                       f"precompute.output_dir={out / 'features'}", *settings, *args.sets])
    summary = run_precompute(recipe, show_progress=False)
    return summary["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--conversations", type=int, default=128,
                        help="precompute, and regenerate on the former path, on this many conversations")
    parser.add_argument("--regenerate-conversations", type=int, default=1024,
                        help="regenerate on the runtime on this many conversations")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra recipe override")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    recipe = load_recipe(args.recipe, [*AFTER, *args.sets])  # what the runtime's path computes with
    device = pick_device(recipe.target.device, DistInfo.from_env())
    choice = choose(load_config(recipe.target), device, recipe.target.dtype)
    cpu = describe_cpu()
    print(cpu_line(cpu) + f", {torch.get_num_threads()} threads; runtime choice: "
          f"{choice.describe()}")
    if device.type == "cuda":
        print(f"GPU {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda}): "
              "both paths run there")
    print(f"regenerate: the former path on {args.conversations} conversations, the runtime on "
          f"{args.regenerate_conversations}; precompute on {args.conversations}")
    speeds = {(stage, path): [] for stage in ("regenerate", "precompute") for path in ("before", "after")}
    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for path, settings in (("before", BEFORE), ("after", AFTER)):
                out = Path(tmp) / f"{path}-{r}"
                conversations = args.conversations if path == "before" else args.regenerate_conversations
                tps, answers[path] = regenerate(args, settings, conversations, out)
                speeds["regenerate", path].append(tps)
                speeds["precompute", path].append(precompute(args, settings, out))
                print(f"  round {r + 1}, {path}: regenerate {tps:.0f} tok/s, precompute "
                      f"{speeds['precompute', path][-1]:.0f} tok/s", flush=True)
    print(f"\n{'stage':<12}{'before tok/s':>14}{'after tok/s':>13}{'ratio':>8}")
    for stage in ("regenerate", "precompute"):
        before, after = (statistics.median(speeds[stage, p]) for p in ("before", "after"))
        print(f"{stage:<12}{before:>14.0f}{after:>13.0f}{after / before:>7.2f}x")
    pairs = [(a, b) for key, x in answers["before"].items() for a, b in zip(x, answers["after"].get(key, []))]
    print(f"\nregenerated answers identical before/after: {sum(a == b for a, b in pairs)}/{len(pairs)} "
          f"(after computes in {str(choice.dtype).removeprefix('torch.')})")


if __name__ == "__main__":
    main()
