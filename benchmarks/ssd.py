"""Speculative speculative decoding against ordinary speculative and autoregressive decoding, in one run.

    python benchmarks/ssd.py [--prompts 4] [--new-tokens 96] [--k 4] [--drafters head,draft]
                             [--draft-layers 10] [--budgets 1,2,4,8,16] [--factors 1,0.5,0.2] [--model DIR]

Target: the embedded SmolLM2-135M-Instruct, or the target --model names (float32, CPU). Drafters:

  head    the EAGLE-3 head shipped in pretrained/ (or --head DIR): it reads the target's states, which reach
          the SSD worker after each verification
  draft   a small draft model: the target cut to its first --draft-layers decoder layers

On this CPU the "separate hardware" of SSD is a second process with its own cores: the target runs on
`--target-threads` threads in this process, the drafter on `--draft-threads` in the worker. Methods, every
one on every prompt before the next prompt (interleaved), warmed up first, at temperature 0:

  ar-T          autoregressive decoding on T threads (the baseline of the ratios: ar on all threads)
  sd-T <d>      ordinary speculative decoding with drafter d, in this process, on T threads
  ssd <d>       drafter d in its own process, pre-drafting for guessed outcomes while the target verifies

Then, with each drafter of --sweep-drafters, SSD with every round's budget spent before the next draft is
handed out (the cache's quality apart from this machine's timing): hit rate by drafts accepted j against
the cache budget (temperature 0), and Saguaro's factor C at temperature 1 (hit rate, acceptance, tau).
Ratios are tokens/s against the baseline measured in this run. The compared proposers are eval's own
configurations (mtptrain.eval.methods.build_configs: chain and ssd for the head, draft and ssd-draft for the draft
model); the sweeps build their SSD workers here, as eval has no setting for spending the whole budget.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mtptrain.config import Recipe, load_recipe
from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.runtime.linears import fast_linears, product_for
from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import Runner, open_runner
from mtptrain.engine.ssd import SSDProposer, SSDSettings
from mtptrain.engine.verify import Sampling
from mtptrain.eval.drafters import draft_lm, head_parts
from mtptrain.eval.methods import Config, build_configs
from mtptrain.eval.prompts import load_prompts
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.target import load_target

EVAL_METHODS = {"head": ("chain", "ssd"), "draft": ("draft", "ssd-draft")}  # per drafter: in process, SSD


class Tally:
    def __init__(self, name):
        self.name, self.tokens, self.seconds, self.emitted, self.steps, self.draft_seconds = name, 0, 0.0, 0, 0, 0.0
        self.verify_seconds = 0.0
        self.accepted, self.proposed, self.outputs = 0, 0, []

    def add(self, result, seconds):
        self.tokens += len(result.tokens)
        self.seconds += seconds
        self.emitted += result.stats.emitted
        self.steps += result.stats.steps
        self.draft_seconds += result.stats.draft_seconds
        self.verify_seconds += result.stats.verify_seconds
        self.accepted += result.stats.accepted[0] if result.stats.accepted else 0
        self.proposed += result.stats.proposed[0] if result.stats.proposed else 0
        self.outputs.append(result.tokens)

    @property
    def tps(self):
        return self.tokens / self.seconds

    @property
    def tau(self):
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class Drafter:
    """One drafter: the runner its methods verify with, eval's in-process (sd) and SSD configurations, and the
    SSD worker's `make` with the target layers it reads (for the sweeps' own SSD settings)."""

    runner: Runner
    sd: Config
    ssd: Config
    make: Callable
    layers: list[int] | None


def timed(threads, fn):
    torch.set_num_threads(threads)
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def hits_line(stats) -> str:
    by_j = " ".join(f"j={j}:{h}/{h + m}" for j, (h, m) in enumerate(zip(stats.hits, stats.misses)) if h + m)
    return f"hit rate {stats.hit_rate:.2f} ({by_j}), {stats.guesses} guesses, {stats.rounds_cut} rounds cut short"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--drafters", default="head,draft")
    parser.add_argument("--head", default=str(PRETRAINED_HEAD))
    parser.add_argument("--model", help="target.model (a model directory, GGUF or hub id) instead of the embedded "
                        "default")
    parser.add_argument("--draft-layers", type=int, default=10)
    parser.add_argument("--budget", type=int, default=8, help="SSD guesses per round in the method comparison")
    parser.add_argument("--budgets", default="1,2,4,8,16")
    parser.add_argument("--factors", default="1,0.5,0.2")
    parser.add_argument("--sweep-drafters", default="head", help="drafters of the budget and C sweeps ('' = none)")
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--fallback", choices=["draft", "ngram"], default="draft",
                        help="on a cache miss: the drafter from scratch, or prompt lookup first")
    args = parser.parse_args()
    unknown = {d for d in f"{args.drafters},{args.sweep_drafters}".split(",") if d} - set(EVAL_METHODS)
    if unknown:
        parser.error(f"unknown drafter(s) {', '.join(sorted(unknown))}; choose from {', '.join(EVAL_METHODS)}")
    return args


def eval_recipe(args, drafters: list[str]) -> Recipe:
    """The default recipe on a float32 CPU target, its eval set to the methods of `drafters` and this run's K,
    head, draft model and SSD settings."""
    methods = ",".join(m for d in drafters for m in EVAL_METHODS[d])
    return load_recipe(None, ["target.device=cpu", "target.dtype=float32", f"eval.methods=[{methods}]",
                              f"eval.k=[{args.k}]", f"eval.head={args.head}", f"eval.draft.layers={args.draft_layers}",
                              f"eval.ssd.budget={args.budget}", f"eval.ssd.threads={args.draft_threads}",
                              f"eval.ssd.fallback={args.fallback}", "eval.ssd.device=cpu",
                              *([f"target.model={args.model}"] if args.model else [])])


def load_drafters(recipe: Recipe, target) -> tuple[dict[str, Drafter], list]:
    """The drafters of the recipe's eval methods, and the drafting modules besides the target (the head, the
    draft model)."""
    configs, head_info, notes, modules = build_configs(recipe, target, Sampling())
    if notes:  # a method this benchmark compares was left out
        raise SystemExit("; ".join(notes))
    by_method = {c.method: c for c in configs}
    drafters = {}
    if head_info is not None:
        spec = head_info.spec
        layers = spec.family.draft_layers(spec)
        make = functools.partial(head_parts, str(head_info.path), recipe.target, target.identity(), "cpu")
        drafters["head"] = Drafter(open_runner(target.model, capture=layers), by_method["chain"], by_method["ssd"],
                                   make, layers)
    if "draft" in by_method:
        make = functools.partial(draft_lm, recipe.target, None, recipe.eval.draft.layers, "cpu")
        drafters["draft"] = Drafter(open_runner(target.model), by_method["draft"], by_method["ssd-draft"], make, None)
    return drafters, modules


def comparison_methods(args, plain, drafters: dict[str, Drafter], workers, stops) -> dict[str, tuple]:
    """Every compared method by name: (the target's threads, a generation of one prompt)."""
    all_threads, threads = args.target_threads + args.draft_threads, args.target_threads

    def run(runner, proposer=None):
        return lambda ids: generate(runner, ids, args.new_tokens, proposer, k=args.k, eos=stops)

    methods = {f"ar-{all_threads}": (all_threads, run(plain)), f"ar-{threads}": (threads, run(plain))}
    for name, worker in workers.items():
        drafter = drafters[name]
        sd = drafter.sd.make()
        methods[f"sd-{all_threads} {name}"] = (all_threads, run(drafter.runner, sd))
        methods[f"sd-{threads} {name}"] = (threads, run(drafter.runner, sd))
        methods[f"ssd {name}"] = (threads, run(drafter.runner, worker))
    return methods


def compare(args, plain, drafters: dict[str, Drafter], names: list[str], prompts, tokenizer, stops) -> None:
    """Autoregressive, in-process and SSD decoding, interleaved over the prompts after a warm-up; the table."""
    workers = {name: drafters[name].ssd.make() for name in names}
    try:
        methods = comparison_methods(args, plain, drafters, workers, stops)
        tallies = {name: Tally(name) for name in methods}
        warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
        for threads, fn in methods.values():
            timed(threads, lambda: fn(warm))
        before = {name: w.stats() for name, w in workers.items()}
        for ids in prompts:
            for name, (threads, fn) in methods.items():
                tallies[name].add(*timed(threads, lambda: fn(ids)))
        after = {name: w.stats().since(before[name]) for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    print_comparison(tallies, after, args.target_threads + args.draft_threads, len(prompts))


def print_comparison(tallies: dict[str, Tally], ssd_stats: dict, all_threads: int, prompts: int) -> None:
    base = tallies[f"ar-{all_threads}"]
    print(f"\n{'method':<12} {'tok/s':>7} {'x ar-' + str(all_threads):>8} {'tau':>5} {'draft ms':>9} "
          f"{'verify ms':>10} {'same':>5}   (ms per step)")
    for tally in tallies.values():
        same = sum(a == b for a, b in zip(tally.outputs, base.outputs))
        print(f"{tally.name:<12} {tally.tps:7.2f} {tally.tps / base.tps:8.2f} {tally.tau:5.2f} "
              f"{1000 * tally.draft_seconds / tally.steps:9.1f} {1000 * tally.verify_seconds / tally.steps:10.1f} "
              f"{same:>2}/{prompts}")
    for name, stats in ssd_stats.items():
        print(f"ssd {name}: {hits_line(stats)}")


def complete_worker(args, drafter: Drafter, budget: int, factor: float = 1.0, sampling: Sampling = Sampling()):
    """An SSD worker that spends every round's budget before the next draft is handed out."""
    settings = SSDSettings(k=args.k, budget=budget, factor=factor, sampling=sampling, threads=args.draft_threads,
                           fallback=args.fallback, complete=True)
    return SSDProposer(drafter.make, settings, drafter.layers)


def budget_sweep(args, name: str, drafter: Drafter, prompts, stops) -> None:
    """SSD's hit rate against the cache budget, at temperature 0."""
    print(f"\nSSD with {name}: hit rate against the cache budget (temperature 0), every round's budget spent "
          "before the next draft:")
    for budget in [int(b) for b in args.budgets.split(",")]:
        proposer = complete_worker(args, drafter, budget)
        tally = Tally(f"budget {budget}")
        for ids in prompts:
            tally.add(*timed(args.target_threads, lambda: generate(
                drafter.runner, ids, args.new_tokens, proposer, k=args.k, eos=stops)))
        print(f"  budget {budget:>3}: {hits_line(proposer.stats())}; tau {tally.tau:.2f}")
        proposer.close()


def factor_sweep(args, name: str, drafter: Drafter, prompts, stops) -> None:
    """Saguaro's C at temperature 1: hit rate, the first draft position's acceptance, tau."""
    print(f"\nSSD with {name}: Saguaro's C at temperature 1 (hit rate, the first draft position's acceptance, "
          "tau), budgets spent in full:")
    sampling = Sampling(temperature=1.0)
    for factor in [float(f) for f in args.factors.split(",")]:
        proposer = complete_worker(args, drafter, args.budget, factor, sampling)
        tally = Tally(f"C {factor}")
        for seed, ids in enumerate(prompts):
            tally.add(*timed(args.target_threads, lambda: generate(
                drafter.runner, ids, args.new_tokens, proposer, k=args.k, eos=stops, sampling=sampling, seed=seed)))
        print(f"  C {factor:<4}: {hits_line(proposer.stats())}; acceptance at position 1 "
              f"{tally.accepted / max(1, tally.proposed):.2f}, tau {tally.tau:.2f}")
        proposer.close()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    names = [d for d in args.drafters.split(",") if d]
    swept = [d for d in args.sweep_drafters.split(",") if d]
    recipe = eval_recipe(args, [d for d in EVAL_METHODS if d in names + swept])
    target = load_target(recipe.target)
    stops = stop_tokens(target.tokenizer, target.model)
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    drafters, modules = load_drafters(recipe, target)
    name = target.name if args.model else "SmolLM2-135M-Instruct"
    print(f"{name}, float32 CPU; K={args.k}; {len(prompts)} MT-bench prompts x {args.new_tokens} new "
          f"tokens; target {args.target_threads} thread(s), SSD drafter {args.draft_threads} in its own process; "
          f"drafters: head = {Path(args.head).name}, draft = first {args.draft_layers} of {target.num_layers} layers")
    with fast_linears(*modules, product=product_for("auto", target.model)):
        compare(args, open_runner(target.model), drafters, names, prompts, target.tokenizer, stops)
        for name in swept:
            budget_sweep(args, name, drafters[name], prompts, stops)
            factor_sweep(args, name, drafters[name], prompts, stops)


if __name__ == "__main__":
    main()
