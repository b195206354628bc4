"""Where a forward's keys and values go and what its queries attend over.

`Attends` is the protocol the decoder's layers (runtime/model.py) write and attend through. Three caches follow it:
`KVCache`, one sequence's keys and values (the engine's runners, a draft head's steps); `NoCache`, a forward over
its tokens alone (precompute's batches); and a batched decoding step over rows of different lengths
(runtime/batch.py), which brings its own masks and kernels.

`KVCache` holds every layer in tensors allocated once per generation. Rolling back to a prefix is a length change
(nothing is copied or freed); keeping the accepted path of a verified tree moves only that path's entries next to
the prefix, in place. The tensors grow (by doubling, one copy) only when a generation outruns the capacity it was
reset with.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Attends(Protocol):
    masks_itself: bool  # True: the cache writes and attends with its own masks; the decoder builds none

    def end(self, start: int, count: int) -> int:
        """The longest sequence's length once `count` new tokens are taken in after `start` cached positions."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels, start: int,
               mask: torch.Tensor | None, causal: bool, attention) -> torch.Tensor:
        """The attention's output [B, H, T, D] for q [B, H, T, D] of T new tokens whose keys and values k, v
        [B, Hkv, T, D] go to layer `layer` at [start, start + T), by `attention(q, keys, values, mask, causal)`
        (or, for a cache that masks itself, its own kernels from `kernels`, runtime/model.py's LayerKernels)."""


class NoCache:
    """A forward over its tokens alone: the new keys are attended as computed and kept nowhere."""

    masks_itself = False

    def end(self, start: int, count: int) -> int:
        return start + count

    def attend(self, layer, q, k, v, kernels, start, mask, causal, attention) -> torch.Tensor:
        return attention(q, k, v, mask, causal)


class KVCache:
    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        # every layer's keys (values) are views of one tensor [layers, B, Hkv, capacity, D]: keeping a tree's
        # path moves its entries in all layers at once (SmolLM2-135M's 30 layers on a 2-core AMD EPYC Zen 4:
        # 0.34 ms a verified tree with a copy per layer and store, 0.02 ms with one per store)
        self._stores(torch.empty((layers, batch, kv_heads, capacity, head_dim), dtype=dtype, device=device),
                     torch.empty((layers, batch, kv_heads, capacity, head_dim), dtype=dtype, device=device))
        self.length = 0  # positions filled, the same for every row of the batch

    def _stores(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.all_keys, self.all_values = keys, values
        self.keys, self.values = list(keys.unbind(0)), list(values.unbind(0))

    masks_itself = False

    def end(self, start: int, count: int) -> int:
        return start + count

    def attend(self, layer, q, k, v, kernels, start, mask, causal, attention) -> torch.Tensor:
        keys, values = self.write(layer, k, v, start)
        if start == 0:  # nothing cached before: attend the new keys as computed, whatever the cache's dtype
            keys, values = k, v
        return attention(q, keys, values, mask, causal)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, length: int) -> None:
        """Room for `length` positions (a copy of what is held, only when it has to grow)."""
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        grown = []
        for old in (self.all_keys, self.all_values):
            new = old.new_empty((*old.shape[:3], size, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            grown.append(new)
        self._stores(*grown)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Put k, v [B, Hkv, T, D] at positions [start, start + T) of `layer`; return the layer's keys and values
        up to there (views, no copy)."""
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def keep(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` positions and, after them, the entries at length + r for r in rows, in that
        order (the accepted path of a verified tree); only moved entries are copied."""
        if rows != list(range(len(rows))):
            index = length + torch.tensor(rows, dtype=torch.long, device=self.all_keys.device)
            for store in (self.all_keys, self.all_values):
                store[:, :, :, length : length + len(rows)] = store.index_select(3, index)
        self.length = length + len(rows)
