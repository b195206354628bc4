"""Precompute throughput against a bare forward pass over the same batches, in one run.

    python benchmarks/precompute_throughput.py [--set data.max_conversations=80 ...]

Prints tokens/s of (a) the target's decoder stack alone over exactly the
batches precompute plans, with nothing captured or written, and (b) the full
precompute stage (hooks, dtype conversion, shard assembly, serialisation,
sha256, fsync), and their ratio. Target: ratio >= 0.9, i.e. writing overlaps
compute. Also prints bytes per token on disk against the minimum
(captured layers x hidden size x bytes per element).

Bare and precompute passes alternate (bare, then --rounds times precompute
and bare) and the ratio compares their means, so a machine that speeds up or
slows down during the run does not bias it.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

from mtptrain.data.prepare import prepare_samples
from mtptrain.config import load_recipe
from mtptrain.features.plan import make_batches, plan_shards
from mtptrain.target.layers import resolve_layers
from mtptrain.features.precompute import run_precompute
from mtptrain.runtime.batch import capture_states
from mtptrain.runtime.runner import runtime_for
from mtptrain.target import load_target


def bare_forward_tokens_per_second(target, batches, runtime: str) -> float:
    """The decoder stack over the batches on the runtime precompute uses, nothing captured or written."""
    source = runtime_for(target.model, runtime, batched=True)
    tokens = 0
    start = time.perf_counter()
    for batch in batches:
        longest = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, sample in enumerate(batch):
            ids[row, : len(sample)] = torch.from_numpy(sample.input_ids)
        capture_states(source, ids, [])
        tokens += sum(len(s) for s in batch)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=2, help="precompute passes, each followed by a bare pass")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="recipe override (repeatable); default data.max_conversations=80")
    args = parser.parse_args()
    overrides = ["data.max_conversations=80", *args.overrides]
    logging.basicConfig(level=logging.WARNING)

    recipe = load_recipe(args.recipe, overrides)
    target = load_target(recipe.target)
    layers = resolve_layers(recipe.precompute.layers, target.num_layers)
    samples, _ = prepare_samples(recipe.data, target.tokenizer, show_progress=False)
    element = torch.finfo(getattr(torch, recipe.precompute.dtype)).bits // 8
    min_bytes = len(layers) * target.hidden_size * element
    shards = plan_shards(samples, max(1, int(recipe.precompute.shard_mb * 2**20 / min_bytes)))
    batches = [b for s in shards for b in make_batches(s.samples, recipe.precompute.batch_tokens,
                                                       recipe.precompute.max_batch_size)]
    n_tokens = sum(len(s) for s in samples)
    print(f"target {target.name}, {len(samples)} samples, {n_tokens:,} tokens, {len(batches)} batches, "
          f"layers {layers}, {recipe.precompute.dtype}, {torch.get_num_threads()} threads")

    bare_forward_tokens_per_second(target, batches[:1], recipe.target.runtime)  # warm-up
    bare = [bare_forward_tokens_per_second(target, batches, recipe.target.runtime)]
    full = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as out:
            summary = run_precompute(recipe.model_copy(update={"precompute": recipe.precompute.model_copy(
                update={"output_dir": out})}), show_progress=False)
        full.append(summary["tokens_per_second"])
        bare.append(bare_forward_tokens_per_second(target, batches, recipe.target.runtime))

    mean_bare, mean_full = sum(bare) / len(bare), sum(full) / len(full)
    print(f"bare forward      {mean_bare:10,.0f} tok/s  (passes: {', '.join(f'{x:,.0f}' for x in bare)})")
    print(f"precompute        {mean_full:10,.0f} tok/s  (passes: {', '.join(f'{x:,.0f}' for x in full)}; "
          "capture + convert + write + sha256 + fsync)")
    print(f"ratio             {mean_full / mean_bare:10.3f}   (target >= 0.9)")
    print(f"padding           {summary['padding_fraction']:10.1%}   of the forward batches")
    print(f"bytes per token   {summary['bytes_per_token']:10,.1f}   minimum {min_bytes:,} "
          f"({len(layers)} layers x {target.hidden_size} x {element} B): x{summary['bytes_per_token'] / min_bytes:.4f}")


if __name__ == "__main__":
    main()
