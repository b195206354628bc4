"""Decoding speed of the target's runtime against transformers and llama.cpp, on the same prompts, in one run.

    python benchmarks/engine_speed.py [--prompts 8] [--new-tokens 128] [--k 3] [--repeats 3]
                                      [--dtype auto] [--head pretrained/smollm2-135m-instruct-eagle3]
                                      [--methods ngram,suffix,chain,tree] [--ngram 2-3] [--no-peers]
                                      [--model DIR] [--forward-rounds 25]

Greedy decoding of the embedded SmolLM2-135M-Instruct (or the target --model names), batch 1:
  runtime AR        mtptrain's runtime (mtptrain/runtime/), no drafting: the baseline of every ratio
  transformers AR   the same engine loop on transformers' forward (target.runtime=transformers)
  hf-generate       transformers' model.generate(do_sample=False)
  llama.cpp         llama-cpp-python's greedy decoding of the same GGUF (quantised weights; install with
                    `pip install -e .[bench]`; not compared for exactness; not with --model)
  ngram / suffix    the runtime with n-gram prompt lookup / the suffix index over past outputs, K = --k;
                    --ngram lists the n-gram lengths matched (min-max, e.g. 1-3,2-3: one method per range)
  hf-prompt-lookup  transformers' generate(prompt_lookup_num_tokens=K)
  chain / tree      the runtime with the trained head (--head), chain K and a tree of --tree-budget nodes
--k takes a list (1,2,3: each chain method at each K); --methods picks eval's methods; --no-peers leaves out
transformers AR, hf-generate, llama.cpp and hf-prompt-lookup (a shorter run comparing the runtime's methods).
The engine's methods are eval's own configurations (mtptrain.eval.methods.build_configs).

Every method runs on every prompt before the next prompt starts, in an order reversed every other repeat;
each is warmed up first. A ratio is tokens/s against the runtime's AR in the same repeat; the table shows the
median over the repeats and their spread. "same" counts outputs identical to the runtime's AR; where one
differs, the first differing position and the target's top-2 logit gap there are printed (a gap within the
dtype's rounding is a near-tie, anything else a bug).

Then: the machine's copy bandwidth and the roofline (weight bytes / bandwidth, the fastest a step can stream
the weights once), the runtime AR's share of it; the read bandwidth (a sum over 256 MiB: a step only reads its
weights) and the AR's share of that; and the cost of one forward over 1, 2, 4, 8, 16 new tokens after a
200-token prefix relative to one token, on both forwards, the median of --forward-rounds interleaved rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from mtptrain.config import Recipe, load_recipe
from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.verify import Sampling
from mtptrain.eval.exactness import logit_scale_and_gap
from mtptrain.eval.methods import build_configs
from mtptrain.eval.prompts import load_prompts
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.machine import cpu_line, describe_cpu, memory_bandwidth
from mtptrain.runtime.linears import fast_linears, product_for
from mtptrain.runtime.runner import open_runner, runtime_description, runtime_for
from mtptrain.target import embedded_gguf_path, load_target

WIDTHS = (1, 2, 4, 8, 16)


class Method:
    """One measured method: its run function and, per repeat, tokens and seconds summed over the prompts."""

    def __init__(self, name, run, compare=True):
        self.name, self.run, self.compare = name, run, compare
        self.tokens: list[int] = []
        self.seconds: list[float] = []
        self.emitted = self.steps = 0
        self.outputs: list[list[int]] = []  # first repeat's, per prompt

    def tps(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]


def engine(runner, make=None, k=1):
    """The engine's generation with a proposer made afresh for each repeat (`run.renew()`), so that a suffix
    index does not draft a repeated prompt from its own earlier answer."""
    proposer = [make() if make else None]

    def run(ids, n, stops):
        result = generate(runner, ids, n, proposer[0], k=k, eos=stops)
        return result.tokens, result.stats
    run.renew = lambda: proposer.__setitem__(0, make() if make else None)
    return run


def hf(model, **kwargs):
    def run(ids, n, stops):
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0], **kwargs)[0, len(ids):]
        return out.tolist(), None
    return run


def llama_cpp(threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)

    def run(ids, n, stops):
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in stops or len(out) >= n:
                break
        return out, None
    return run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", default="3", help="draft length(s) of the chain methods, e.g. 3 or 1,2,3")
    parser.add_argument("--methods", default="ngram,suffix,chain,tree", help="eval's methods to measure")
    parser.add_argument("--no-peers", action="store_true",
                        help="only the runtime's methods (no transformers, hf-generate or llama.cpp)")
    parser.add_argument("--ngram", default=None,
                        help="n-gram lengths matched, min-max, comma-separated ranges each measured as its own "
                             "method (default: eval.ngram's, 2-3)")
    parser.add_argument("--tree-budget", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target.dtype (auto: what this machine measured fastest)")
    parser.add_argument("--head", default=str(PRETRAINED_HEAD), help="trained head for chain/tree")
    parser.add_argument("--model", help="target.model (a model directory, GGUF or hub id) instead of the embedded "
                        "default; llama.cpp, which reads the embedded GGUF, is then not measured")
    parser.add_argument("--forward-rounds", type=int, default=25, help="rounds of the forward costs' timings")
    return parser.parse_args()


def eval_recipe(args) -> Recipe:
    """The default recipe with eval's methods, K, tree budget, head and the target's dtype set."""
    methods = args.methods.split(",")
    if not (Path(args.head) / "config.json").is_file():
        print(f"(no head at {args.head}: chain and tree are not measured)")
        methods = [m for m in methods if m not in ("chain", "tree")]
    return load_recipe(None, [f"eval.methods=[{','.join(methods)}]", f"eval.k=[{args.k}]", f"eval.head={args.head}",
                              f"eval.tree.budgets=[{args.tree_budget}]", f"target.dtype={args.dtype}",
                              *([f"target.model={args.model}"] if args.model else [])])


def build_methods(args, recipe: Recipe, target) -> tuple[list[Method], list, bool]:
    """Every method in table order; the drafting modules (the head); whether llama.cpp is installed."""
    configs, head_info, notes, modules = build_configs(recipe, target, Sampling())
    for note in notes:
        print(f"({note})")
    model = target.model
    reference = model  # transformers' methods run the model's own weights; the runtime reads its own from them
    capture = head_info.spec.family.draft_layers(head_info.spec) if head_info is not None else []
    source = runtime_for(model)  # one decoder for both runners
    plain, reading = open_runner(source), open_runner(source, capture)
    methods = [Method("runtime AR", engine(plain))]
    if not args.no_peers:
        methods += [Method("transformers AR", engine(open_runner(reference, runtime="transformers"))),
                    Method("hf-generate", hf(reference))]
    cpp = None if args.no_peers or args.model else llama_cpp(torch.get_num_threads())
    if cpp is not None:
        methods.append(Method("llama.cpp", cpp, compare=False))
    for c in configs[1:]:
        if c.method == "ngram" and args.ngram:
            for low, high in ngram_ranges(args.ngram):
                make = partial(NgramProposer, low, high)
                methods.append(Method(f"{c.label} n={low}-{high}", engine(plain, make, c.k)))
        else:
            methods.append(Method(c.label, engine(reading if c.uses_head else plain, c.make, c.k or 1)))
        if c.method == "ngram" and not args.no_peers:
            methods.append(Method(f"hf-prompt-lookup K={c.k}", hf(reference, prompt_lookup_num_tokens=c.k)))
    return methods, modules, cpp is not None, reference


def ngram_ranges(text: str) -> list[tuple[int, int]]:
    """'1-3,2-3' -> [(1, 3), (2, 3)], each checked by NgramProposer itself."""
    try:
        ranges = [(int(part.partition("-")[0]), int(part.partition("-")[2])) for part in text.split(",")]
        for low, high in ranges:
            NgramProposer(low, high)
    except ValueError as error:
        raise SystemExit(f"--ngram {text}: each range is min-max, e.g. 1-3,2-3 ({error})") from None
    return ranges


def measure(methods, prompts, args, modules, product, stops) -> None:
    """Every method on every prompt, interleaved, --repeats times; outputs of the first repeat kept."""
    warm = prompts[0][:16]
    with fast_linears(*modules, product=product):  # the head's own layers, as eval runs them
        for m in methods:
            m.run(warm, 8, stops)
        for repeat in range(args.repeats):
            order = methods if repeat % 2 == 0 else methods[::-1]
            for m in methods:
                m.tokens.append(0), m.seconds.append(0.0)
                if hasattr(m.run, "renew"):
                    m.run.renew()
            for ids in prompts:
                for m in order:
                    start = time.perf_counter()
                    out, stats = m.run(ids, args.new_tokens, stops)
                    m.seconds[-1] += time.perf_counter() - start
                    m.tokens[-1] += len(out)
                    if repeat == 0:
                        m.outputs.append(out)
                        if stats is not None:
                            m.emitted += stats.emitted
                            m.steps += stats.steps
            print(f"  repeat {repeat + 1}/{args.repeats} done", flush=True)


def print_table(methods, prompts, plain) -> None:
    base = methods[0]
    print(f"\n{'method':<22}{'tokens':>7}{'tok/s':>8}{'vs runtime AR':>15}{'spread':>8}{'tau':>6}  same")
    for m in methods:
        ratios = [a / b for a, b in zip(m.tps(), base.tps())]
        ratio = statistics.median(ratios)
        spread = (max(ratios) - min(ratios)) / ratio
        tau = f"{m.emitted / m.steps:.2f}" if m.steps else "-"
        same = f"{sum(a == b for a, b in zip(m.outputs, base.outputs))}/{len(prompts)}" if m.compare else "(quantised)"
        print(f"{m.name:<22}{m.tokens[0]:>7}{statistics.median(m.tps()):>8.1f}{ratio:>14.2f}x{spread:>7.0%}{tau:>6}  "
              f"{same}")
    for m in methods[1:]:
        if not m.compare:
            continue
        for ids, ours, theirs in zip(prompts, m.outputs, base.outputs):
            if ours != theirs:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                print(f"  {m.name}: differs from runtime AR at token {at}, top-2 gap there "
                      f"{logit_scale_and_gap(plain, ids + theirs[:at])[1]:.4f}")


def synchronizer(device: torch.device):
    """What waits for the device's queued work before a clock is read (nothing on a CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def forward_costs(model, reference, repeats: int) -> dict[str, list[float]]:
    """Median ms of one forward over w new tokens after a 200-token prefix, per width, on both forwards
    (interleaved; 25 rounds by default: a VM's step times drift by 10-20% from round to round)."""
    vocab = reference.config.vocab_size  # ids past a small vocabulary wrap around
    prefix = [t % vocab for t in range(1000, 1200)]
    runners = {"runtime": open_runner(model), "transformers": open_runner(reference, runtime="transformers")}
    times = {name: {w: [] for w in WIDTHS} for name in runners}
    sync = synchronizer(runners["runtime"].device)
    for runner in runners.values():
        runner.reset()
        runner.forward(prefix, last_only=True)
    for _ in range(repeats):
        for w in WIDTHS:
            for name, runner in runners.items():
                runner.rollback(len(prefix))
                sync()
                start = time.perf_counter()
                runner.forward([t % vocab for t in range(2000, 2000 + w)])
                sync()
                times[name][w].append(time.perf_counter() - start)
    return {name: [1000 * statistics.median(per[w]) for w in WIDTHS] for name, per in times.items()}


