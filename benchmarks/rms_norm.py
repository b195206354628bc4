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
import statistics
import time

import torch
import torch.nn.functional as F

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
    parser.add_argument("--decode", type=int, default=0, help="MT-bench first turns to decode each way (0: none)")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--head", help="a trained EAGLE-3 head directory (default: the shipped one)")
    parser.add_argument("--model", help="target.model (a model directory or hub id) instead of the embedded default")
    parser.add_argument("--target-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target.dtype of the decoding (auto: what this machine measured fastest)")
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
    from mtptrain.config import load_recipe
    from mtptrain.data.chat import prompt_ids, stop_tokens
    from mtptrain.engine.generate import GenerationStats, generate
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.engine.verify import Sampling
    from mtptrain.eval.methods import build_configs
    from mtptrain.eval.prompts import load_prompts
    from mtptrain.heads.checkpoint import PRETRAINED_HEAD
    from mtptrain.heads.eagle3 import Eagle3Head
    from mtptrain.runtime.linears import fast_linears, product_for
    from mtptrain.runtime.runner import open_runner, runtime_description, runtime_for
    from mtptrain.target import load_target

    model = [f"target.model={args.model}"] if args.model else []
    recipe = load_recipe(None, ["eval.methods=[chain]", "eval.k=[3]", f"eval.head={args.head or PRETRAINED_HEAD}",
                                f"target.dtype={args.target_dtype}", *model])
    target = load_target(recipe.target)
    _, info, _, modules = build_configs(recipe, target, Sampling())
    head, spec = modules[0], info.spec
    if not isinstance(head, Eagle3Head):  # the drafting norms it switches are Eagle3Drafting's
        raise SystemExit(f"{recipe.eval.head} is an {spec.kind} head: this benchmark drafts with EAGLE-3 heads")
    stops = stop_tokens(target.tokenizer, target.model)
    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.decode)]
    runner = open_runner(runtime_for(target.model), spec.family.draft_layers(spec))
    ways = list(WAYS)
    results = {way: {"draft": [], "verify": [], "tps": [], "outputs": []} for way in ways}
    print(f"\nchain K=3, int8 drafting weights, {len(prompts)} MT-bench first turns x {args.new_tokens} tokens, "
          f"greedy, {args.decode_repeats} repeats; {runtime_description(runner)}")
    with fast_linears(*modules, product=product_for("auto", target.model)):
        proposers = {way: HeadChainProposer(head, spec, int8=True) for way in ways}
        for way in ways:  # warm-up
            with norms(way):
                generate(runner, prompts[0][:16], 8, proposers[way], k=3, eos=stops)
        for repeat in range(args.decode_repeats):
            stats = {way: GenerationStats() for way in ways}
            seconds, tokens = dict.fromkeys(ways, 0.0), dict.fromkeys(ways, 0)
            for ids in prompts:
                for way in ways if repeat % 2 == 0 else ways[::-1]:
                    with norms(way):
                        start = time.perf_counter()
                        out = generate(runner, ids, args.new_tokens, proposers[way], k=3, eos=stops)
                        seconds[way] += time.perf_counter() - start
                    stats[way].merge(out.stats)
                    tokens[way] += len(out.tokens)
                    if repeat == 0:
                        results[way]["outputs"].append(out.tokens)
            for way, s in stats.items():
                results[way]["draft"].append(s.draft_seconds / s.steps * 1e3)
                results[way]["verify"].append(s.verify_seconds / s.steps * 1e3)
                results[way]["tps"].append(tokens[way] / seconds[way])
    print("| norms | draft / verify ms per step | tokens/s (spread) | same outputs as torch's |")
    print("|---|---|---|---|")
    for way in ways:
        r = results[way]
        same = sum(a == b for a, b in zip(r["outputs"], results["torch"]["outputs"]))
        print(f"| {way} | {statistics.median(r['draft']):.2f} / {statistics.median(r['verify']):.2f} | "
              f"{statistics.median(r['tps']):.1f} ({min(r['tps']):.1f}-{max(r['tps']):.1f}) | "
              f"{same}/{len(prompts)} |")
    for way in ways[1:]:
        ratios = [k / t for k, t in zip(results[way]["tps"], results["torch"]["tps"])]
        print(f"{way} / torch tokens/s: {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


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
