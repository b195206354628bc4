"""A standalone RMSNorm: torch's `F.rms_norm` (what the decoder's first and last norms and a draft head's norms
ran before) against the runtime's kernel (csrc/layer_ops.cpp, `rms_norm`), in one run.

    python benchmarks/rms_norm.py [--rows 1 3 4 160] [--width 576] [--repeats 300] [--dtype bfloat16]
                                  [--decode 20] [--decode-repeats 3] [--new-tokens 64] [--head DIR] [--model DIR]
                                  [--target-dtype auto]

First, for each row count (a drafting step's one row, an observe over a few, a K=3 chain's verification of 4,
a prompt), the median µs of `--repeats` calls each way, interleaved, warm (the rows just used) and cold (after
320 MB of other memory was written, as after a target forward, and the rows written again). Checks that both
ways give the same values but for a rare last bit.

Then, with `--decode N`: greedy chain K=3 decoding of the embedded SmolLM2-135M-Instruct (or --model) with the
shipped EAGLE-3 head (or --head) drafting from int8 weights (eval.draft_weights int8), on the first N MT-bench
first turns × --new-tokens, with every
standalone norm of the target and the head on torch's operations, only the head's on the kernel (the target's
numbers, so its outputs, unchanged), and every one on the kernel, interleaved per prompt and the order reversed
every other repeat: per way the draft and verification ms per step and tokens/s (medians of
--decode-repeats), and whether the outputs are the same.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.nn.functional as F

from _chain_ways import add_arguments, chain_setup, decode_ways, print_ways
from _warm_cold import table_row, warm_and_cold
from mtptrain.machine import describe_cpu
from mtptrain.runtime import model as runtime_model
from mtptrain.runtime.native_kernels import layer_ops


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 4, 160])
    parser.add_argument("--width", type=int, default=576, help="values per row (SmolLM2-135M's hidden size)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--flush-mb", type=int, default=320, help="memory written between cold calls")
    add_arguments(parser, "MT-bench first turns to decode each way (0: none)")
    return parser.parse_args()


def torch_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def micro(args: argparse.Namespace) -> None:
    ops = layer_ops()
    dtype = getattr(torch, args.dtype)
    flush = torch.ones(args.flush_mb * 2**20 // 4)
    ways = {"torch": torch_norm, "kernel": ops.rms_norm}
    print(f"RMSNorm of rows of {args.width} in {args.dtype} with a weight, median of {args.repeats} calls each way")
    print("| rows | torch, warm | kernel, warm | ratio | torch, cold | kernel, cold | ratio |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    weight = (1 + 0.1 * torch.randn(args.width, generator=generator)).to(dtype)
    for rows in args.rows:
        x = torch.randn(1, rows, args.width, generator=generator).to(dtype)
        mine, theirs = ops.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5)
        assert float((mine == theirs).double().mean()) >= 0.99, "the two ways differ beyond a rare last bit"
        us = warm_and_cold({name: (lambda way=way: way(x, weight, 1e-5)) for name, way in ways.items()}, x, flush,
                           args.repeats)
        print(table_row(rows, us, 1, 1))


WAYS = {"torch": (torch_norm, torch_norm), "kernel in drafting": (torch_norm, None), "kernel": (None, None)}


@contextlib.contextmanager
def norms(way: str):
    """The standalone RMSNorms of the target's decoder and of a head's drafting as WAYS[way] says (None: the
    kernel, as the code runs them)."""
    from mtptrain.heads import eagle3

    saved = runtime_model.rms_norm, eagle3.rms_norm
    target, drafting = WAYS[way]
    runtime_model.rms_norm, eagle3.rms_norm = target or saved[0], drafting or saved[1]
    try:
        yield
    finally:
        runtime_model.rms_norm, eagle3.rms_norm = saved


def decode(args: argparse.Namespace) -> None:
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.runtime.linears import fast_linears, product_for
    from mtptrain.runtime.runner import runtime_description

    _, target, head, spec, runner, prompts, stops = chain_setup(args)
    print(f"\nchain K=3, int8 drafting weights, {len(prompts)} MT-bench first turns x {args.new_tokens} tokens, "
          f"greedy, {args.decode_repeats} repeats; {runtime_description(runner)}")
    with fast_linears(head, product=product_for("auto", target.model)):
        proposers = {way: HeadChainProposer(head, spec, int8=True) for way in WAYS}
        results = decode_ways(runner, prompts, proposers, {way: functools.partial(norms, way) for way in WAYS},
                              args.decode_repeats, args.new_tokens, {"k": 3, "eos": stops})
    print_ways(results, "norms", "torch")


def main() -> None:
    args = parse_args()
    print(f"CPU: {describe_cpu()}")
    if layer_ops() is None:
        raise SystemExit("the runtime's CPU kernels did not build here: nothing to compare")
    micro(args)
    if args.decode:
        decode(args)


if __name__ == "__main__":
    main()
