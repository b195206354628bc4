"""Drafting with a trained EAGLE / EAGLE-3 head, one token at a time, reading its own outputs.

Index shift (as in training): the head at position t reads (feature_t,
x_{t+1}) and predicts feature_{t+1} and x_{t+2}. With committed tokens
x_0 .. x_{L-1} (x_{L-1} pending, not yet run through the target), the target
has produced h_0 .. h_{L-2}. The head's cache holds positions 0 .. L-2 built
from those true states. Its output at L-2 gives draft d_1. Drafting on, it
reads its own predicted feature with d_1 at position L-1, and so on.

After verification the head's cache is cut back to the true prefix, and the
head is re-run over the newly committed tokens with the target's real states
from the verification forward. That replaces the entries it had built from its
own guesses, so every draft round starts from exact features.

What the proposer asks of the head (mtptrain/heads/eagle.py, eagle3.py):
`stepper(spec)`, its steps over a KV cache on the runtime's kernels
(mtptrain/heads/fast.py), which also give the feature it drafts from out of
the target's captured states (`draft_input`) and its logits; and, for a
reduced draft vocabulary, `draft_to_target`. The head's family (mtptrain/heads/family.py)
picks this proposer for it.
"""

from __future__ import annotations

import torch

from mtptrain.engine.proposer import ProposerBase, common_prefix
from mtptrain.engine.verify import DraftProbs, Sampling, chosen_probability, distribution, draw, greedy_choice


class HeadChainProposer(ProposerBase):
    name = "head-chain"
    reads_states = True  # it carries the target's states over, as EAGLE and MTP heads do

    def __init__(self, head, spec, sampling: Sampling = Sampling(), seed: int = 0, stop: float = 0.0,
                 int8: bool = False):
        """stop > 0: the chain ends early once the product of the head's probabilities for its drafts so far
        falls below it (the first token is always drafted); 0: always the K tokens asked for. int8: the head
        drafts from int8 copies of its weights (heads/fast.py, HeadStepper)."""
        self.head, self.spec, self.sampling, self.stop = head.eval(), spec, sampling, stop
        # a copy of the head's layer weights: the head as it is now
        self.stepper = head.stepper(spec, int8=int8)
        self.generator = torch.Generator().manual_seed(seed)
        self.seen: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        """A new request: the head's cache is cut where the first `observe` starts (0, or what `reusable` kept)."""
        self.seen = list(prompt)  # x_0 .. : the head's position t holds (h_t, x_{t+1}) for t < len(seen) - 1
        self.last_feature = self.last_logits = None

    def reusable(self, prompt: list[int]) -> int:
        """Positions of the head's cache built from true states of the last request that still hold for `prompt`:
        position t reads x_{t+1}, so it holds while x_0 .. x_{t+1} are the prompt's."""
        return max(0, min(common_prefix(self.seen, prompt) - 1, self.stepper.length))

    @torch.inference_mode()
    def observe(self, true_length: int, hidden: dict[int, torch.Tensor], next_tokens: list[int]) -> None:
        """The target ran over positions true_length .. true_length+n-1 with states `hidden` ([n, H]);
        next_tokens are the n tokens that follow them (the committed tokens, the new pending last)."""
        self.stepper.rollback(true_length)
        self.seen[true_length + 1:] = next_tokens
        ids = torch.tensor([next_tokens], device=next(self.head.parameters()).device)
        out = self.stepper.step(self.stepper.draft_input(hidden), ids)
        self.last_feature = out[:, -1:]
        self.last_logits = self.stepper.logits(self.last_feature)[0, -1]

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], DraftProbs | None]:
        draft, probs, columns = [], [], []
        feature, logits = self.last_feature, self.last_logits
        confidence = 1.0
        for step in range(k):
            token, column, q = self._choose(logits)
            draft.append(token)
            probs.append(q)
            columns.append(column)
            if self.stop:
                confidence *= chosen_probability(logits, column, q)
            if step + 1 == k or confidence < self.stop:
                break
            ids = torch.tensor([[token]], device=feature.device)
            feature = self.stepper.step(feature, ids)
            logits = self.stepper.logits(feature)[0, -1]
        if self.sampling.greedy:
            return draft, None
        return draft, DraftProbs(torch.stack(probs), columns, getattr(self.head, "draft_to_target", None))

    def _choose(self, logits: torch.Tensor) -> tuple[int, int, torch.Tensor | None]:
        """A draft token in target ids, its column in the head's logits, and the drafter's distribution over
        them (a draft vocabulary's: verification reads it through the vocabulary's target ids)."""
        to_target = getattr(self.head, "draft_to_target", None)
        if self.sampling.greedy:
            choice = greedy_choice(logits)
            return (int(to_target[choice]) if to_target is not None else choice), choice, None
        q = distribution(logits, self.sampling)
        choice = draw(q, self.generator)
        return (int(to_target[choice]) if to_target is not None else choice), choice, q
