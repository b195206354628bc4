"""The optimizer DeepSpeed builds from the trainer's config needs no op compiled on first use: DeepSpeed's FusedAdam
builds with nvcc, which many GPU nodes do not have (the run then dies at its first step)."""

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from mtptrain.config import TrainConfig
from mtptrain.train.optimization import optimizer_config


def built_by_deepspeed(section: dict):
    """The optimizer class and arguments DeepSpeed's engine picks for an optimizer section's parameters."""
    params = dict(section["params"])
    engine = SimpleNamespace(zero_use_cpu_optimizer=lambda: False)
    cls, extra = DeepSpeedEngine.get_optimizer_configuration(engine, params, True)
    return cls, {**params, **extra}


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizer_is_torchs_adamw_on_every_device(device_type, optimizer):
    section = optimizer_config(TrainConfig(optimizer=optimizer), device_type)
    if optimizer == "muon":
        section = {**section, "params": {k: v for k, v in section["params"].items() if k != "momentum"}}
    cls, params = built_by_deepspeed(section)
    assert cls is torch.optim.AdamW
    built = cls([torch.nn.Parameter(torch.zeros(4))], **params)  # every argument is one torch's AdamW takes
    assert bool(built.defaults["fused"]) == (device_type == "cuda" and optimizer == "adamw")
