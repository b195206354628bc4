"""The target run by transformers' own forward, with a DynamicCache: the fallback for architectures the
fast decoder does not run, and the reference it is tested against. Same interface as `FastRunner`.

When a drafter needs the target's hidden states (the head chain), the runner
keeps the outputs of the requested decoder layers (0-based "output of layer
i", the last one before the final norm, as in the feature store) for the
tokens of the latest forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import DynamicCache

from mtptrain.runtime.capture import LayerCapture


class TransformersRunner:
    runtime = "transformers"

    def __init__(self, model, capture: list[int] = ()):
        self.model = model
        self.cache = DynamicCache()
        self.tokens: list[int] = []  # what the cache holds (a later request may start from a shared prefix)
        layers = model.get_decoder().layers if capture else []  # a model without `.layers` runs, capturing nothing
        self._capture = LayerCapture(layers, list(capture), self.device)
        # every device the model spans: a target split over GPUs (target.gpus_per_rank) runs on each in turn
        self.devices = sorted({p.device for p in model.parameters()}, key=str)

    @property
    def hidden(self) -> dict[int, torch.Tensor]:
        """layer -> [n, H]: the captured states of the tokens of the latest forward."""
        return {layer: states[0] for layer, states in self._capture.outputs.items()}

    def close(self) -> None:
        self._capture.close()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.tokens = []

    @property
    def length(self) -> int:
        """Tokens whose keys and values are in the cache."""
        return self.cache.get_seq_length()

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def attention(self) -> str:
        return getattr(self.model.config, "_attn_implementation", "sdpa")

    @torch.inference_mode()
    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [n, V] for the next token after each of `ids` (only the last with `last_only`), appended after
        the cached prefix."""
        start = self.length
        out = self.model(torch.tensor([ids], device=self.device), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        self.tokens[start:] = ids
        return out.logits[0]

    @torch.inference_mode()
    def forward_tree(self, pending: int, tree) -> torch.Tensor:
        """Logits [N+1, V] for [pending, tree nodes] under the tree mask (see engine/tree.py). A tree needs an
        attention that takes an arbitrary mask: under FlashAttention (what target.attn_implementation auto picks on
        CUDA where flash-attn imports) this one forward runs SDPA over the same cache, and chains keep flash."""
        dtype = self.model.get_input_embeddings().weight.dtype
        start = self.length
        mask, positions = tree.attention(start, dtype, self.device)
        ids = torch.tensor([[pending] + tree.tokens], device=self.device)
        with masked_attention(self.model.config):
            out = self.model(ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                             use_cache=True)
        self.tokens[start:] = [pending] + tree.tokens
        return out.logits[0]

    @torch.inference_mode()
    def keep(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` cached tokens and, after them, the entries at length + r for r in rows
        (the accepted path of a verified tree), in that order."""
        if rows != list(range(len(rows))):  # move the path's entries next to the prefix (only those are copied)
            index = length + torch.tensor(rows, dtype=torch.long)
            for layer in self.cache.layers:  # a split target keeps each layer's cache on that layer's GPU
                here = index.to(layer.keys.device)
                layer.keys[..., length : length + len(rows), :] = layer.keys.index_select(-2, here)
                layer.values[..., length : length + len(rows), :] = layer.values.index_select(-2, here)
            self.tokens[length:] = [self.tokens[length + r] for r in rows]
        self.rollback(length + len(rows))

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the positions held [1, Hkv, length, D]."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens: the accepted prefix after a verification."""
        cut_cache(self.cache, length)
        del self.tokens[length:]


def cut_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` tokens of a KV cache (this transformers crops by a negative count)."""
    if length < cache.get_seq_length():
        cache.crop(length - cache.get_seq_length())


@contextmanager
def masked_attention(config):
    """The model's attention for one forward under an explicit mask: sdpa in place of an implementation that
    drops arbitrary masks (flash-attn's kernels take only causal or padding ones). Each attention module reads
    `config._attn_implementation` at every forward, and the KV cache is the same for all of them."""
    before = config._attn_implementation
    if before in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before
