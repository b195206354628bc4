"""The GPU check's parts at real shapes (scripts/gpu_check.py), with random weights built from the committed configs
(recipes/shapes/*.json, Meta's published shapes), nothing downloaded:

  eagle3_real_shapes  one training step (forward and backward) of the EAGLE-3 head at Llama-3.1-8B's and 70B's
                      shapes, at its recipe's micro-batch, TTT steps and loss chunk, against docs/scale.md
  decode_8b           batch-1 greedy decoding of a Llama-3.1-8B-shaped model on the runtime, with the host's time
                      and the GPU's time per token apart

A dry run shrinks every shape (SHRUNK) and runs on the CPU.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections import Counter
from pathlib import Path

from gpu_check_env import skip_without_cuda

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"8b": "llama-3.1-8b", "70b": "llama-3.1-70b"}  # recipes/shapes/<name>.json, recipes/<name>-eagle3.yaml
SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 512, "num_hidden_layers": 8}
# docs/scale.md, "Training: ZeRO stage and batch sizes": head parameters; the frozen embedding, final norm and LM head
# in bf16; the optimizer side of a ZeRO-1 rank over 8 GPUs (its share of the AdamW state plus the fp32 master
# weights, as the page adds them); FLOPs per token over the 7 TTT steps and the LM head; the tokens/s per GPU it
# assumes (the node's rate at 30% of peak, over 8).
SCALE_DOC = {
    "8b": {"head_parameters": 425e6, "frozen_parts_gb": 2.1, "optimizer_side_gb_per_gpu": 0.85 + 1.7,
           "flops_per_token": 19e9, "tokens_per_s_per_gpu": 125_000 / 8},
    "70b": {"head_parameters": 1.40e9, "frozen_parts_gb": 4.2, "optimizer_side_gb_per_gpu": 2.8 + 5.6,
            "flops_per_token": 61e9, "tokens_per_s_per_gpu": 39_000 / 8},
}
H100_GIB = 80  # the GPU docs/scale.md plans for
DRY_SEQUENCE = 64
GB = 1e9


def shape_config(name: str, dry_run: bool):
    """The committed config of `name` (8b / 70b), every size shrunk to SHRUNK's in a dry run."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "recipes" / "shapes" / f"{TARGETS[name]}.json")
    if dry_run:
        for key, value in SHRUNK.items():
            setattr(config, key, value)
    return config


def device_and_dtype(args):
    import torch

    return (torch.device("cpu"), torch.float32) if args.dry_run else (torch.device("cuda", 0), torch.bfloat16)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the EAGLE-3 head's step at real shapes


def check_eagle3_real_shapes(args) -> dict:
    skipped = skip_without_cuda(args)
    if skipped:
        return skipped
    device, _ = device_and_dtype(args)
    found = {name: head_step(name, args.dry_run, device) for name in TARGETS}
    checks = {f"{name}: {check}": passed for name, measured in found.items()
              for check, passed in measured.pop("checks").items()}
    details = {"targets": found, "checks": checks, "headline": "; ".join(
        f"{name}: {m['micro_batch']} x {m['sequence']} tokens, {m['ttt_steps']} TTT steps, {m['step_seconds']:.2f} s, "
        f"peak {m['peak_gib']:.1f} GiB, {m['head_parameters']:,} parameters (docs/scale.md: "
        f"{m['docs_scale']['head_parameters']:,.0f})" for name, m in found.items())}
    if args.dry_run:
        details["cpu_substitute"] = (f"shapes shrunk to {SHRUNK}, {DRY_SEQUENCE}-token sequences, bfloat16 on the CPU; "
                                     "peak memory not measured")
    return details


def head_step(name: str, dry_run: bool, device) -> dict:
    """Build the recipe's head over the target's frozen parts (random, bf16, the decoder layers left on the meta
    device), then time a forward and backward over random features, as the trainer runs it under bf16."""
    import torch

    from mtptrain.config import load_recipe
    from mtptrain.heads.losses import Loss
    from mtptrain.heads.objective import step_weights

    gc.collect()  # the previous target's head and parts, before this one's peak is read
    if device.type == "cuda":
        torch.cuda.empty_cache()
    recipe = load_recipe(ROOT / "recipes" / f"{TARGETS[name]}-eagle3.yaml")
    config = shape_config(name, dry_run)
    model = frozen_parts(config, device)
    head, spec = build_head(recipe, model, device)
    batch = random_batch(recipe, spec, config, device, DRY_SEQUENCE if dry_run else recipe.data.max_length)
    weights = step_weights(recipe.head.step_weights, spec.draft_positions)
    feature_weight, loss = spec.family.feature_weight(recipe.head), Loss(recipe.train.loss, recipe.train.loss_eta)

    def step() -> float:
        head.zero_grad(set_to_none=True)
        result = spec.family.objective(head, batch, spec, weights, feature_weight, recipe.train.loss_chunk, loss)
        result.loss.backward()
        sync(device)
        return float(result.loss.detach())

    step()  # first-call allocations and kernel choices
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(1 if dry_run else 3):
        started = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    measured = measurements(name, recipe, head, model, batch, statistics.median(times), peak)
    measured["checks"] = {"the loss is finite": all(map(math.isfinite, losses)),
                          "every trained parameter got a gradient": all(
                              p.grad is not None for p in head.parameters() if p.requires_grad)}
    if device.type == "cuda":
        measured["checks"][f"peak + docs/scale.md's optimizer side fits an {H100_GIB} GiB H100"] = \
            measured["projected_rank_gib"] < H100_GIB
    return measured