def print_machine(reference, runner, methods, forward_rounds: int) -> None:
    cpu = describe_cpu()
    model = reference  # the same weights in their plain form (the runtime's are packed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device = next(model.parameters()).device
    gbs, read_gbs = memory_bandwidth(device)
    roofline_ms = weight_bytes / gbs / 1e6
    read_ms = weight_bytes / read_gbs / 1e6
    step_ms = 1000 / statistics.median(methods[0].tps())
    print("\n" + cpu_line(cpu) + f"; {torch.get_num_threads()} threads")
    if device.type == "cuda":
        print(f"GPU {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda}); "
              "bandwidth and roofline below are the GPU's memory")
    print(f"target: {runtime_description(runner)}")
    print(f"{device.type} copy bandwidth {gbs:.1f} GB/s (read + write); weights {weight_bytes / 1e6:.0f} MB "
          f"({str(next(model.parameters()).dtype).removeprefix('torch.')}): roofline {roofline_ms:.1f} ms/token; "
          f"runtime AR {step_ms:.1f} ms/token = {roofline_ms / step_ms:.0%} of the roofline")
    print(f"{device.type} read bandwidth {read_gbs:.1f} GB/s (a sum): weights stream in {read_ms:.1f} ms at best; "
          f"runtime AR = {read_ms / step_ms:.0%} of that")
    costs = forward_costs(runner.decoder, reference, forward_rounds)
    print("\nforward over w new tokens after 200, ms (relative to w=1):")
    print(f"{'':<14}" + "".join(f"{'w=' + str(w):>14}" for w in WIDTHS))
    for name, ms in costs.items():
        print(f"{name:<14}" + "".join(f"{t:>8.1f} ({t / ms[0]:.2f})" for t in ms))


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    recipe = eval_recipe(args)
    target = load_target(recipe.target)
    tok = target.tokenizer
    methods, modules, has_cpp, reference = build_methods(args, recipe, target)
    stops = stop_tokens(tok, target.model)
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    plain = open_runner(target.model)
    name = target.name if args.model else "SmolLM2-135M-Instruct"
    print(f"{name}, {len(prompts)} MT-bench prompts x up to {args.new_tokens} new tokens, greedy, "
          f"batch 1, {args.repeats} repeats; {runtime_description(plain)}")
    measure(methods, prompts, args, modules, product_for("auto", target.model), stops)
    print_table(methods, prompts, plain)
    if args.model and not args.no_peers:
        print("llama.cpp: reads the embedded GGUF, not measured with --model")
    elif not has_cpp and not args.no_peers:
        print("llama.cpp: not installed (pip install -e .[bench]), not measured")
    print_machine(reference, plain, methods, args.forward_rounds)


if __name__ == "__main__":
    main()
