"""The target with its KV cache: forward over new tokens, roll back to a prefix."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class TargetRunner:
    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache()

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
