"""DeepSeek-V3 style multi-token prediction modules (DeepSeek-AI, arXiv:2412.19437, section 2.2).

Depth k (1-based) at position t reads the previous depth's hidden state at t
(for k = 1, the target's own h_t) and the embedding of x_{t+k}, and predicts
x_{t+k+1}:

    h^k_t = block_k(eh_proj([enorm(emb(x_{t+k})) ; hnorm(h^{k-1}_t)]))
    p(x_{t+k+1}) = softmax(lm_head(head_norm_k(h^k_t)))

The modules are chained: one per depth, or (share=True) one module, with its
output norm, reused at every depth. The output norm is DeepSeek's
shared_head.norm; "shared" refers to the LM head, which is the target's.

What h^0 is. `target_input="normed"` (the recipe default) reads the target's
last-layer state after its final RMSNorm: what vLLM and SGLang hand an MTP
layer (the model's output hidden states), so an exported head reads the same
kind of state it was trained on. (vLLM also zeroes the embedding at position 0
of a sequence; the head does not.) `"raw"` reads the pre-norm residual stream,
the stored feature itself; heads saved before the option existed are raw.

MTPFamily, at the end, is what the rest of the package asks of the family
(mtptrain/heads/family.py): its spec, objective, chain drafter (and why it has
no tree or SSD drafter) and export format.
"""

from __future__ import annotations

import torch
from torch import nn

from mtptrain.engine.mtp_chain import MTPChainProposer
from mtptrain.engine.verify import Sampling
from mtptrain.heads.common import FrozenTarget, FusionBlock, rms_norm_like
from mtptrain.heads.family import ChainLimit, HeadFamily
from mtptrain.heads.losses import Loss
from mtptrain.heads.objective import distill_positions


class MTPHead(nn.Module):
    def __init__(self, target: FrozenTarget, depths: int = 1, share: bool = False, norms: str = "restored",
                 target_input: str = "normed"):
        super().__init__()
        if depths < 1:
            raise ValueError("an MTP head needs at least one depth")
        if target_input not in ("normed", "raw"):
            raise ValueError(f"target_input must be 'normed' or 'raw', not {target_input!r}")
        self.target_input = target_input
        self.frozen = target  # a plain attribute: not a submodule, never in state_dict
        self.depths = depths
        modules = 1 if share else depths
        hidden = target.config.hidden_size
        self.blocks = nn.ModuleList(FusionBlock(target, norms, proj_bias=False) for _ in range(modules))
        self.head_norms = nn.ModuleList(
            rms_norm_like(target.final_norm, hidden) if norms == "restored" else nn.Identity() for _ in range(modules))

    def _index(self, depth: int) -> int:
        if not 1 <= depth <= self.depths:
            raise ValueError(f"depth {depth} outside 1..{self.depths}")
        return min(depth, len(self.blocks)) - 1

    def step(self, depth: int, previous: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
             cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One depth: previous [B, T, H] (h^{depth-1} at positions t; the target's stored states for depth 1),
        token_ids = x_{t+depth}."""
        if depth == 1 and self.target_input == "normed":
            previous = self.frozen.normed(previous).to(previous.dtype)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + token_ids.shape[1], device=token_ids.device)[None]
        return self.blocks[self._index(depth)](self.frozen.embed_as(token_ids, self), previous, position_ids, cache, mask)

    def forward(self, target_hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced training pass over whole sequences.

        target_hidden [B, T, H] and input_ids [B, T] of the same samples. Depth k
        returns states for positions t = 0 .. T-k-1 (the ones with x_{t+k} known),
        so output k has length T - k.
        """
        length = input_ids.shape[1]
        outputs = []
        previous = target_hidden
        for depth in range(1, self.depths + 1):
            previous = self.step(depth, previous[:, : length - depth], input_ids[:, depth:])
            outputs.append(previous)
        return outputs

    def logits(self, predicted: torch.Tensor, depth: int) -> torch.Tensor:
        return self.frozen.head_logits(self.head_norms[self._index(depth)](predicted))


class MTPFamily(HeadFamily):
    kind = "mtp"
    export_formats = ("deepseek-mtp",)
    no_tree = "MTP heads draft chains only; use an eagle or eagle3 head for trees"
    no_ssd = ("an MTP head drafts all its depths from one target state, so there is nothing to pre-draft per "
              "outcome; use an eagle or eagle3 head, or ssd-draft")

    def settings(self, cfg, manifest):
        return {"norms": cfg.norms, "mtp_depths": cfg.mtp_depths, "mtp_share": cfg.mtp_share,
                "mtp_input": cfg.mtp_input}

    def build(self, spec, frozen, vocab=None):
        return MTPHead(frozen, depths=spec.mtp_depths, share=spec.mtp_share, norms=spec.norms,
                       target_input=spec.mtp_input)

    def draft_positions(self, spec):
        return spec.mtp_depths

    def objective(self, head, batch, spec, weights, feature_weight, chunk, loss=Loss()):
        """Distillation at every depth, each through its own output norm."""
        last = batch["hidden"][spec.last_layer]
        outputs = head(last, batch["input_ids"])
        logits = [lambda x, d=depth: head.logits(x, d) for depth in range(1, len(outputs) + 1)]
        return distill_positions(outputs, logits, head.frozen.target_logits, last, batch["loss_mask"], weights, chunk,
                                 loss=loss)

    def draft_layers(self, spec):
        return [spec.last_layer]

    def chain(self, head, spec, sampling=Sampling(), seed=0, stop=0.0, int8=False):
        if int8:
            raise ValueError(f"{self.kind} heads draft from their own weights only: {self.no_int8}")
        return MTPChainProposer(head, spec, sampling, seed, stop)

    def chain_limit(self, spec):
        depths = spec.mtp_depths
        return ChainLimit(depths, f"an MTP head with {depths} depths drafts at most {depths} tokens")

    def facts(self, spec):
        return [f"- {spec.mtp_depths} depth(s){', one shared module' if spec.mtp_share else ''}; depth 1 reads the "
                f"target's {'final-normed' if spec.mtp_input == 'normed' else 'pre-norm'} state"]


MTP = MTPFamily()
