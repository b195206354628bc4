"""What an EAGLE-3 head's drafting costs around its layer: the fused operations the stepper runs
(`Eagle3Drafting`, mtptrain/heads/eagle3.py) against the head's own modules, in one run.

    python benchmarks/head_drafting.py [--prompts 20] [--new-tokens 64] [--k 3] [--repeats 3]
                                       [--head pretrained/smollm2-135m-instruct-eagle3] [--model DIR]
                                       [--dtype auto] [--rounds 200]

Greedy chain-K decoding of the embedded SmolLM2-135M-Instruct (or the target --model names) with the trained head, batch 1, on the first
--prompts MT-bench first turns, three ways on one runtime decoder: the runtime's own decoding (the baseline),
the chain with the head's modules around its layer (its RMSNorm modules, fc norms and fc, as eval drafted
before), and the chain with the fused operations. Every way runs every prompt before the next prompt starts,
in an order reversed every other repeat, after a warm-up. Prints per way: draft and verification ms per step
(summed over the prompts, the median repeat), tokens/s and the speedup against the baseline of the same repeat
(median, spread), tau and how many outputs equal the baseline's. Then the drafting steps alone, each right after
a target forward of K+1 tokens (as in decoding, where the forward has streamed the target's weights through the
caches) and back to back: the median of --rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtptrain.config import load_recipe
from mtptrain.data.chat import prompt_ids, stop_tokens
from mtptrain.engine.generate import generate
from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.eval.methods import build_configs
from mtptrain.eval.prompts import load_prompts
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.heads.fast import Drafting, HeadStepper
from mtptrain.heads.common import head_layer_config
from mtptrain.heads.eagle3 import Eagle3Head
from mtptrain.engine.verify import Sampling
from mtptrain.machine import describe_cpu
from mtptrain.runtime.linears import fast_linears, product_for
from mtptrain.runtime.runner import open_runner, runtime_description, runtime_for
from mtptrain.target import load_target


def module_stepper(head, spec) -> HeadStepper:
    """The head's stepper with its own modules around the layer: what drafting ran before the fused operations."""
    modules = Drafting(lambda feature, ids: (head.attention_input(feature, ids), feature),
                       lambda hidden: head.draft_input(hidden, spec), head.carry if head.norm_output else None)
    return HeadStepper(head.layer, head.rotary, head_layer_config(head.frozen.config), lambda stepper: modules,
                       lm_head=head.lm_head, logits_input=None if head.norm_output else head.norm)


class Way:
    def __init__(self, name: str, make):
        self.name, self.make = name, make
        self.tokens: list[int] = []
        self.seconds: list[float] = []
        self.draft: list[float] = []
        self.verify: list[float] = []
        self.steps: list[int] = []
        self.emitted = self.total_steps = 0
        self.outputs: list[list[int]] = []


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20, help="MT-bench first turns")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of the drafting-step timings")
    parser.add_argument("--head", default=str(PRETRAINED_HEAD), help="a trained EAGLE-3 head directory")
    parser.add_argument("--model", help="target.model (a model directory or hub id) instead of the embedded default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target.dtype (auto: what this machine measured fastest)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    recipe = load_recipe(None, ["eval.methods=[chain]", f"eval.k=[{args.k}]", f"eval.head={args.head}",
                                f"target.dtype={args.dtype}", *([f"target.model={args.model}"] if args.model else [])])
    target = load_target(recipe.target)
    _, info, _, modules = build_configs(recipe, target, Sampling())
    head, spec = modules[0], info.spec
    if not isinstance(head, Eagle3Head):  # the fused operations it compares are Eagle3Head's (Eagle3Drafting)
        raise SystemExit(f"{args.head} is an {spec.kind} head: this benchmark measures EAGLE-3 heads' drafting")
    tok = target.tokenizer
    stops = stop_tokens(tok, target.model)
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.turns[0]}])
               for p in load_prompts("mtbench", args.prompts)]
    source = runtime_for(target.model)
    plain, reading = open_runner(source), open_runner(source, spec.family.draft_layers(spec))

    def modules_proposer():
        proposer = HeadChainProposer(head, spec)
        proposer.stepper = module_stepper(head, spec)
        return proposer

    ways = [Way("runtime AR", None), Way(f"chain K={args.k}, head's modules", modules_proposer),
            Way(f"chain K={args.k}, fused", lambda: HeadChainProposer(head, spec)),
            Way(f"chain K={args.k}, fused, int8 weights", lambda: HeadChainProposer(head, spec, int8=True))]
    name = target.name if args.model else "SmolLM2-135M-Instruct"
    print(f"{name}, head {args.head}, {len(prompts)} MT-bench first turns x up to "
          f"{args.new_tokens} tokens, greedy, batch 1, {args.repeats} repeats; {runtime_description(plain)}")
    print(f"CPU: {describe_cpu()}")
    with fast_linears(*modules, product=product_for("auto", target.model)):  # as eval runs the head
        for way in ways:
            generate(reading if way.make else plain, prompts[0][:16], 8, way.make() if way.make else None,
                     k=args.k, eos=stops)
        for repeat in range(args.repeats):
            order = ways if repeat % 2 == 0 else ways[::-1]
            for way in ways:
                way.tokens.append(0), way.seconds.append(0.0), way.draft.append(0.0), way.verify.append(0.0)
                way.steps.append(0)
            proposers = {way.name: way.make() if way.make else None for way in ways}
            for ids in prompts:
                for way in order:
                    start = time.perf_counter()
                    result = generate(reading if way.make else plain, ids, args.new_tokens, proposers[way.name],
                                      k=args.k, eos=stops)
                    way.seconds[-1] += time.perf_counter() - start
                    way.tokens[-1] += len(result.tokens)
                    way.draft[-1] += result.stats.draft_seconds
                    way.verify[-1] += result.stats.verify_seconds
                    way.steps[-1] += result.stats.steps
                    if repeat == 0:
                        way.outputs.append(result.tokens)
                        way.emitted += result.stats.emitted
                        way.total_steps += result.stats.steps
        report(ways)
        step_timings(head, spec, reading, prompts[0], args)


