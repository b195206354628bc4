"""Decoding speed of the engine against transformers and llama.cpp, on the same prompts, in one run.

    python benchmarks/engine_speed.py [--prompts 8] [--new-tokens 128] [--k 4] [--head runs/quickstart/train/head]

Autoregressive greedy decoding of the embedded SmolLM2-135M-Instruct:
  engine        this engine with no proposer (the eval baseline), linear layers as eval runs them on CPU
                (W @ x.T for short inputs, mtptrain/engine/cpu_matmul.py)
  engine-stock  the same with torch's stock linear layers
  hf-generate   transformers' model.generate(do_sample=False), stock layers
  llama.cpp     llama-cpp-python's greedy decoding of the same GGUF (quantised weights; install with
                `pip install -e .[bench]`, it compiles in about 5 minutes)
Speculative decoding, same prompts, temperature 0:
  ngram / suffix          this engine's n-gram prompt lookup and suffix index over past outputs
  ngram-stock             n-gram lookup with stock linear layers (what the swap buys verification)
  hf-prompt-lookup        transformers' generate(prompt_lookup_num_tokens=K), stock layers
  chain / tree            this engine with a trained head, when --head exists
ngram, suffix, chain and tree are eval's own configurations: mtptrain.eval.run.build_configs builds them from the
default recipe with eval.k=[--k], eval.tree.budgets=[--tree-budget] and eval.head=--head.

Every method runs on every prompt before the next prompt starts (interleaved), so a machine that speeds
up or slows down during the run affects all of them alike; every method is warmed up once first.
Ratios are tokens/s against the engine's own autoregressive baseline measured in this run. "same" counts
outputs identical to that baseline (llama.cpp runs quantised weights: its text differs and is not compared).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from mtptrain.config import Recipe, load_recipe
from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.engine.cpu_matmul import skinny_linears
from mtptrain.engine.generate import generate
from mtptrain.engine.runner import TargetRunner
from mtptrain.engine.verify import Sampling
from mtptrain.eval.prompts import load_prompts
from mtptrain.eval.run import Config, build_configs
from mtptrain.target import embedded_gguf_path, load_target


class Method:
    """One measured method and its totals over the prompts."""

    def __init__(self, name, run, compare=True, skinny=True):
        self.name, self.run, self.compare, self.skinny = name, run, compare, skinny
        self.tokens = self.emitted = self.steps = self.same = self.count = 0
        self.seconds = 0.0

    def add(self, out, stats, seconds, same):
        """One prompt's generation: its tokens, the engine's stats (None for the others), its time."""
        self.seconds += seconds
        self.tokens += len(out)
        if stats is not None:  # the engine's methods: tau = tokens per verification forward
            self.emitted += stats.emitted
            self.steps += stats.steps
        self.count += 1
        self.same += same


def engine(runner, proposer_factory=None, k=1):
    state = {"proposer": proposer_factory() if proposer_factory else None}

    def run(ids, n, stops):
        result = generate(runner, ids, n, state["proposer"], k=k, eos=stops)
        return result.tokens, result.stats
    return run


def hf(model, **kwargs):
    def run(ids, n, stops):
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(stops),
                             pad_token_id=sorted(stops)[0], **kwargs)[0, len(ids):].tolist()
        return out, None
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
    parser.add_argument("--k", type=int, default=4, help="draft length of the chain methods")
    parser.add_argument("--tree-budget", type=int, default=16)
    parser.add_argument("--head", default="runs/quickstart/train/head", help="trained head for chain/tree")
    return parser.parse_args()


def eval_recipe(args) -> Recipe:
    """The default recipe with eval's methods, K, tree budget and head set to this benchmark's."""
    methods = "ngram,suffix,chain,tree"
    if not (Path(args.head) / "config.json").is_file():
        print(f"(no head at {args.head}: chain and tree are not measured; run `make quickstart` first)")
        methods = "ngram,suffix"
    return load_recipe(None, [f"eval.methods=[{methods}]", f"eval.k=[{args.k}]", f"eval.head={args.head}",
                              f"eval.tree.budgets=[{args.tree_budget}]"])


def eval_configs(recipe: Recipe, target) -> tuple[dict[str, Config], tuple[TargetRunner, TargetRunner], list]:
    """eval's baseline and methods as eval builds them, by method; the plain runner and the one a head method
    reads the target's states from (as eval runs them); the drafting modules besides the target (the head)."""
    configs, head_info, notes, modules = build_configs(recipe, target, Sampling())
    for note in notes:
        print(f"({note})")
    capture = head_info.spec.layers if head_info is not None else []
    runners = TargetRunner(target.model), TargetRunner(target.model, capture=capture)
    return {c.method: c for c in configs}, runners, modules