def frozen_parts(config, device):
    """The target on the meta device with its embedding, final norm and LM head materialised on `device` in bf16
    (random, as a checkpoint's would be read there: mtptrain/target/loading.py load_frozen_target)."""
    import torch

    from mtptrain.config import TargetConfig
    from mtptrain.target.parts import frozen_modules, meta_model

    model = meta_model(config, torch.bfloat16, TargetConfig())
    with torch.no_grad():
        for module in frozen_modules(model):
            module.to_empty(device=device)
            for param in module.parameters():
                if "norm" in type(module).__name__.lower():  # LlamaRMSNorm's weight: ones, as initialised
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


def build_head(recipe, model, device):
    """The recipe's head (its spec resolved as the trainer resolves it against a store of this target), built on
    `device` and cast to bf16 as DeepSpeed's bf16 mode holds it."""
    import torch

    from mtptrain.target.layers import resolve_layers
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.heads.vocab import DraftVocab

    layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    manifest = {"layers": resolve_layers(recipe.precompute.layers, layers), "last_layer": layers - 1,
                "target": {"vocab_size": vocab}}
    spec = HeadSpec.of(recipe.head, manifest)
    draft_vocab = DraftVocab.from_counts(Counter(), spec.draft_vocab_size, vocab) if spec.draft_vocab_size else None
    torch.manual_seed(0)
    with torch.device(device):
        head = spec.family.build(spec, FrozenTarget.of(model), draft_vocab)
    return head.to(device=device, dtype=torch.bfloat16).train(), spec


def random_batch(recipe, spec, config, device, length: int) -> dict:
    import torch

    rows = recipe.train.micro_batch_size
    generator = torch.Generator(device=device).manual_seed(0)
    return {"input_ids": torch.randint(0, config.vocab_size, (rows, length), device=device, generator=generator),
            "loss_mask": torch.ones(rows, length, dtype=torch.long, device=device),
            "lengths": torch.full((rows,), length),
            "hidden": {layer: torch.randn(rows, length, config.hidden_size, device=device, dtype=torch.bfloat16,
                                          generator=generator) for layer in spec.layers}}


def measurements(name: str, recipe, head, model, batch, seconds: float, peak_gib: float) -> dict:
    from mtptrain.target.parts import frozen_parameters

    doc = SCALE_DOC[name]
    rows, length = batch["input_ids"].shape
    parameters = sum(p.numel() for p in head.parameters())
    frozen_gb = sum(p.numel() * p.element_size() for _, p in frozen_parameters(model)) / GB
    tokens_per_s = rows * length / seconds
    return {"micro_batch": rows, "sequence": length, "ttt_steps": recipe.head.ttt_steps,
            "loss_chunk": recipe.train.loss_chunk, "step_seconds": round(seconds, 4),
            "tokens_per_s": round(tokens_per_s, 1), "head_parameters": parameters,
            "frozen_parts_gb": round(frozen_gb, 2), "peak_gib": round(peak_gib, 2),
            # what a ZeRO-1 rank would hold at most: this step's peak plus the page's optimizer side
            "projected_rank_gib": round(peak_gib + doc["optimizer_side_gb_per_gpu"] * GB / 2**30, 2),
            # forward and backward only (no optimizer step, no all-gather), at the page's FLOPs per token
            "tflops_per_s": round(doc["flops_per_token"] * tokens_per_s / 1e12, 1),
            "tokens_per_s_vs_docs": round(tokens_per_s / doc["tokens_per_s_per_gpu"], 3),
            "docs_scale": doc}


# ---------------------------------------------------------------- batch-1 decoding of an 8B-shaped model