def report(ways: list[Way]) -> None:
    base = ways[0]
    print(f"\n| way | tau | draft / verify ms per step | tokens/s | speedup (spread) | same as AR |")
    print("|---|---|---|---|---|---|")
    for way in ways:
        tps = [t / s for t, s in zip(way.tokens, way.seconds)]
        ratios = [r / b for r, b in zip(tps, [t / s for t, s in zip(base.tokens, base.seconds)])]
        per_step = [(d / n * 1e3, v / n * 1e3) for d, v, n in zip(way.draft, way.verify, way.steps) if n]
        draft, verify = (statistics.median(x) for x in zip(*per_step)) if per_step else (0.0, 0.0)
        tau = way.emitted / way.total_steps if way.total_steps else 1.0
        same = sum(a == b for a, b in zip(way.outputs, base.outputs))
        print(f"| {way.name} | {tau:.2f} | {draft:.2f} / {verify:.2f} | {statistics.median(tps):.1f} | "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | {same}/{len(base.outputs)} |")


@torch.inference_mode()
def step_timings(head, spec, runner, prompt: list[int], args) -> None:
    """One chain step's drafting (the head reading the target's states for the pending token, then K-1 steps on
    its own outputs, with the logits of each), after a target forward of K+1 tokens and back to back."""
    runner.reset()
    runner.forward(prompt)
    length = runner.length
    ids = torch.tensor([[prompt[-1]]])
    hidden = {layer: torch.randn(1, head.frozen.config.hidden_size, dtype=runner.dtype)
              for layer in spec.family.draft_layers(spec)}
    steppers = {"head's modules": module_stepper(head, spec), "fused": head.stepper(spec),
                "fused, int8 weights": head.stepper(spec, int8=True)}
    for stepper in steppers.values():
        stepper.step(stepper.draft_input({layer: torch.randn(len(prompt), h.shape[-1], dtype=h.dtype)
                                          for layer, h in hidden.items()}), torch.tensor([prompt]))

    def drafting(stepper):
        stepper.rollback(len(prompt))
        feature = stepper.step(stepper.draft_input(hidden), ids)
        stepper.logits(feature)
        for _ in range(args.k - 1):
            feature = stepper.step(feature, ids)
            stepper.logits(feature)

    times = {(name, cold): [] for name in steppers for cold in (True, False)}
    for _ in range(args.rounds):
        for name, stepper in steppers.items():
            for cold in (True, False):
                if cold:
                    runner.rollback(length)
                    runner.forward([prompt[-1]] * (args.k + 1))
                start = time.perf_counter()
                drafting(stepper)
                times[(name, cold)].append(time.perf_counter() - start)
    print(f"\nOne chain step's drafting (K={args.k}), median of {args.rounds} rounds:")
    print("| way | after a target forward | back to back |")
    print("|---|---|---|")
    for name in steppers:
        cold, warm = (statistics.median(times[(name, c)]) * 1e3 for c in (True, False))
        print(f"| {name} | {cold:.2f} ms | {warm:.2f} ms |")


if __name__ == "__main__":
    main()
