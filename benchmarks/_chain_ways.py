"""A helper of the decoding benchmarks (prefetch.py, rms_norm.py), not a benchmark: the shipped head's chain
decoding of MT-bench first turns, several ways of running it interleaved, and their table."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, ContextManager


def add_arguments(parser: argparse.ArgumentParser, decode_help: str) -> None:
    parser.add_argument("--decode", type=int, default=0, help=decode_help)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--head", help="a trained EAGLE-3 head directory (default: the shipped one)")
    parser.add_argument("--model", help="target.model (a model directory or hub id) instead of the embedded default")
    parser.add_argument("--target-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target.dtype of the decoding (auto: what this machine measured fastest)")


def chain_setup(args: argparse.Namespace, more: tuple[str, ...] = ()):
    """(recipe, target, head, spec, runner, prompts, stops) for chain K=3 decoding with --head over the target
    --model, drafting from int8 weights, on the first --decode MT-bench first turns (none for 0); `more`: recipe
    overrides."""
    from mtptrain.config import load_recipe
    from mtptrain.data.chat import prompt_ids, stop_tokens
    from mtptrain.engine.verify import Sampling
    from mtptrain.eval.methods import build_configs
    from mtptrain.eval.prompts import load_prompts
    from mtptrain.heads.checkpoint import PRETRAINED_HEAD
    from mtptrain.heads.eagle3 import Eagle3Head
    from mtptrain.runtime.runner import open_runner, runtime_for
    from mtptrain.target import load_target

    model = [f"target.model={args.model}"] if args.model else []
    recipe = load_recipe(None, ["eval.methods=[chain]", "eval.k=[3]", f"eval.head={args.head or PRETRAINED_HEAD}",
                                f"target.dtype={args.target_dtype}", *model, *more])
    target = load_target(recipe.target)
    _, info, _, modules = build_configs(recipe, target, Sampling())
    head, spec = modules[0], info.spec
    if not isinstance(head, Eagle3Head):
        raise SystemExit(f"{recipe.eval.head} is an {spec.kind} head: this benchmark drafts with EAGLE-3 heads")
    stops = stop_tokens(target.tokenizer, target.model)
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.decode)] if args.decode else []
    runner = open_runner(runtime_for(target.model), spec.family.draft_layers(spec))
    return recipe, target, head, spec, runner, prompts, stops


def decode_ways(runner, prompts: list[list[int]], proposers: dict[str, object],
                ways: dict[str, Callable[[], ContextManager]], repeats: int, new_tokens: int,
                generate_kw: dict) -> dict:
    """way -> {"draft", "verify": ms per step, "tps": tokens/s, one per repeat; "outputs": repeat 0's tokens per
    prompt}: every prompt decoded each way in turn (each within its `ways[way]()`, by its own proposer), the order
    reversed every other repeat, after a warm-up of each way."""
    from mtptrain.engine.generate import GenerationStats, generate

    names = list(ways)
    results = {way: {"draft": [], "verify": [], "tps": [], "outputs": []} for way in names}
    for way in names:  # warm-up
        with ways[way]():
            generate(runner, prompts[0][:16], 8, proposers[way], **generate_kw)
    for repeat in range(repeats):
        stats = {way: GenerationStats() for way in names}
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for ids in prompts:
            for way in names if repeat % 2 == 0 else names[::-1]:
                with ways[way]():
                    start = time.perf_counter()
                    out = generate(runner, ids, new_tokens, proposers[way], **generate_kw)
                    seconds[way] += time.perf_counter() - start
                stats[way].merge(out.stats)
                tokens[way] += len(out.tokens)
                if repeat == 0:
                    results[way]["outputs"].append(out.tokens)
        for way, s in stats.items():
            results[way]["draft"].append(s.draft_seconds / s.steps * 1e3)
            results[way]["verify"].append(s.verify_seconds / s.steps * 1e3)
            results[way]["tps"].append(tokens[way] / seconds[way])
    return results


def print_ways(results: dict, first: str, reference: str) -> None:
    """The table (first column headed `first`) and each way's tokens/s against `reference`'s, repeat by repeat."""
    print(f"| {first} | draft / verify ms per step | tokens/s (spread) | same outputs as {reference}'s |")
    print("|---|---|---|---|")
    for way, r in results.items():
        same = sum(a == b for a, b in zip(r["outputs"], results[reference]["outputs"]))
        print(f"| {way} | {statistics.median(r['draft']):.2f} / {statistics.median(r['verify']):.2f} | "
              f"{statistics.median(r['tps']):.1f} ({min(r['tps']):.1f}-{max(r['tps']):.1f}) | "
              f"{same}/{len(r['outputs'])} |")
    for way in results:
        if way != reference:
            ratios = [a / b for a, b in zip(results[way]["tps"], results[reference]["tps"])]
            print(f"{way} / {reference} tokens/s: {statistics.median(ratios):.3f}x "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")