def check_decode_8b(args) -> dict:
    skipped = skip_without_cuda(args)
    if skipped:
        return skipped
    import torch
    from transformers import AutoModelForCausalLM

    from mtptrain.engine.generate import generate
    from mtptrain.machine import memory_bandwidth
    from mtptrain.runtime.attention import decoding_kernels
    from mtptrain.runtime.runner import load_decoder, open_runner, runtime_description

    device, dtype = device_and_dtype(args)
    prompt_len, new_tokens, steps = (32, 8, 4) if args.dry_run else (128, 256, 64)
    config = shape_config("8b", args.dry_run)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    decoder = load_decoder(model)
    if decoder is None:
        return {"checks": {"the runtime runs the 8B shape (load_decoder gave transformers' forward)": False}}
    runner = open_runner(decoder)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    generate(runner, prompt, 8)  # first-call allocations
    started = time.perf_counter()
    result = generate(runner, prompt, new_tokens, eos=set())
    engine_seconds = time.perf_counter() - started
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_gbs = memory_bandwidth(device, repeats=2 if args.dry_run else 9)[1]
    with decoding_kernels(device):  # the attention kernels generate() decodes with
        split = host_and_device(runner, prompt, steps, device)
    step_ms = 1000 * result.stats.verify_seconds / max(result.stats.steps, 1)
    details = {"runtime": runtime_description(runner), "prompt_tokens": prompt_len, "new_tokens": len(result.tokens),
               "tokens_per_s": round(len(result.tokens) / engine_seconds, 1), "engine_step_ms": round(step_ms, 3),
               "weights_gb": round(weight_bytes / GB, 2), "read_bandwidth_gbs": round(read_gbs, 1),
               "roofline_ms": round(weight_bytes / read_gbs / 1e6, 3), **split}
    details["roofline_share"] = round(details["roofline_ms"] / step_ms, 3)
    details["checks"] = {"the native runtime decoded": runner.runtime == "native",
                         f"{new_tokens} tokens decoded": len(result.tokens) == new_tokens}
    details["headline"] = (f"{details['tokens_per_s']:.1f} tok/s; a step {step_ms:.2f} ms (roofline "
                           f"{details['roofline_ms']:.2f} ms, {details['roofline_share']:.0%}); host issues a step in "
                           f"{split['issue_ms']:.2f} ms, GPU kernels {split['device_kernel_ms']:.2f} ms")
    if args.dry_run:
        details["cpu_substitute"] = f"shapes shrunk to {SHRUNK}, float32 on the CPU (no device time to separate)"
    return details


def host_and_device(runner, prompt: list[int], steps: int, device) -> dict:
    """Per one-token step after the prompt: the host's time to issue it (steps back to back, no wait), the time with a
    wait for the device after each, and from torch.profiler the host's own CPU time (waits for the device left out)
    and the GPU's kernel time. The runtime may wait for the device inside a step (a host read of a device value):
    then issuing costs as much as waiting."""
    token = prompt[-1]

    def prefill() -> None:  # the prompt, then two untimed steps (first-call allocations)
        runner.reset()
        runner.forward(prompt, last_only=True)
        runner.forward([token], last_only=True)
        runner.forward([token], last_only=True)
        sync(device)

    prefill()
    started = time.perf_counter()
    for _ in range(steps):
        runner.forward([token], last_only=True)
    issued = time.perf_counter() - started
    sync(device)
    unsynced = time.perf_counter() - started
    prefill()
    started = time.perf_counter()
    for _ in range(steps):
        runner.forward([token], last_only=True)
        sync(device)
    synced = time.perf_counter() - started
    found = {"steps_timed": steps, "issue_ms": round(1000 * issued / steps, 3),
             "unsynced_wall_ms": round(1000 * unsynced / steps, 3), "synced_wall_ms": round(1000 * synced / steps, 3)}
    prefill()
    return {**found, **profiled(runner, token, steps, device)}


WAITS = ("synchronize", "_local_scalar_dense", "aten::item", "memcpy")  # host time spent waiting for the device


def profiled(runner, token: int, steps: int, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.forward([token], last_only=True)
            sync(device)
    except Exception as exc:  # noqa: BLE001 -- a profiler without CUPTI still leaves the timings above
        return {"profiler_error": f"{type(exc).__name__}: {exc}", "host_cpu_ms": None, "device_kernel_ms": 0.0}
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events)
    waits = sum(e.self_cpu_time_total for e in events if any(w in e.key.lower() for w in WAITS))
    kernels = sum(getattr(e, "self_device_time_total", 0) for e in events)
    return {"host_cpu_ms": round((cpu - waits) / 1000 / steps, 3), "host_wait_ms": round(waits / 1000 / steps, 3),
            "device_kernel_ms": round(kernels / 1000 / steps, 3),
            "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1000 / steps, 3)) for e in
                             sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]]}
