"""Speculative speculative decoding against ordinary speculative and autoregressive decoding, in one run.

    python benchmarks/ssd.py [--prompts 4] [--new-tokens 96] [--k 4] [--drafters head,draft]
                             [--draft-layers 10] [--budgets 1,2,4,8,16] [--factors 1,0.5,0.2]

Target: the embedded SmolLM2-135M-Instruct (float32, CPU). Drafters:

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
Ratios are tokens/s against the baseline measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from pathlib import Path

import torch

from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.eval.prompts import load_prompts
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.config import TargetConfig
from mtptrain.engine.cpu_matmul import skinny_linears
from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
from mtptrain.engine.generate import generate
from mtptrain.engine.runner import TargetRunner
from mtptrain.engine.ssd import SSDProposer, SSDSettings
from mtptrain.eval.drafters import draft_lm, head_parts
from mtptrain.engine.verify import Sampling
from mtptrain.heads import FrozenTarget
from mtptrain.export.source import load_head_directory
from mtptrain.target import load_target


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


def timed(threads, fn):
    torch.set_num_threads(threads)
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def hits_line(stats) -> str:
    by_j = " ".join(f"j={j}:{h}/{h + m}" for j, (h, m) in enumerate(zip(stats.hits, stats.misses)) if h + m)
    return f"hit rate {stats.hit_rate:.2f} ({by_j}), {stats.guesses} guesses, {stats.rounds_cut} rounds cut short"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--drafters", default="head,draft")
    parser.add_argument("--head", default=str(PRETRAINED_HEAD))
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
    logging.basicConfig(level=logging.WARNING)
    all_threads = args.target_threads + args.draft_threads
    drafters = [d for d in args.drafters.split(",") if d]

    config = TargetConfig(device="cpu", dtype="float32")
    target = load_target(config)
    stops = stop_tokens(target.tokenizer, target.model)
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    head, spec = load_head_directory(Path(args.head), FrozenTarget.of(target.model), target.identity())
    head.float()
    head_layers = spec.family.draft_layers(spec)
    plain, reading = TargetRunner(target.model), TargetRunner(target.model, capture=head_layers)
    makers = {  # per drafter: the runner, an in-process proposer, the SSD worker's `make` and the layers it reads
        "head": (reading, lambda: spec.family.chain(head, spec),
                 functools.partial(head_parts, args.head, config, target.identity(), "cpu"), head_layers),
        "draft": (plain, lambda: DraftModelProposer(truncated_target(target.model, args.draft_layers)),
                  functools.partial(draft_lm, config, None, args.draft_layers, "cpu"), None),
    }

    def ssd(drafter, budget, factor=1.0, sampling=Sampling(), complete=False):
        _, _, make, layers = makers[drafter]
        return SSDProposer(make, SSDSettings(k=args.k, budget=budget, factor=factor, sampling=sampling,
                                             threads=args.draft_threads, fallback=args.fallback, complete=complete),
                           layers)

    print(f"SmolLM2-135M-Instruct, float32 CPU; K={args.k}; {len(prompts)} MT-bench prompts x {args.new_tokens} new "
          f"tokens; target {args.target_threads} thread(s), SSD drafter {args.draft_threads} in its own process; "
          f"drafters: head = {Path(args.head).name}, draft = first {args.draft_layers} of 30 layers")
    with skinny_linears(target.model, head):
        workers = {d: ssd(d, args.budget) for d in drafters}
        sd = {d: makers[d][1]() for d in drafters}

        def run(runner, proposer=None):
            return lambda ids: generate(runner, ids, args.new_tokens, proposer, k=args.k, eos=stops)

        methods = {f"ar-{all_threads}": (all_threads, run(plain)), f"ar-{args.target_threads}": (
            args.target_threads, run(plain))}
        for d in drafters:
            methods[f"sd-{all_threads} {d}"] = (all_threads, run(makers[d][0], sd[d]))
            methods[f"sd-{args.target_threads} {d}"] = (args.target_threads, run(makers[d][0], sd[d]))
            methods[f"ssd {d}"] = (args.target_threads, run(makers[d][0], workers[d]))
        tallies = {name: Tally(name) for name in methods}
        warm = prompt_ids(target.tokenizer, [{"role": "user", "content": "Hello!"}])
        for threads, fn in methods.values():
            timed(threads, lambda: fn(warm))
        before = {d: w.stats() for d, w in workers.items()}
        for ids in prompts:
            for name, (threads, fn) in methods.items():
                result, seconds = timed(threads, lambda: fn(ids))
                tallies[name].add(result, seconds)
        after = {d: w.stats().since(before[d]) for d, w in workers.items()}
        for w in workers.values():
            w.close()
        base = tallies[f"ar-{all_threads}"]
        print(f"\n{'method':<12} {'tok/s':>7} {'x ar-' + str(all_threads):>8} {'tau':>5} {'draft ms':>9} "
              f"{'verify ms':>10} {'same':>5}   (ms per step)")
        for tally in tallies.values():
            same = sum(a == b for a, b in zip(tally.outputs, base.outputs))
            print(f"{tally.name:<12} {tally.tps:7.2f} {tally.tps / base.tps:8.2f} {tally.tau:5.2f} "
                  f"{1000 * tally.draft_seconds / tally.steps:9.1f} {1000 * tally.verify_seconds / tally.steps:10.1f} "
                  f"{same:>2}/{len(prompts)}")
        for d, stats in after.items():
            print(f"ssd {d}: {hits_line(stats)}")

        for d in [d for d in args.sweep_drafters.split(",") if d]:
            runner = makers[d][0]
            print(f"\nSSD with {d}: hit rate against the cache budget (temperature 0), every round's budget spent "
                  "before the next draft:")
            for budget in [int(b) for b in args.budgets.split(",")]:
                proposer = ssd(d, budget, complete=True)
                tally = Tally(f"budget {budget}")
                for ids in prompts:
                    tally.add(*timed(args.target_threads, lambda: generate(
                        runner, ids, args.new_tokens, proposer, k=args.k, eos=stops)))
                print(f"  budget {budget:>3}: {hits_line(proposer.stats())}; tau {tally.tau:.2f}")
                proposer.close()

            print(f"\nSSD with {d}: Saguaro's C at temperature 1 (hit rate, the first draft position's acceptance, "
                  "tau), budgets spent in full:")
            sampling = Sampling(temperature=1.0)
            for factor in [float(f) for f in args.factors.split(",")]:
                proposer = ssd(d, args.budget, factor, sampling, complete=True)
                tally = Tally(f"C {factor}")
                for seed, ids in enumerate(prompts):
                    tally.add(*timed(args.target_threads, lambda: generate(
                        runner, ids, args.new_tokens, proposer, k=args.k, eos=stops, sampling=sampling, seed=seed)))
                print(f"  C {factor:<4}: {hits_line(proposer.stats())}; acceptance at position 1 "
                      f"{tally.accepted / max(1, tally.proposed):.2f}, tau {tally.tau:.2f}")
                proposer.close()


if __name__ == "__main__":
    main()
