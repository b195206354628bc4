"""The products' prefetch (csrc/blocked_linear.cpp): from how many rows a pass should ask for its weights ahead,
on this machine, for the target's own forwards; and what the choice is worth to a speculative chain.

    python benchmarks/prefetch.py [--rows 1 2 4 6 8 12 16] [--pairs 60] [--model DIR] [--target-dtype auto]
                                  [--decode 20] [--decode-repeats 3] [--new-tokens 64] [--head DIR]
                                  [--from 2 9] [--temperature 0] [--draft-temperature 0.85] [--stop 0]

First, runtime/prefetch.py's timing over more row counts: the target's forwards of each number of new tokens
after 256 cached positions, prefetching from 2 rows and never, alternating call by call (`--pairs` pairs per
row count): the median of each way, the median of the pairs' ratios (none / ahead) and their quartiles, and
what runtime/prefetch.py's rule chooses from them. One row is the control: both ways run the same instructions.

Then, with `--decode N`: chain K=3 decoding with the shipped EAGLE-3 head (or --head) drafting from int8
weights on the first N MT-bench first turns, the target's forwards prefetching from each of `--from` rows (13:
never), interleaved per prompt, the order reversed every other repeat: per way the draft and verification ms per
step, tokens/s and the outputs against the first way's (the same: prefetching changes no product's result). At
`--temperature` above 0 the head drafts at `--draft-temperature` and a chain stops early below `--stop`, as
eval.chain.draft_temperatures and eval.chain.stops do.
"""

from __future__ import annotations

import argparse
import functools
import statistics

from _chain_ways import add_arguments, chain_setup, decode_ways, print_ways
from mtptrain.machine import describe_cpu
from mtptrain.runtime import prefetch
from mtptrain.runtime.model import FastDecoder
from mtptrain.runtime.native_kernels import blocked_linear_kernel
from mtptrain.runtime.runner import FastRunner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    parser.add_argument("--pairs", type=int, default=60)
    add_arguments(parser, "MT-bench first turns to decode each way of --from (0: none)")
    parser.add_argument("--from", dest="starts", type=int, nargs="+", default=[prefetch.DEFAULT_FROM, 9],
                        help="the ways of --decode: passes of at least this many rows prefetch (13: none)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--draft-temperature", type=float, default=0.85)
    parser.add_argument("--stop", type=float, default=0.0)
    args = parser.parse_args()
    if any(not 2 <= s <= prefetch.NEVER for s in args.starts):
        parser.error(f"--from takes row counts from 2 to {prefetch.NEVER}")
    if prefetch.CONTROL_ROWS not in args.rows or any(r not in args.rows for r in prefetch.VERIFY_ROWS):
        parser.error(f"--rows must hold {prefetch.CONTROL_ROWS} and {' and '.join(map(str, prefetch.VERIFY_ROWS))}")
    return args


def forwards(args: argparse.Namespace, decoder) -> None:
    print(f"forwards of the target after {prefetch.CONTEXT} cached positions, {args.pairs} pairs per row count, "
          "alternating call by call")
    print("| rows | prefetch from 2: ms | never: ms | none / ahead (median of pairs) | quartiles |")
    print("|---|---|---|---|---|")
    pairs = prefetch.time_pairs(decoder, tuple(args.rows), args.pairs)
    medians = {}
    for rows in args.rows:
        ratios = sorted(pairs[rows]["ratios"])
        q = len(ratios) // 4
        medians[rows] = statistics.median(ratios)
        print(f"| {rows} | {statistics.median(pairs[rows]['ahead']) * 1e3:.2f} | "
              f"{statistics.median(pairs[rows]['none']) * 1e3:.2f} | {medians[rows]:.3f} | "
              f"{ratios[q]:.3f}-{ratios[-q - 1]:.3f} |")
    chosen = prefetch.rule(medians)
    print("the rule's choice: " + ("none (the control's ratio is off 1: too noisy to choose)" if chosen is None
                                   else f"passes of {prefetch.describe(chosen)} prefetch"))


def decode(args: argparse.Namespace, runner, target, head, spec, prompts, stops) -> None:
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.engine.verify import Sampling
    from mtptrain.runtime.linears import fast_linears, product_for

    sampling = Sampling(args.temperature)
    drafting = sampling if sampling.greedy else Sampling(args.draft_temperature)
    ways = {f"from {s}": functools.partial(prefetch.decoder_prefetching, runner.decoder, s) for s in args.starts}
    at = "greedy" if sampling.greedy else (f"T {args.temperature:g}, drafting at {args.draft_temperature:g}"
                                          f"{f', stop {args.stop:g}' if args.stop else ''}")
    print(f"\nchain K=3, int8 drafting weights, {len(prompts)} MT-bench first turns x {args.new_tokens} tokens, {at}, "
          f"{args.decode_repeats} repeats")
    with fast_linears(head, product=product_for("auto", target.model)):
        proposers = {way: HeadChainProposer(head, spec, drafting, stop=args.stop, int8=True) for way in ways}
        results = decode_ways(runner, prompts, proposers, ways, args.decode_repeats, args.new_tokens,
                              {"k": 3, "eos": stops, "sampling": sampling})
    print_ways(results, "prefetch", next(iter(ways)))


def main() -> None:
    args = parse_args()
    print(f"CPU: {describe_cpu()}")
    _, target, head, spec, runner, prompts, stops = chain_setup(args)
    if runner.runtime != "native" or blocked_linear_kernel(runner.decoder.dtype) is None:
        raise SystemExit("the runtime's own product does not run this target here: no prefetch to compare")
    if runner.decoder.product != "native":  # a tiny model's products sit in the caches: another product may win
        print(f"this machine runs the target's products on {runner.decoder.product}; timed here on the runtime's own")
        runner = FastRunner(FastDecoder(target.model, runner.decoder.choice, "native"), runner.capture)
    print(f"target runs on: {runner.decoder.describe()}")
    forwards(args, runner.decoder)
    if args.decode:
        decode(args, runner, target, head, spec, prompts, stops)


if __name__ == "__main__":
    main()
