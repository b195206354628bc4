"""Many rows at once: the captured states of a batch (precompute) and batched decoding (regenerate).

Both run on the native decoder when the model allows it and on transformers' forward otherwise, with the
same results up to float rounding.

Decoding left-pads the prompts, so every row's next token lands in the same cache column; each row's
positions count from its own first token and its keys never see another row's padding. On the native
decoder each prompt is run by itself (causal attention, no padding computed) into its row of the cache,
and the batch then steps together, with the attention kernel measured for batches (runtime/choice.py).
A row that stops leaves the batch (its cache rows are dropped), so a long answer does not keep short ones
computing.
"""

from __future__ import annotations

from typing import Callable

import torch

from mtptrain.runtime.cache import KVCache
from mtptrain.runtime.runner import native_decoder
from mtptrain.target import LayerCapture


@torch.inference_mode()
def capture_states(model, ids: torch.Tensor, layers: list[int], runtime: str = "auto") -> dict[int, torch.Tensor]:
    """States [B, T, H] after each decoder layer of `layers` for right-padded ids [B, T], on the native decoder
    unless `runtime` (target.runtime) says transformers. Right padding needs no mask: under the causal mask a
    real token never attends to the padding after it."""
    decoder = native_decoder(model, runtime)
    ids = ids.to(model.get_input_embeddings().weight.device)
    if decoder is not None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        _, captured = decoder.forward(ids, positions, None, 0, None, tuple(layers), logits=False)
        return captured
    capture = LayerCapture(model.get_decoder().layers, layers)
    try:
        model.get_decoder()(input_ids=ids, use_cache=False)  # the stack alone: no vocabulary-sized logits
        return capture.take()
    finally:
        capture.close()


Pick = Callable[[int, torch.Tensor], int]  # (row's index among the prompts, its logits [V]) -> next token


@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], budgets: list[int], stops: set[int], pick: Pick,
                 pad_id: int, runtime: str = "auto") -> list[tuple[list[int], bool]]:
    """Decode each prompt for at most its budget of tokens, choosing each token with `pick`. Returns, per
    prompt, (new ids without the stop token, whether a stop token ended it)."""
    decoder = native_decoder(model, runtime)
    rows = _NativeRows(decoder, prompts, max(budgets)) if decoder is not None else _TransformersRows(model, prompts, pad_id)
    logits = rows.start()
    live = list(range(len(prompts)))  # live[j] = the prompt index of batch row j
    results: list[tuple[list[int], bool]] = [([], False) for _ in prompts]
    while live:
        chosen, keep = [], []
        for j, i in enumerate(live):
            token = pick(i, logits[j])
            tokens, _ = results[i]
            if token in stops:
                results[i] = (tokens, True)
                continue
            tokens.append(token)
            if len(tokens) < budgets[i]:
                keep.append(j)
                chosen.append(token)
        if not keep:
            break
        if len(keep) < len(live):
            rows.select(keep)
            live = [live[j] for j in keep]
        logits = rows.step(chosen)
    return results


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    seen = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        seen[i, width - len(p):] = True
    return ids, seen


GROW = 64  # positions a batch's cache grows by


class _BatchCache(KVCache):
    """A batch's cache, attended over its whole capacity with the unfilled positions masked: the attention
    kernels copy a slice of the capacity into a contiguous tensor on every call (measured on an AMD EPYC with
    64 rows of 256 positions in bfloat16: 623 us for the key product over a slice, 124 us over a whole
    tensor), while the masked tail costs less than that copy. So the capacity grows GROW positions at a time,
    and unfilled positions hold zeros (a masked weight is 0, and 0 times uninitialised memory may be NaN)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        super().__init__(layers, batch, kv_heads, head_dim, capacity, dtype, device)
        for store in (self.keys, self.values):
            for tensor in store:
                tensor.zero_()

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                store[i] = torch.cat([old, old.new_zeros((*old.shape[:2], GROW, old.shape[3]))], dim=2)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        super().write(layer, k, v, start)
        return self.keys[layer], self.values[layer]

    def select_rows(self, rows: torch.Tensor) -> None:
        for store in (self.keys, self.values):
            for i, tensor in enumerate(store):
                store[i] = tensor.index_select(0, rows)


class _NativeRows:
    def __init__(self, decoder, prompts: list[list[int]], budget: int):
        self.decoder = decoder
        self.prompts = prompts
        width = max(len(p) for p in prompts)
        d, device = decoder, decoder.device
        self.cache = _BatchCache(d.num_layers, len(prompts), d.kv_heads, d.head_dim, width + min(budget, GROW),
                                 d.batch_cache_dtype, device)
        self.seen = torch.zeros((len(prompts), self.cache.capacity), dtype=torch.bool, device=device)

    def start(self) -> torch.Tensor:
        width = max(len(p) for p in self.prompts)
        logits = []
        for i, prompt in enumerate(self.prompts):
            pad = width - len(prompt)
            self.seen[i, pad:width] = True
            ids = torch.tensor([prompt], device=self.seen.device)
            positions = torch.arange(len(prompt), device=ids.device)[None]
            out, _ = self.decoder.forward(ids, positions, self.cache.row(i, pad), 0, None, last_only=True)
            logits.append(out[0, -1].float())
        self.cache.length = width
        self.next = torch.tensor([[len(p)] for p in self.prompts], device=self.seen.device)
        return torch.stack(logits)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.seen.device)
        self.cache.select_rows(index)
        self.seen, self.next = self.seen[index], self.next[index]

    def step(self, tokens: list[int]) -> torch.Tensor:
        start = self.cache.length
        self.cache.reserve(start + 1)
        if self.seen.shape[1] < self.cache.capacity:
            self.seen = torch.cat([self.seen, self.seen.new_zeros((self.seen.shape[0], GROW))], dim=1)
        self.seen[:, start] = True
        ids = torch.tensor(tokens, device=self.seen.device)[:, None]
        logits, _ = self.decoder.forward(ids, self.next, self.cache, start, self.seen[:, None, None, :], batched=True)
        self.cache.length = start + 1
        self.next = self.next + 1
        return logits[:, -1].float()


class _TransformersRows:
    def __init__(self, model, prompts: list[list[int]], pad_id: int):
        from transformers import DynamicCache  # lazy: transformers loads only where the fallback runs

        self.model = model
        device = model.get_input_embeddings().weight.device
        ids, seen = _left_padded(prompts, pad_id)
        self.ids, self.mask = ids.to(device), seen.long().to(device)
        self.cache = DynamicCache()

    def start(self) -> torch.Tensor:
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = positions[:, -1] + 1
        return out.logits[:, -1].float()

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next = self.mask[index], self.next[index]

    def step(self, tokens: list[int]) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=torch.tensor(tokens, device=self.mask.device)[:, None], attention_mask=self.mask,
                         position_ids=self.next[:, None], past_key_values=self.cache, use_cache=True)
        self.next = self.next + 1
        return out.logits[:, -1].float()
