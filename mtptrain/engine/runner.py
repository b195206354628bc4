"""The target with its KV cache: forward over new tokens, roll back to a prefix.

When a drafter needs the target's hidden states (the head chain), the runner
keeps the outputs of the requested decoder layers (0-based "output of layer
i", the last one before the final norm, as in the feature store) for the
tokens of the latest forward.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class TargetRunner:
    def __init__(self, model, capture: list[int] = ()):
        self.model = model
        self.cache = DynamicCache()
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> [n, H] for the tokens of the latest forward
        layers = model.get_decoder().layers
        self._hooks = [layers[i].register_forward_hook(self._keeper(i)) for i in capture]

    def _keeper(self, layer: int):
        def keep(_module, _inputs, output):
            self.hidden[layer] = (output[0] if isinstance(output, tuple) else output)[0]
        return keep

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def reset(self) -> None:
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        """Tokens whose keys and values are in the cache."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [n, V] for the next token after each of `ids`, appended after the cached prefix."""
        device = next(self.model.parameters()).device
        out = self.model(torch.tensor([ids], device=device), past_key_values=self.cache, use_cache=True)
        return out.logits[0]

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens: the accepted prefix after a verification."""
        if length < self.length:
            self.cache.crop(length - self.length)  # this transformers crops by a negative count
