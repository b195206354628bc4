"""Many rows at once: the captured states of a batch (precompute) and batched decoding (regenerate).

Both run on the native decoder when the model allows it and on transformers' forward otherwise, with the
same results up to float rounding.

Decoding left-pads the prompts, so every row's next token lands in the same cache column; each row's
positions count from its own first token and its keys never see another row's padding. A row that stops
leaves the batch (its cache rows are dropped), so a long answer does not keep short ones computing.
"""

from __future__ import annotations

from typing import Callable

import torch

from mtptrain.runtime.cache import KVCache
from mtptrain.runtime.choice import causal_mask
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


class _NativeRows:
    def __init__(self, decoder, prompts: list[list[int]], budget: int):
        self.decoder = decoder
        ids, self.seen = _left_padded(prompts, 0)
        device = decoder.device
        self.ids, self.seen = ids.to(device), self.seen.to(device)
        self.positions = (self.seen.long().cumsum(-1) - 1).clamp(min=0)
        d = decoder
        self.cache = KVCache(d.num_layers, len(prompts), d.kv_heads, d.head_dim, ids.shape[1] + budget, d.cache_dtype,
                             device)

    def start(self) -> torch.Tensor:
        width = self.ids.shape[1]
        causal = causal_mask(width, 0, self.ids.device)
        # A padding query sees itself, so that no row of the softmax is empty; nothing reads its output.
        mask = (causal & self.seen[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.ids.device)
        logits, _ = self.decoder.forward(self.ids, self.positions, self.cache, 0, mask[:, None], last_only=True)
        self.cache.length = width
        self.next = self.positions[:, -1:] + 1
        return logits[:, -1].float()

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.seen.device)
        self.cache.select_rows(index)
        self.seen, self.next = self.seen[index], self.next[index]

    def step(self, tokens: list[int]) -> torch.Tensor:
        start = self.cache.length
        self.seen = torch.cat([self.seen, torch.ones_like(self.seen[:, :1])], dim=1)
        ids = torch.tensor(tokens, device=self.seen.device)[:, None]
        logits, _ = self.decoder.forward(ids, self.next, self.cache, start, self.seen[:, None, None, :])
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
