"""Drafting with DeepSeek-style MTP modules: depth j proposes the j-th draft token.

As in training (heads/mtp.py), depth j at position t reads h^{j-1}_t (h^0 is
the target's state) and the token x_{t+j}, and predicts x_{t+j+1}. With
committed tokens x_0 .. x_{L-1} (x_{L-1} pending) the target has produced
h_0 .. h_{L-2}, and every depth drafts at the last of those positions,
t = L-2: depth 1 reads x_{L-1} and proposes d_1 = x_L, depth 2 reads d_1 and
proposes d_2, and so on. A head with D depths drafts at most D tokens.

Each depth keeps its own cache and the states it produced. Depth j holds the
positions whose token x_{t+j} is committed (t <= L-1-j), all built from true
states. While drafting, depth j first runs over positions L-j .. L-2 with the
draft tokens standing in for the uncommitted ones; the next observe cuts those
entries off and re-runs the positions that became committed with the true
tokens.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from mtptrain.engine.proposer import ProposerBase
from mtptrain.engine.verify import Sampling, choose, chosen_probability


class MTPChainProposer(ProposerBase):
    name = "mtp-chain"
    reads_states = True  # it carries the target's states over, as EAGLE and MTP heads do

    def __init__(self, head, spec, sampling: Sampling = Sampling(), seed: int = 0, stop: float = 0.0):
        """stop: as the head chain's (engine/head_chain.py), over the depths' probabilities."""
        self.head, self.spec, self.sampling, self.stop = head.eval(), spec, sampling, stop
        self.generator = torch.Generator().manual_seed(seed)
        self.depths = head.depths

    def reset(self, prompt: list[int]) -> None:
        self.tokens: list[int] = list(prompt[:1])  # the committed tokens, pending last
        self.caches = [DynamicCache() for _ in range(self.depths)]
        self.states: list[torch.Tensor | None] = [None] * (self.depths + 1)  # [n_j, H] per depth; 0 = target

    def _count(self, depth: int) -> int:
        states = self.states[depth]
        return 0 if states is None else states.shape[0]

    @torch.inference_mode()
    def observe(self, true_length: int, hidden: dict[int, torch.Tensor], next_tokens: list[int]) -> None:
        """The target ran over positions true_length .. true_length+n-1 with states `hidden`; next_tokens
        are the n tokens that follow them (the committed tokens, the new pending one last)."""
        dtype = next(self.head.parameters()).dtype
        new = hidden[self.spec.last_layer].to(dtype)
        self.tokens = self.tokens[: true_length + 1] + list(next_tokens)
        kept = self.states[0][:true_length] if self.states[0] is not None else new[:0]
        self.states[0] = torch.cat([kept, new])
        device = new.device
        committed = len(self.tokens)
        for depth in range(1, self.depths + 1):
            done = self._count(depth)
            cache = self.caches[depth - 1]
            if cache.get_seq_length() > done:  # entries built from drafts in the last round
                cache.crop(done - cache.get_seq_length())
            end = min(self._count(depth - 1), committed - depth)  # positions with x_{t+depth} committed
            if end <= done:
                continue
            ids = torch.tensor([self.tokens[done + depth : end + depth]], device=device)
            out = self.head.step(depth, self.states[depth - 1][done:end][None], ids, cache=cache)[0]
            self.states[depth] = out if self.states[depth] is None else torch.cat([self.states[depth], out])

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        last = len(tokens) - 2  # t = L-2, the newest position with a target state
        device = self.states[0].device
        draft, probs = [], []
        fresh: dict[int, torch.Tensor] = {}  # depth -> states at positions beyond its committed ones
        confidence = 1.0
        for depth in range(1, min(k, self.depths) + 1):
            done = self._count(depth)
            if depth > 1:  # run depth over positions done .. last with drafts for the missing tokens
                stored = self.states[depth - 1] if self.states[depth - 1] is not None else self.states[0][:0]
                previous = torch.cat([stored[done:], fresh.get(depth - 1, self.states[0][:0])])
                known = tokens + draft
                ids = torch.tensor([known[done + depth : last + 1 + depth]], device=device)
                fresh[depth] = self.head.step(depth, previous[None], ids, cache=self.caches[depth - 1])[0]
            state = fresh[depth][-1] if depth in fresh else self.states[depth][last]
            logits = self.head.logits(state[None, None], depth)[0, -1]
            token, q = self._choose(logits)
            draft.append(token)
            probs.append(q)
            if self.stop:
                confidence *= chosen_probability(logits, token, q)
                if confidence < self.stop:
                    break
        return draft, None if self.sampling.greedy else torch.stack(probs)

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        return choose(logits, self.sampling, self.generator)
