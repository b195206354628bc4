"""A row's attention kernels against each other: alone on the target's heads, and in the target's whole forward.

    python benchmarks/row_attention.py [--kernels fused,sdpa,plain] [--rounds 25] [--prefix 200]
                                       [--model DIR]

The embedded SmolLM2-135M-Instruct (or the target --model names: a model directory, GGUF or hub id) in the dtype and products the runtime
chose on this machine, with each attention kernel named run for one new token and for several (a chain's
verification after the cache), all other kernels as chosen:

  alone     one call over --prefix cached positions + w new tokens on the target's heads (a cache in the
            kernel's dtype), w = 1 and 4, µs a call: the median over the rounds of 20 calls each;
  forward   the runtime's whole forward over w new tokens after a --prefix-token prompt, w = 1, 2, 4, 8,
            median ms over --rounds interleaved rounds, one decoder per kernel on the same weights.

Every kernel in a round runs before the next round starts, so a drift of the machine reaches them alike. The
table gives each kernel's times and their ratio to the first kernel named (the runtime's choice on this
machine is printed above it), and each forward's cost relative to one token: what a verification of w tokens
costs against a decoding step, the number a chain's speedup is divided by.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtptrain.config import load_recipe
from mtptrain.machine import cpu_line, cpu_sample, describe_cpu, other_load
from mtptrain.runtime.attention import causal_mask, row_attention
from mtptrain.runtime.runner import decoder_choice, load_decoder, open_runner
from mtptrain.target import load_target

WIDTHS = (1, 2, 4, 8)
ALONE_WIDTHS = (1, 4)
CALLS = 20  # a round's calls of each kernel alone


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="fused,sdpa,plain",
                        help="attention kernels for a row's tokens (runtime/attention.py: sdpa, plain, fused, "
                             "and sdpa-f32 / plain-f32 below float32); the first is the ratios' base")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--prefix", type=int, default=200, help="cached positions before the new tokens")
    parser.add_argument("--model", help="target.model (default: the embedded target)")
    return parser.parse_args()


def alone(kernel: str, heads: tuple[int, int, int], dtype: torch.dtype, prefix: int, width: int):
    """A call of `kernel` as the decoder makes it: width new tokens, causal after the cache."""
    generator = torch.Generator().manual_seed(0)
    query_heads, kv_heads, dim = heads
    attention = row_attention(kernel)
    cache = torch.float32 if kernel.endswith("-f32") else dtype
    length = prefix + width
    q = torch.randn(1, width, query_heads, dim, generator=generator).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=generator).to(cache) for _ in range(2))
    mask, causal = None, False
    if width > 1 and getattr(attention, "causal_after_cache", False):
        causal = True
    elif width > 1:
        mask = causal_mask(width, prefix)[None, None]
    return lambda: attention(q, k, v, mask, causal)


def timed(call, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    args = parse_args()
    kernels = args.kernels.split(",")
    recipe = load_recipe(None, [f"target.model={args.model}"] if args.model else [])
    target = load_target(recipe.target)
    model = target.model
    chosen = decoder_choice(model)
    config = model.config
    heads = (config.num_attention_heads, config.num_key_value_heads,
             getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    print(cpu_line(describe_cpu()) + f"; {torch.get_num_threads()} threads")
    print(f"target {config.name_or_path or type(model).__name__}: {chosen.describe()}")

    calls = {(k, w): alone(k, heads, chosen.dtype, args.prefix, w) for k in kernels for w in ALONE_WIDTHS}
    runners = {}
    for kernel in kernels:
        record = {**chosen.record(), "attention_one": kernel, "attention_many": kernel}
        runners[kernel] = open_runner(load_decoder(model, record=record))
    vocab = config.vocab_size
    prompt = [t % vocab for t in range(1000, 1000 + args.prefix)]
    for runner in runners.values():
        runner.reset()
        runner.forward(prompt, last_only=True)

    alone_us = {key: [] for key in calls}
    forward_ms = {(k, w): [] for k in kernels for w in WIDTHS}
    started, sample = time.perf_counter(), cpu_sample()
    with torch.inference_mode():
        for key, call in calls.items():  # first calls: allocations, the kernels' first use
            call()
        for _ in range(args.rounds):
            for key, call in calls.items():
                alone_us[key].append(1e6 * timed(call, CALLS))
            for width in WIDTHS:
                for kernel, runner in runners.items():
                    runner.rollback(len(prompt))
                    forward_ms[kernel, width].append(
                        1000 * timed(lambda: runner.forward([t % vocab for t in range(2000, 2000 + width)]), 1))
    load = other_load(sample, cpu_sample())
    print(f"{time.perf_counter() - started:.0f} s measured; other processes used {load:.2f} CPU cores on average")

    base = kernels[0]
    med = {key: statistics.median(values) for key, values in alone_us.items()}
    print(f"\nalone: {heads[0]} query heads, {heads[1]} kv heads, dim {heads[2]}, {args.prefix} cached positions; "
          f"median µs a call (ratio to {base})")
    print(f"{'kernel':<12}" + "".join(f"{'w=' + str(w):>20}" for w in ALONE_WIDTHS))
    for kernel in kernels:
        print(f"{kernel:<12}" + "".join(f"{med[kernel, w]:>11.1f} ({med[kernel, w] / med[base, w]:.2f}x)"
                                        for w in ALONE_WIDTHS))
    fwd = {key: statistics.median(values) for key, values in forward_ms.items()}
    print(f"\nforward over w new tokens after {args.prefix}: median ms of {args.rounds} (relative to w=1; "
          f"ratio to {base})")
    print(f"{'kernel':<12}" + "".join(f"{'w=' + str(w):>26}" for w in WIDTHS))
    for kernel in kernels:
        print(f"{kernel:<12}" + "".join(
            f"{fwd[kernel, w]:>8.2f} ({fwd[kernel, w] / fwd[kernel, 1]:.2f}) {fwd[kernel, w] / fwd[base, w]:.2f}x"
            .rjust(26) for w in WIDTHS))


if __name__ == "__main__":
    main()
