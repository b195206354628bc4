"""The GPU check's parts that run `mtptrain eval` (scripts/gpu_check.py): the runtime against transformers' forward
in bfloat16, and the target split over two GPUs; and the tiny target and head a dry run uses in their place."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_check_env import gpu_count, skip_without_cuda

# A GPU run: the shipped head on 6 MT-bench first turns, 128 new tokens each.
GPU_EVAL = ["eval.prompts=mtbench", "eval.max_prompts=6", "eval.max_turns=1", "eval.max_new_tokens=128",
            "eval.repeats=1", "eval.k=[3]", "eval.tree.budgets=[8]", "target.dtype=bfloat16"]
# A dry run: a tiny random target and head, one short prompt, 8 new tokens.
DRY_EVAL = ["target.dtype=float32", "eval.max_turns=1", "eval.max_new_tokens=8", "eval.repeats=1", "eval.k=[2]",
            "eval.tree.budgets=[4]", "eval.tree.depth=3", "eval.tree.branch=2"]
DRY_PROMPTS = ["the word is hot and you see"]
# A GPU run given --tiny-target (a machine where the embedded target cannot be installed): that target and a random
# head in bfloat16 on CUDA, four prompts, 64 new tokens each.
TINY_GPU_EVAL = ["target.dtype=bfloat16", "eval.max_turns=1", "eval.max_new_tokens=64", "eval.repeats=1",
                 "eval.k=[3]", "eval.tree.budgets=[8]", "eval.tree.depth=3", "eval.tree.branch=2"]
TINY_GPU_PROMPTS = DRY_PROMPTS + ["tell me about the sea", "1 2 3 4 5 6", "write a short poem about a cat"]
RUNS = {"T=0": ["eval.temperature=0", "eval.methods=[chain,tree]"],
        "T=1": ["eval.temperature=1", "eval.methods=[chain,tree]"]}  # trees of children drawn from the head
SUBSTITUTE = "a tiny random Llama and a random EAGLE-3 head on the CPU in float32, 1 prompt x 8 tokens"


def check_runtime_vs_transformers(args) -> dict:
    skipped = skip_without_cuda(args)
    if skipped:
        return skipped
    from mtptrain.eval.run import run_eval

    settings = eval_settings(args)
    runs = {}
    for runtime in ("native", "transformers"):
        for name, run in RUNS.items():
            label = f"{runtime} {name}"
            out = args.work / "eval" / label.replace(" ", "-").replace("=", "")
            recipe = load(settings + run + [f"target.runtime={runtime}", f"eval.output_dir={out}"])
            runs[label] = summarise(run_eval(recipe, show_progress=False))
    details = {"runs": runs, "checks": runtime_checks(runs, args.dry_run)}
    same, compared = baselines_agree(runs["native T=0"], runs["transformers T=0"])
    details["baselines_identical"] = f"{same}/{compared}"  # bfloat16 kernels may break near-ties apart
    details["headline"] = headline(runs) + f"; native and transformers baselines identical {same}/{compared}"
    if args.dry_run:
        details["cpu_substitute"] = SUBSTITUTE
    elif args.tiny_target is not None:
        details["target"] = f"--tiny-target {args.tiny_target} and a random EAGLE-3 head, not the embedded target"
    return details


def check_split_target(args) -> dict:
    if args.dry_run:
        return {"not_run": "the split needs two GPUs; on a CPU target.gpus_per_rank is ignored (the target loads "
                           "whole), so there is nothing to substitute", "cpu_substitute": None}
    skipped = skip_without_cuda(args)
    if skipped:
        return skipped
    if gpu_count() < 2:
        return {"not_run": f"one GPU ({gpu_count()} visible): target.gpus_per_rank 2 needs two, and rank_devices "
                           "(mtptrain/target/loading.py) splits over GPUs only, never a GPU and the CPU"}
    from mtptrain.eval.run import run_eval
    from mtptrain.target import load_target

    settings = eval_settings(args) + ["target.gpus_per_rank=2", "eval.max_prompts=4", "eval.max_new_tokens=64",
                                      f"eval.output_dir={args.work / 'eval' / 'split'}", *RUNS["T=0"]]
    recipe = load(settings)
    target = load_target(recipe.target)
    devices = sorted({str(p.device) for p in target.model.parameters()})
    del target
    run = summarise(run_eval(recipe, show_progress=False))
    checks = {"the target's weights lie on two GPUs": devices == ["cuda:0", "cuda:1"], **exactness_checks("split", run)}
    return {"devices": devices, "run": run, "checks": checks,
            "headline": f"weights on {', '.join(devices)}; " + method_line(run)}


def eval_settings(args) -> list[str]:
    from mtptrain.heads.checkpoint import PRETRAINED_HEAD

    common = ["tracking.wandb=disabled"]
    if not args.dry_run and args.tiny_target is None:
        return common + GPU_EVAL + [f"eval.head={PRETRAINED_HEAD}"]
    target = tiny_target(args)
    texts, sizes = (DRY_PROMPTS, DRY_EVAL) if args.dry_run else (TINY_GPU_PROMPTS, TINY_GPU_EVAL)
    prompts = args.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [p]}) + "\n" for i, p in enumerate(texts)))
    return common + sizes + [f"target.model={target}", f"eval.head={tiny_head(args, target)}",
                                f"eval.prompts={prompts}"]


def load(overrides: list[str]):
    from mtptrain.config import load_recipe

    return load_recipe(None, overrides)


def summarise(results: dict) -> dict:
    machine = results["machine"]
    keep = ("label", "method", "k", "budget", "tokens", "tau", "tokens_per_second", "speedup", "acceptance",
            "draft_ms_per_step", "verify_ms_per_step", "exactness")
    return {"runtime": machine["runtime"], "device": machine["device"], "dtype": machine["dtype"],
            "gpu": machine.get("gpu"), "requests": results["settings"]["requests"],
            "methods": [{k: m.get(k) for k in keep} for m in results["methods"]],
            "answers": {key: turns[-1]["content"] for key, turns in results["conversations"].items()}}


def runtime_checks(runs: dict, dry_run: bool) -> dict:
    checks = {}
    for label, run in runs.items():
        runtime = label.split()[0]
        ran = run["runtime"].startswith("mtptrain runtime" if runtime == "native" else "transformers")
        checks[f"{label}: ran on {runtime} ({run['runtime']})"] = ran
        if not dry_run:
            checks[f"{label}: bfloat16 on CUDA"] = run["dtype"] == "torch.bfloat16" and run["device"].startswith("cuda")
        if label.endswith("T=0"):
            checks.update(exactness_checks(label, run))
        else:
            checks[f"{label}: every method emitted tokens, tau >= 1"] = all(
                m["tokens"] > 0 and m["tau"] >= 1 for m in run["methods"])
    return checks


def exactness_checks(label: str, run: dict) -> dict:
    """At temperature 0 every drafted output equals plain greedy decoding's, token for token, or differs first at
    a float near-tie (eval's own rule, mtptrain/eval/exactness.py): no failures, every request checked."""
    checks = {}
    for m in run["methods"][1:]:
        seen = m["exactness"]
        checks[f"{label} {m['label']}: equal to greedy decoding on {seen['identical']}/{seen['checked']} "
               f"(+{len(seen['near_ties'])} near-ties)"] = not seen["failures"] and seen["checked"] == run["requests"]
    return checks


def baselines_agree(a: dict, b: dict) -> tuple[int, int]:
    return sum(a["answers"][key] == b["answers"].get(key) for key in a["answers"]), len(a["answers"])


def method_line(run: dict) -> str:
    return ", ".join(f"{m['label']} tau {m['tau']:.2f} {m['tokens_per_second']:.0f} tok/s" for m in run["methods"])


def headline(runs: dict) -> str:
    return "; ".join(f"{label}: {method_line(run)}" for label, run in runs.items())


# ---------------------------------------------------------------- a dry run's tiny target and head


def tiny_target(args) -> Path:
    """--tiny-target, or a tiny random Llama with the embedded target's tokenizer, made once under the output
    directory (initial weights large enough that its greedy answers vary)."""
    if args.tiny_target is not None:
        return Path(args.tiny_target)
    out = args.work.parent / "tiny-target"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtptrain.config import TargetConfig
    from mtptrain.target import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_head(args, target_dir: Path) -> Path:
    """A random EAGLE-3 head of the tiny target (drafting runs, whatever it accepts), made once."""
    out = args.work.parent / f"tiny-head-{target_dir.name}"
    if (out / "config.json").is_file():
        return out
    import torch

    from mtptrain.config import TargetConfig
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.target import load_target

    target = load_target(TargetConfig(model=str(target_dir), dtype="float32"))
    layers = target.num_layers
    spec = HeadSpec("eagle3", last_layer=layers - 1, feature_layers=list(range(min(3, layers - 1))), ttt_steps=2,
                    draft_vocab_size=min(64, target.vocab_size))
    torch.manual_seed(0)
    save_head(out, spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    return out
