"""Reference computations for feature-store tests, independent of the precompute code."""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_hidden(model, input_ids, layers: list[int]) -> dict[int, torch.Tensor]:
    """Per-layer hidden states of one unpadded sequence, from transformers' own outputs.

    hidden_states[i + 1] is the output of decoder layer i, except the very last entry, which
    transformers returns after the final norm: the last layer's pre-norm output is taken from
    the input of that norm instead.
    """
    caught = {}
    hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: caught.setdefault("x", args[0]))
    try:
        out = model(torch.as_tensor(input_ids, dtype=torch.long)[None], output_hidden_states=True)
    finally:
        hook.remove()
    last = model.config.num_hidden_layers - 1
    return {i: (caught["x"] if i == last else out.hidden_states[i + 1])[0] for i in layers}


def store_samples(directory, split: str = "train") -> dict[str, dict]:
    from mtptrain.features.store import FeatureStore

    store = FeatureStore(directory, split)
    return {store.keys[i]: store[i] for i in range(len(store))}
