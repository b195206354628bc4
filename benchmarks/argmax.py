"""The greedy choice over a verification's logits: torch's argmax over a float32 copy (what `greedy_choice`
did before) against the runtime's kernel (csrc/layer_ops.cpp, argmax_rows), in one run.

    python benchmarks/argmax.py [--vocab 49152] [--rows 1 4 11] [--repeats 200] [--dtype bfloat16]

For each row count (a token decoded alone, a K=3 chain's verification, a 10-node tree's), the median µs of
`--repeats` calls each way, interleaved: warm (the logits just used) and cold (after 320 MB of other memory
was written, as after a target forward, then the logits written again, as the LM head writes them). Checks
that both ways choose the same tokens.
"""

from __future__ import annotations

import argparse

import torch

from _warm_cold import table_row, warm_and_cold
from mtptrain.engine.verify import greedy_choice
from mtptrain.machine import describe_cpu
from mtptrain.runtime.native_kernels import argmax_kernel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="logits per row (SmolLM2's vocabulary)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 11])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--flush-mb", type=int, default=320, help="memory written between cold calls")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"argmax over {args.vocab} logits in {args.dtype}, median of {args.repeats} calls each way; "
          f"CPU: {describe_cpu()}")
    if argmax_kernel() is None:
        print("this machine has no argmax kernel (it needs AVX-512): greedy_choice is torch's argmax here")
    flush = torch.ones(args.flush_mb * 2**20 // 4)
    ways = {"torch": lambda x: x.float().argmax(-1).tolist(), "kernel": greedy_choice}
    print("| rows | torch, warm | kernel, warm | ratio | torch, cold | kernel, cold | ratio |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        x = torch.randn(rows, args.vocab, generator=generator).to(dtype)
        assert ways["torch"](x) == ways["kernel"](x), "the two ways chose different tokens"
        us = warm_and_cold({name: (lambda way=way: way(x)) for name, way in ways.items()}, x, flush, args.repeats)
        print(table_row(rows, us, 0, 2))

if __name__ == "__main__":
    main()
