"""How a head is optimised: the training precision, DeepSpeed's config (batch sizes, clipping, schedule, ZeRO),
the optimizer (AdamW or Muon) and the parameter groups it is given. The trainer (train/trainer.py) builds its
engine from these; tests and the GPU check read them on their own."""

from __future__ import annotations

import math

import torch
from torch import nn

from mtptrain.config import TrainConfig
from mtptrain.runtime.choice import choose


def pick_precision(requested: str, device: torch.device, target_config=None) -> str:
    """train.precision as run: auto is bf16 on CUDA and, on a CPU, bf16-autocast where the runtime's measurement
    found bfloat16 products faster than float32 on the target's shapes (fp32 where it did not, as on CPUs
    without bf16 instructions, which emulate them several times slower)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16"
    if target_config is not None and choose(target_config, device).dtype == torch.bfloat16:
        return "bf16-autocast"
    return "fp32"


def autocast(precision: str, device: torch.device):
    """The forward's context: bfloat16 products under bf16-autocast, nothing otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast")


def deepspeed_config(cfg: TrainConfig, steps: int, world_size: int, precision: str, device_type: str) -> dict:
    """The one place batch sizes, precision, the optimizer and the schedule are decided.

    The optimizer is torch's AdamW (`optimizer_config`).
    """
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        # Under Muon, DeepSpeed's ZeRO path orthogonalises each matrix's momentum where it gathers the gradients,
        # and would then clip those updates (about sqrt(min(rows, cols)) in norm each), shrinking every step many
        # times over: Muon bounds its step itself, and AdamW's is invariant to the gradient's scale.
        "gradient_clipping": 0.0 if cfg.optimizer == "muon" else cfg.grad_clip,
        "optimizer": optimizer_config(cfg, device_type),
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": steps, "warmup_num_steps": max(1, round(cfg.warmup_ratio * steps)),
            # No warmup asked: start at the peak (DeepSpeed always warms up over >= 2 steps otherwise).
            "warmup_min_ratio": 0.0 if cfg.warmup_ratio > 0 else 1.0,
            "cos_min_ratio": cfg.min_lr_ratio, "warmup_type": "linear"}},
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def optimizer_config(cfg: TrainConfig, device_type: str) -> dict:
    """DeepSpeed's optimizer section: AdamW, or Muon with AdamW for the parameters that are not matrices (the
    rates of the matrices are set per parameter group, `trained_parameters`).

    AdamW is torch's everywhere (`torch_adam`), fused into one kernel on CUDA. DeepSpeed's own builds its op on
    first use: FusedAdam with nvcc, which many GPU nodes lack (the job then dies at its first step), and on CPU
    cpu_adam (about 40 s on 2 cores) for no gain at a head's size."""
    adam = {"lr": cfg.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": cfg.weight_decay, "torch_adam": True}
    if cfg.optimizer == "muon":  # Muon's own AdamW half takes torch's AdamW as it is given (no fused flag)
        return {"type": "Muon", "params": {**adam, "momentum": 0.95}}
    return {"type": "AdamW", "params": {**adam, **({"fused": True} if device_type == "cuda" else {})}}


def trained_parameters(head: nn.Module, cfg: TrainConfig) -> list:
    """What the optimizer is given: the head's parameters that require gradients, as one list under AdamW; under
    Muon one group per matrix that DeepSpeed's Muon takes (its own rule: two or more dimensions, no "embed" or
    "lm_head" in the name), whose rate makes its update's RMS AdamW's (lr x 0.2 x sqrt(max(rows, cols)), undoing
    the sqrt(rows / cols) that DeepSpeed's Muon applies to tall matrices), then one group of the rest at lr."""
    named = [(name, p) for name, p in head.named_parameters() if p.requires_grad]
    if cfg.optimizer != "muon":
        return [p for _, p in named]
    groups, rest = [], []
    for name, p in named:
        if p.ndim >= 2 and not any(word in name.lower() for word in ("embed", "lm_head")):
            rows, cols = p.shape[0], p[0].numel()  # a matrix as DeepSpeed views it
            tall = math.sqrt(rows / cols) if rows > cols else 1.0
            groups.append({"params": [p], "name": name, "lr": cfg.lr * 0.2 * math.sqrt(max(rows, cols)) / tall,
                           "weight_decay": cfg.muon_weight_decay})
        else:
            rest.append(p)
    return groups + ([{"params": rest, "name": "vectors"}] if rest else [])
