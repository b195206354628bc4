"""Keeping the outputs of chosen decoder layers during a forward pass (forward hooks)."""

from __future__ import annotations

import torch
from torch import nn


class LayerCapture:
    """Forward hooks that keep the outputs of chosen decoder layers ("output of layer i", 0-based) during
    a forward pass: precompute stores them, the engine hands them to drafters that read the target."""

    def __init__(self, decoder_layers: nn.ModuleList, layers: list[int], device: torch.device | None = None):
        self.outputs: dict[int, torch.Tensor] = {}
        self.device = device  # where the kept states go (a split target's layers sit on several GPUs)
        self._hooks = [decoder_layers[i].register_forward_hook(self._keeper(i)) for i in layers]

    def _keeper(self, layer: int):
        def keep(_module, _inputs, output):
            states = output[0] if isinstance(output, tuple) else output
            self.outputs[layer] = states if self.device is None else states.to(self.device)
        return keep

    def take(self) -> dict[int, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
