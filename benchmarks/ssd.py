"""Speculative speculative decoding against ordinary speculative and autoregressive decoding, in one run.

    python benchmarks/ssd.py [--prompts 6] [--new-tokens 96] [--k 4] [--draft-layers 4] [--budgets 2,4,8,16]
                             [--factors 1,0.5,0.2]

Target: the embedded SmolLM2-135M-Instruct (float32, CPU). Drafter: the target cut to its first
--draft-layers decoder layers (same tokenizer, shared weights). On this CPU the "separate hardware" of SSD
is a second process with its own cores: the target runs on `--target-threads` threads in this process, the
drafter on `--draft-threads` in the worker. Methods, every one on every prompt before the next prompt
(interleaved), warmed up first, at temperature 0:

  ar-T          autoregressive decoding on T threads (the baseline of the ratios is ar on all threads)
  sd-T          ordinary speculative decoding with the same drafter, in this process, on T threads
  ssd           the drafter in its own process, pre-drafting for guessed outcomes while the target verifies

Then SSD alone, each round's budget spent in full before the next draft (the cache's quality apart from this
machine's timing): hit rate against the cache budget (temperature 0), and the effect of Saguaro's factor C
at temperature 1 on hit rate and acceptance. Ratios are tokens/s against the baseline measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time

import torch

from data_prep.chat import prompt_ids, stop_tokens
from eval.prompts import load_prompts
from mtptrain.config import TargetConfig
from mtptrain.engine.cpu_matmul import skinny_linears
from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
from mtptrain.engine.generate import generate
from mtptrain.engine.runner import TargetRunner
from mtptrain.engine.ssd import SSDProposer, SSDSettings
from mtptrain.engine.verify import Sampling
from mtptrain.target import load_target


def worker_draft(layers: int):
    """The SSD worker's drafter: the embedded target cut to `layers` layers, with the CPU linear layers eval
    uses (kept for the life of the worker process)."""
    model = truncated_target(load_target(TargetConfig(device="cpu")).model, layers)
    skinny_linears(model).__enter__()  # never exited: the process exists only to draft
    return model


class Tally:
    def __init__(self, name):
        self.name, self.tokens, self.seconds, self.emitted, self.steps, self.draft_seconds = name, 0, 0.0, 0, 0, 0.0
        self.outputs = []

    def add(self, result, seconds):
        self.tokens += len(result.tokens)
        self.seconds += seconds
        self.emitted += result.stats.emitted
        self.steps += result.stats.steps
        self.draft_seconds += result.stats.draft_seconds
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
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8, help="SSD guesses per round in the method comparison")
    parser.add_argument("--budgets", default="1,2,4,8,16")
    parser.add_argument("--factors", default="1,0.5,0.2")
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--fallback", choices=["draft", "ngram"], default="draft",
                        help="on a cache miss: the drafter from scratch, or prompt lookup first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    all_threads = args.target_threads + args.draft_threads

    target = load_target(TargetConfig(device="cpu"))
    stops = stop_tokens(target.tokenizer, target.model)
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    draft = truncated_target(target.model, args.draft_layers)
    runner = TargetRunner(target.model)
    make_worker = functools.partial(worker_draft, args.draft_layers)

    def ssd(budget, factor=1.0, sampling=Sampling(), complete=False):
        return SSDProposer(make_worker, SSDSettings(k=args.k, budget=budget, factor=factor, sampling=sampling,
                                                    threads=args.draft_threads, fallback=args.fallback,
                                                    complete=complete))

    print(f"SmolLM2-135M-Instruct, float32 CPU; drafter: first {args.draft_layers} of 30 layers; K={args.k}; "
          f"{len(prompts)} MT-bench prompts x {args.new_tokens} new tokens; target {args.target_threads} thread(s), "
          f"SSD drafter {args.draft_threads} in its own process")
    with skinny_linears(target.model):
        main_ssd = ssd(args.budget)
        sd_proposer = DraftModelProposer(draft)
        methods = {
            f"ar-{all_threads}": (all_threads, lambda ids: generate(runner, ids, args.new_tokens, eos=stops)),
            f"ar-{args.target_threads}": (args.target_threads,
                                          lambda ids: generate(runner, ids, args.new_tokens, eos=stops)),
            f"sd-{all_threads}": (all_threads, lambda ids: generate(runner, ids, args.new_tokens, sd_proposer,
                                                                     k=args.k, eos=stops)),
            f"sd-{args.target_threads}": (args.target_threads, lambda ids: generate(
                runner, ids, args.new_tokens, sd_proposer, k=args.k, eos=stops)),
            "ssd": (args.target_threads, lambda ids: generate(runner, ids, args.new_tokens, main_ssd, k=args.k,
                                                              eos=stops)),
        }
        tallies = {name: Tally(name) for name in methods}
        warm = prompt_ids(target.tokenizer, [{"role": "user", "content": "Hello!"}])
        for threads, run in methods.values():
            timed(threads, lambda: run(warm))
        warm_stats = main_ssd.stats()
        for ids in prompts:
            for name, (threads, run) in methods.items():
                result, seconds = timed(threads, lambda: run(ids))
                tallies[name].add(result, seconds)
        ssd_stats = main_ssd.stats()
        main_ssd.close()
        base = tallies[f"ar-{all_threads}"]
        print(f"\n{'method':<8} {'tok/s':>7} {'x ar-' + str(all_threads):>8} {'tau':>5} {'draft s':>8} {'same':>5}")
        for tally in tallies.values():
            same = sum(a == b for a, b in zip(tally.outputs, base.outputs))
            print(f"{tally.name:<8} {tally.tps:7.2f} {tally.tps / base.tps:8.2f} {tally.tau:5.2f} "
                  f"{tally.draft_seconds:8.2f} {same:>2}/{len(prompts)}")
        print(f"ssd: {hits_line(ssd_stats)} (warm-up included: {sum(warm_stats.hits)} hits)")

        print("\nSSD hit rate against the cache budget (temperature 0), every round's budget spent before the "
              "next draft (the cache's quality apart from this machine's timing):")
        for budget in [int(b) for b in args.budgets.split(",")]:
            proposer = ssd(budget, complete=True)
            tally = Tally(f"budget {budget}")
            for ids in prompts:
                result, seconds = timed(args.target_threads, lambda: generate(
                    runner, ids, args.new_tokens, proposer, k=args.k, eos=stops))
                tally.add(result, seconds)
            print(f"  budget {budget:>3}: {hits_line(proposer.stats())}; tau {tally.tau:.2f}, "
                  f"{tally.tps / base.tps:.2f}x ar-{all_threads}")
            proposer.close()

        print("\nSaguaro's C at temperature 1 (hit rate, and the first draft position's acceptance), budgets "
              "spent in full:")
        sampling = Sampling(temperature=1.0)
        for factor in [float(f) for f in args.factors.split(",")]:
            proposer = ssd(args.budget, factor, sampling, complete=True)
            tally, accepted, proposed = Tally(f"C {factor}"), 0, 0
            for seed, ids in enumerate(prompts):
                result, seconds = timed(args.target_threads, lambda: generate(
                    runner, ids, args.new_tokens, proposer, k=args.k, eos=stops, sampling=sampling, seed=seed))
                tally.add(result, seconds)
                accepted += result.stats.accepted[0] if result.stats.accepted else 0
                proposed += result.stats.proposed[0] if result.stats.proposed else 0
            print(f"  C {factor:<4}: {hits_line(proposer.stats())}; acceptance at position 1 "
                  f"{accepted / max(1, proposed):.2f}, tau {tally.tau:.2f}")
            proposer.close()


if __name__ == "__main__":
    main()