def engine_method(name: str, config: Config, runners, skinny: bool = True) -> Method:
    """This engine running one of eval's configurations, with one proposer for the whole run."""
    plain, reading = runners
    runner = reading if config.uses_head else plain
    return Method(name, engine(runner, config.make, config.k or 1), skinny=skinny)


def build_methods(args, recipe: Recipe, target) -> tuple[list[Method], list, bool]:
    """Every method in table order; the drafting modules; whether llama.cpp is installed."""
    configs, runners, modules = eval_configs(recipe, target)
    model, k = target.model, args.k
    methods = [engine_method("engine", configs["baseline"], runners),
               engine_method("engine-stock", configs["baseline"], runners, skinny=False),
               Method("hf-generate", hf(model), skinny=False)]
    cpp = llama_cpp(torch.get_num_threads())
    if cpp is not None:
        methods.append(Method("llama.cpp", cpp, compare=False, skinny=False))
    methods += [engine_method(configs["ngram"].label, configs["ngram"], runners),
                engine_method(f"ngram-stock K={k}", configs["ngram"], runners, skinny=False),
                engine_method(configs["suffix"].label, configs["suffix"], runners),
                Method(f"hf-prompt-lookup K={k}", hf(model, prompt_lookup_num_tokens=k), skinny=False)]
    methods += [engine_method(c.label, c, runners) for c in configs.values() if c.uses_head]  # chain, tree
    return methods, modules, cpp is not None


def timed(m: Method, ids, n, linears, stops):
    """One generation by m, with the linear layers of `linears` swapped as m runs them: (tokens, stats, s)."""
    with skinny_linears(*linears, enabled=m.skinny):
        start = time.perf_counter()
        out, stats = m.run(ids, n, stops)
        return out, stats, time.perf_counter() - start


def warm_up(methods, tokenizer, linears, stops) -> None:
    """Every method once on a short prompt, untimed."""
    warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hello!"}])
    for m in methods:
        timed(m, warm, 8, linears, stops)


def measure(methods, prompts, new_tokens, linears, stops) -> None:
    """Every method on every prompt before the next prompt starts (interleaved); outputs compared to the first's."""
    for index, ids in enumerate(prompts):
        reference = None
        for m in methods:
            out, stats, seconds = timed(m, ids, new_tokens, linears, stops)
            if reference is None:
                reference = out
            m.add(out, stats, seconds, out == reference)
        print(f"  prompt {index + 1}/{len(prompts)} done", flush=True)


def print_table(methods, has_cpp: bool) -> None:
    base = methods[0].tokens / methods[0].seconds
    print(f"\n{'method':<24}{'tokens':>8}{'tok/s':>9}{'vs engine':>11}{'tau':>7}  same as engine")
    for m in methods:
        tps = m.tokens / m.seconds
        tau = f"{m.emitted / m.steps:.2f}" if m.steps else "-"
        same = f"{m.same}/{m.count}" if m.compare else "(quantised)"
        print(f"{m.name:<24}{m.tokens:>8}{tps:>9.1f}{tps / base:>10.2f}x{tau:>7}  {same}")
    if not has_cpp:
        print("llama.cpp: not installed (pip install -e .[bench]), not measured")


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    recipe = eval_recipe(args)
    target = load_target(recipe.target)
    model, tok = target.model, target.tokenizer
    methods, modules, has_cpp = build_methods(args, recipe, target)
    stops, linears = stop_tokens(tok, model), (model, *modules)
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    warm_up(methods, tok, linears, stops)
    print(f"SmolLM2-135M-Instruct, {len(prompts)} MT-bench prompts x up to {args.new_tokens} new tokens, greedy, "
          f"batch 1, {torch.get_num_threads()} threads ({target.device}, {next(model.parameters()).dtype})")
    measure(methods, prompts, args.new_tokens, linears, stops)
    print_table(methods, has_cpp)


if __name__ == "__main__":
    main()
