"""The dtype the target runs in, from its transformers config: the one asked for, or on a CPU the faster one for
the model's shapes as this machine measured it (runtime/choice.py), the same on every rank of a process group."""

from __future__ import annotations

import torch

from mtptrain.dist import DistInfo
from mtptrain.errors import MtptrainError
from mtptrain.runtime.choice import Choice, agree, choose, measure
from mtptrain.runtime.model import SUPPORTED


class NothingToMeasure(MtptrainError, RuntimeError):
    """The model runs on transformers' forward: the runtime has no kernels to time for it."""


def pick_dtype(requested: str, device: torch.device, config=None) -> torch.dtype:
    """target.dtype, or for auto: bfloat16 on a GPU; on a CPU, the faster dtype for the model's shapes as this
    machine measured it (float32 when the config is unknown or the model is not one the runtime runs)."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16
    if config is None or config.model_type not in SUPPORTED:
        return torch.float32
    return choose(config, device).dtype


def ranks_must_agree(device: torch.device, dist: DistInfo) -> bool:
    """Whether the ranks of a process group must agree on one measured choice before the target loads: several
    ranks on CPUs (on a GPU the dtype is bfloat16, measured nothing)."""
    return dist.world_size >= 2 and device.type == "cpu"


def agree_on_dtype(config, device: torch.device) -> None:
    """Every rank of a process group runs the target with rank 0's measured dtype and kernels (`choice.agree`).
    Collective: each stage calls it once on every rank where `ranks_must_agree`, before loading the target."""
    if config.model_type in SUPPORTED:
        agree(config, device)


def measure_again(config, requested: str, name: str) -> tuple[Choice, bool]:
    """Time the runtime's kernels on the model's shapes again, as `mtptrain measure` does; the choice it makes
    now for `requested` (target.dtype) and whether it was cached (not when other processes kept the machine busy
    meanwhile). `name` is the model as the recipe names it."""
    if config.model_type not in SUPPORTED:
        raise NothingToMeasure(f"{name} ({config.model_type}) runs on transformers' forward: the runtime measures "
                               f"nothing for it (it runs {', '.join(sorted(SUPPORTED))})")
    _, source = measure(config)
    return choose(config, torch.device("cpu"), requested), source == "measured"
