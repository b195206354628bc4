"""The EAGLE-1/2 draft head (Li et al., arXiv:2401.15077), with RMSNorm restoration by default.

Index shift: the target's hidden state at position t, h_t, is what produced
the distribution of token x_{t+1}. The head at position t reads
(h_t, embedding of x_{t+1}) and predicts h_{t+1}, and through the LM head the
distribution of x_{t+2}. Drafting further, it reads its own predicted state in
place of the target's.

Feature space. "restored" (the default) regresses the target's pre-norm
last-layer output, exactly what the feature store holds, and maps it to
logits as the target does: a final RMSNorm, then the frozen LM head.
"stripped" is the original EAGLE placement for the ablation: no norms in the
head, and features taken after the target's final norm, fed straight to the
LM head.

EagleFamily, below, is what the rest of the package asks of the family
(mtptrain/heads/family.py): its spec, objective, drafters and export format.
"""

from __future__ import annotations

import torch
from torch import nn

from mtptrain.heads.common import FrozenTarget, FusionBlock, as_head_input, head_layer_config, rms_norm_like
from mtptrain.heads.fast import Drafting, HeadStepper
from mtptrain.heads.family import EagleStyleFamily
from mtptrain.heads.losses import Loss, feature_loss
from mtptrain.heads.objective import distill_positions, target_mask
from mtptrain.heads.settings import HeadSettings


class EagleHead(nn.Module):
    def __init__(self, target: FrozenTarget, norms: str = "restored"):
        super().__init__()
        self.frozen = target  # a plain attribute: not a submodule, never in state_dict
        self.block = FusionBlock(target, norms, proj_bias=True)  # EAGLE's fc carries a bias
        restored = norms == "restored"
        self.norm = rms_norm_like(target.final_norm, target.config.hidden_size) if restored else nn.Identity()

    @property
    def norms(self) -> str:
        return self.block.norms

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Stored target states (pre-norm) in this head's feature space."""
        if self.norms == "restored":
            return target_hidden
        return self.frozen.normed(target_hidden).to(target_hidden.dtype)

    def draft_input(self, hidden: dict[int, torch.Tensor], spec: HeadSettings) -> torch.Tensor:
        """What the head drafts from, out of the target's captured states (layer -> [n, H]): its last layer's,
        [1, n, H] in the head's feature space."""
        return self.features(as_head_input(hidden[spec.last_layer], self))

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features [B, T, H] at positions t, next_ids [B, T] = x_{t+1}; returns predicted features of t+1."""
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + next_ids.shape[1], device=next_ids.device)[None]
        return self.block(self.frozen.embed_as(next_ids, self), features, position_ids, cache, mask)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        return self.frozen.head_logits(self.norm(predicted))

    def stepper(self, spec: HeadSettings, int8: bool = False) -> HeadStepper:
        """This head's drafting steps on the runtime's kernels (heads/fast.py; `int8`: HeadStepper's)."""
        block = self.block

        def inputs(feature: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            embeds = self.frozen.embed_as(ids, self)
            x = block.proj(torch.cat([block.norm_embed(embeds), block.norm_hidden(feature)], dim=-1))
            return block.layer.input_layernorm(x), x
        return HeadStepper(block.layer, block.rotary, head_layer_config(self.frozen.config),
                           lambda stepper: Drafting(inputs, lambda hidden: self.draft_input(hidden, spec)),
                           lm_head=self.frozen.lm_head, logits_input=self.norm, lm_head_for=self.frozen.lm_head_for,
                           int8=int8)


class EagleFamily(EagleStyleFamily):
    kind = "eagle"
    export_formats = ("eagle",)

    def settings(self, cfg, manifest):
        return {"norms": cfg.norms}

    def feature_weight(self, cfg):
        return cfg.feature_weight

    def build(self, spec, frozen, vocab=None):
        return EagleHead(frozen, norms=spec.norms)

    def draft_positions(self, spec):
        return 1

    def objective(self, head, batch, spec, weights, feature_weight, chunk, loss=Loss()):
        """Distillation at the one draft position, and EAGLE's regression of the next feature."""
        ids, last = batch["input_ids"], batch["hidden"][spec.last_layer]
        out = head(head.features(last[:, :-1]), ids[:, 1:])
        result = distill_positions([out], [head.logits], head.frozen.target_logits, last, batch["loss_mask"],
                                   weights, chunk, loss=loss)
        regression = feature_loss(out, head.features(last[:, 1:]), target_mask(batch["loss_mask"], 1, out.shape[1]))
        result.loss = result.loss + feature_weight * regression
        return result

    def draft_layers(self, spec):
        return [spec.last_layer]


EAGLE = EagleFamily()
