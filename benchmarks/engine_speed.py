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

from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.eval.prompts import load_prompts
from mtptrain.config import TargetConfig
from mtptrain.engine.cpu_matmul import skinny_linears
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.runner import TargetRunner
from mtptrain.engine.suffix_index import SuffixIndexProposer
from mtptrain.target import embedded_gguf_path, load_target


class Method:
    def __init__(self, name, run, compare=True, skinny=True):
        self.name, self.run, self.compare, self.skinny = name, run, compare, skinny
        self.tokens = self.emitted = self.steps = self.same = self.count = 0
        self.seconds = 0.0


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="draft length of the chain methods")
    parser.add_argument("--tree-budget", type=int, default=16)
    parser.add_argument("--head", default="runs/quickstart/train/head", help="trained head for chain/tree")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    target = load_target(TargetConfig())
    model, tok = target.model, target.tokenizer
    stops = stop_tokens(tok, model)
    threads = torch.get_num_threads()
    plain = TargetRunner(model)
    methods = [Method("engine", engine(plain)), Method("engine-stock", engine(plain), skinny=False),
               Method("hf-generate", hf(model), skinny=False)]
    cpp = llama_cpp(threads)
    if cpp is not None:
        methods.append(Method("llama.cpp", cpp, compare=False, skinny=False))
    methods += [Method(f"ngram K={args.k}", engine(plain, lambda: NgramProposer(1, 3), args.k)),
                Method(f"ngram-stock K={args.k}", engine(plain, lambda: NgramProposer(1, 3), args.k), skinny=False),
                Method(f"suffix K={args.k}", engine(plain, SuffixIndexProposer, args.k)),
                Method(f"hf-prompt-lookup K={args.k}", hf(model, prompt_lookup_num_tokens=args.k), skinny=False)]
    head_dir, extra = Path(args.head), []  # extra: the head's own layers, swapped like the target's
    if (head_dir / "config.json").is_file():
        from mtptrain.heads import FrozenTarget
        from mtptrain.export.source import load_head_directory

        head, spec = load_head_directory(head_dir, FrozenTarget.of(model), target.identity())
        reading, family = TargetRunner(model, capture=spec.layers), spec.family
        methods.append(Method(f"chain K={args.k}", engine(reading, lambda: family.chain(head, spec), args.k)))
        if family.no_tree is None:
            methods.append(Method(f"tree N={args.tree_budget}", engine(
                reading, lambda: family.tree(head, spec, 4, 5, args.tree_budget), 5)))
        extra = [head]
    else:
        print(f"(no head at {head_dir}: chain and tree are not measured; run `make quickstart` first)")

    prompts = [prompt_ids(tok, [{"role": "user", "content": p.turns[0]}]) for p in load_prompts("mtbench", args.prompts)]
    warm = prompt_ids(tok, [{"role": "user", "content": "Hello!"}])
    def timed(m, ids, n):
        with skinny_linears(model, *extra, enabled=m.skinny):
            start = time.perf_counter()
            out, stats = m.run(ids, n, stops)
            return out, stats, time.perf_counter() - start

    for m in methods:
        timed(m, warm, 8)
    print(f"SmolLM2-135M-Instruct, {len(prompts)} MT-bench prompts x up to {args.new_tokens} new tokens, greedy, "
          f"batch 1, {threads} threads ({target.device}, {next(model.parameters()).dtype})")
    for index, ids in enumerate(prompts):
        reference = None
        for m in methods:
            out, stats, seconds = timed(m, ids, args.new_tokens)
            m.seconds += seconds
            m.tokens += len(out)
            if stats is not None:  # the engine's methods: tau = tokens per verification forward
                m.emitted += stats.emitted
                m.steps += stats.steps
            m.count += 1
            if reference is None:
                reference = out
            m.same += out == reference
        print(f"  prompt {index + 1}/{len(prompts)} done", flush=True)

    base = methods[0].tokens / methods[0].seconds
    print(f"\n{'method':<24}{'tokens':>8}{'tok/s':>9}{'vs engine':>11}{'tau':>7}  same as engine")
    for m in methods:
        tps = m.tokens / m.seconds
        tau = f"{m.emitted / m.steps:.2f}" if m.steps else "-"
        same = f"{m.same}/{m.count}" if m.compare else "(quantised)"
        print(f"{m.name:<24}{m.tokens:>8}{tps:>9.1f}{tps / base:>10.2f}x{tau:>7}  {same}")
    if cpp is None:
        print("llama.cpp: not installed (pip install -e .[bench]), not measured")


if __name__ == "__main__":
    main()
