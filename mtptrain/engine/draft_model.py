"""Drafting with a small causal LM that shares the target's tokenizer.

The draft model keeps its own KV cache over the committed text. Before each
round the cache is cut back to the longest prefix it shares with the
committed tokens, then brought up to date, so tokens it drafted and the target
rejected leave no trace.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from mtptrain.engine.proposer import ProposerBase, common_prefix
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.verify import Sampling, choose


class DraftModelProposer(ProposerBase):
    name = "draft-model"

    def __init__(self, source, sampling: Sampling = Sampling(), seed: int = 0):
        """`source`: the draft model's runtime decoder (`runtime.runner.load_decoder`, or a decoder's `truncated`
        layers), built once for every proposer of a run, or the model itself (its decoder built here)."""
        self.runner = open_runner(source)
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self, prompt: list[int]) -> None:
        self.runner.reset()

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        common = common_prefix(self.runner.tokens, tokens, len(tokens) - 1)  # the newest always runs, for its logits
        self.runner.rollback(common)
        logits = self.runner.forward(tokens[common:])[-1]
        draft, probs = [], []
        for step in range(k):
            token, q = self._choose(logits)
            draft.append(token)
            probs.append(q)
            if step + 1 < k:
                logits = self.runner.forward([token])[-1]
        return draft, None if self.sampling.greedy else torch.stack(probs)

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        return choose(logits, self.sampling, self.generator)


def truncated_target(model: nn.Module, layers: int) -> nn.Module:
    """The target cut to its first `layers` decoder layers, sharing every weight (nothing is copied).

    A free draft model: same tokenizer, same embedding, final norm and LM head.
    """
    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"a truncated target keeps 1..{total - 1} of its {total} layers, not {layers}")
    draft = copy.copy(model)  # shallow: submodules are shared until replaced below
    draft._modules = dict(model._modules)
    decoder = copy.copy(model.get_decoder())
    decoder._modules = dict(decoder._modules)
    decoder.layers = nn.ModuleList(list(decoder.layers)[:layers])
    draft.config = copy.copy(model.config)
    draft.config.num_hidden_layers = layers
    decoder.config = draft.config
    draft._modules[model.base_model_prefix] = decoder
    return draft
