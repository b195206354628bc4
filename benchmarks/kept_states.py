"""Regenerate then precompute, with the states kept while decoding (regenerate.keep_states) against without,
in one run: the time of each stage and of both, and how the two stores compare.

    python benchmarks/kept_states.py [--recipe recipes/reference.yaml] [--conversations 256] [--rounds 2]

Each round runs both ways, alternately (keeping first in odd rounds), each into a fresh directory:
`mtptrain regenerate` on the first --conversations of the recipe's data, then `mtptrain precompute` of the
regenerated file. With the states kept, precompute copies them instead of running the target; without, it
runs the target over every conversation as it always did. Times are the stages' wall times (a process-level
start-up, the target's loading, is paid by both ways alike).

The stores are compared on the conversations both hold with the same ids: the largest difference of any
stored state, the mean relative difference, and the share of positions where the target's stored greedy next
token agrees (the states come from decoding steps and prefill chunks on one side, whole-sample forwards on the
other: float rounding apart, and the target's choices apart only at near-ties).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from mtptrain.config import load_recipe
from mtptrain.data.regenerate import run_regenerate
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import TARGET_TOP, load_manifest
from mtptrain.machine import cpu_line, describe_cpu
from mtptrain.runtime.choice import choose
from mtptrain.dist import DistInfo, pick_device
from mtptrain.target import load_config


def one_way(args, keep: bool, out: Path) -> dict:
    recipe = load_recipe(args.recipe, [f"data.max_conversations={args.conversations}",
                                       f"data.regenerated={out / 'regenerated.jsonl'}",
                                       f"precompute.output_dir={out / 'features'}",
                                       f"regenerate.keep_states={str(keep).lower()}", *args.sets])
    started = time.perf_counter()
    regenerated = run_regenerate(recipe, show_progress=False)
    middle = time.perf_counter()
    stored = run_precompute(recipe, show_progress=False)
    ended = time.perf_counter()
    return {"regenerate": middle - started, "precompute": ended - middle, "both": ended - started,
            "answer_tokens": regenerated["answer_tokens"], "store_tokens": stored["tokens"],
            "copied": stored["tokens_copied"]}


def rows_of(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    rows = {}
    for shard in load_manifest(directory)["shards"]:
        with safe_open(str(directory / shard["file"]), framework="pt") as handle:
            keys = json.loads(handle.metadata()["keys"])
            offsets = handle.get_tensor("offsets")
            tensors = {name: handle.get_tensor(name) for name in handle.keys() if name != "offsets"}
        for i, key in enumerate(keys):
            rows[key] = {name: t[int(offsets[i]):int(offsets[i + 1])] for name, t in tensors.items()}
    return rows


def compare(kept_dir: Path, computed_dir: Path) -> str:
    kept, computed = rows_of(kept_dir), rows_of(computed_dir)
    same = [k for k in kept if k in computed and torch.equal(kept[k]["input_ids"], computed[k]["input_ids"])]
    worst, relative, agree, positions = 0.0, [], 0, 0
    for key in same:
        for name in kept[key]:
            if name.startswith("hidden."):
                a, b = kept[key][name].float(), computed[key][name].float()
                worst = max(worst, float((a - b).abs().max()))
                relative.append(float((a - b).norm() / b.norm().clamp_min(1e-12)))
        agree += int((kept[key][TARGET_TOP] == computed[key][TARGET_TOP]).sum())
        positions += len(kept[key][TARGET_TOP])
    return (f"{len(same)} of {len(kept)} conversations with the same ids both ways; states: largest difference "
            f"{worst:.3g}, mean relative difference {statistics.mean(relative):.2e}; the target's stored next "
            f"token agrees at {agree / max(positions, 1):.2%} of {positions:,} positions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra recipe override")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    recipe = load_recipe(args.recipe, args.sets)
    device = pick_device(recipe.target.device, DistInfo.from_env())
    choice = choose(load_config(recipe.target), device, recipe.target.dtype)
    cpu = describe_cpu()
    print(cpu_line(cpu) + f", {torch.get_num_threads()} threads; runtime choice: "
          f"{choice.describe()}; {args.conversations} conversations, {args.rounds} rounds")
    times = {way: [] for way in ("computed", "kept")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [True, False] if r % 2 == 0 else [False, True]
            for keep in order:
                way = "kept" if keep else "computed"
                result = one_way(args, keep, Path(tmp) / f"{way}-{r}")
                times[way].append(result)
                print(f"  round {r + 1}, {way:<8}: regenerate {result['regenerate']:6.1f} s, precompute "
                      f"{result['precompute']:6.1f} s, both {result['both']:6.1f} s ({result['answer_tokens']:,} "
                      f"answer tokens, store {result['store_tokens']:,} tokens, {result['copied']:,} copied)",
                      flush=True)
        print(f"\n{'way':<10}{'regenerate s':>14}{'precompute s':>14}{'both s':>10}")
        for way, results in times.items():
            print(f"{way:<10}" + "".join(f"{statistics.median(x[part] for x in results):>{w}.1f}"
                                         for part, w in (("regenerate", 14), ("precompute", 14), ("both", 10))))
        ratio = [c["both"] / k["both"] for c, k in zip(times["computed"], times["kept"])]
        cost = [k["regenerate"] / c["regenerate"] for c, k in zip(times["computed"], times["kept"])]
        print(f"both stages: {statistics.median(ratio):.2f}x faster with the states kept (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratio)}); regenerate alone {statistics.median(cost):.3f}x the time "
              "it takes without keeping them")
        print(compare(Path(tmp) / "kept-0" / "features", Path(tmp) / "computed-0" / "features"))


if __name__ == "__main__":
    main()
