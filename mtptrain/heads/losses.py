"""Training losses for draft heads.

Distillation compares the head's next-token distribution with the target's,
computed from the stored pre-norm last-layer state through the target's own
frozen final norm and LM head. Vocabularies are large (128k for Llama-3), so
logits are made one chunk of positions at a time. Each chunk is
recomputed in backward (activation checkpointing): only one chunk's
[chunk, vocab] logits exist at any moment, in forward and in backward.

    soft cross-entropy  CE(p, q) = -sum_v p_v log q_v
    forward KL          KL(p || q) = CE(p, q) - H(p)   (same gradient in q)

p = target distribution, q = head distribution. The loss minimised is the
soft cross-entropy; KL is reported because it reads as a distance (0 = equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class DistillStats:
    loss: torch.Tensor  # mean soft cross-entropy over masked positions (differentiable)
    kl: float  # mean forward KL(target || head)
    correct: int  # positions where the head's top-1 equals the target's top-1
    count: int  # masked positions


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over a large vocabulary in at least float32."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def _chunk_terms(head_logits: Callable, target_logits: Callable, predicted: torch.Tensor, target_hidden: torch.Tensor):
    with torch.no_grad():
        target_logp = F.log_softmax(_upcast(target_logits(target_hidden)), dim=-1)
        target_p = target_logp.exp()
        entropy = -(target_p * target_logp).sum(-1)
    head_logp = F.log_softmax(_upcast(head_logits(predicted)), dim=-1)
    cross_entropy = -(target_p * head_logp).sum(-1)
    with torch.no_grad():
        tops = torch.stack([head_logp.argmax(-1), target_logp.argmax(-1)])
    return cross_entropy.sum(), (cross_entropy.detach() - entropy).sum(), tops


def distill_loss(head_logits: Callable[[torch.Tensor], torch.Tensor],
                 target_logits: Callable[[torch.Tensor], torch.Tensor],
                 predicted: torch.Tensor, target_hidden: torch.Tensor, mask: torch.Tensor,
                 chunk: int = 1024, to_target: Callable | None = None,
                 target_top: torch.Tensor | None = None, recompute: bool = True) -> DistillStats:
    """predicted [..., H] (head states), target_hidden [..., D] (what `target_logits` turns into the target's
    logits: its states, already index-shifted, or logits computed ahead with `target_logits` the identity),
    mask [...] (1 = counts).

    Top-1 agreement compares the argmax of the two logit sets. A head over a reduced vocabulary passes
    `to_target` (its ids -> target ids) and `target_top` [...] (the target's top-1 over its full vocabulary,
    computed once per batch), so that a target choice outside the draft vocabulary counts as a miss.
    `recompute` False keeps each chunk's logits for backward instead of computing them again (a small draft
    vocabulary, where they are cheap to hold)."""
    keep = mask.reshape(-1).bool()
    predicted = predicted.reshape(-1, predicted.shape[-1])[keep]
    target_hidden = target_hidden.reshape(-1, target_hidden.shape[-1])[keep]
    if target_top is not None:
        target_top = target_top.reshape(-1)[keep]
    count = int(keep.sum())
    if count == 0:
        zero = predicted.sum() * 0.0
        return DistillStats(zero, 0.0, 0, 0)
    ce_total = predicted.new_zeros((), dtype=torch.promote_types(predicted.dtype, torch.float32))
    kl_total, correct = 0.0, 0
    for start in range(0, count, chunk):
        piece = slice(start, start + chunk)
        if recompute and torch.is_grad_enabled() and predicted.requires_grad:
            ce, kl, tops = checkpoint(_chunk_terms, head_logits, target_logits, predicted[piece], target_hidden[piece],
                                      use_reentrant=False)
        else:
            ce, kl, tops = _chunk_terms(head_logits, target_logits, predicted[piece], target_hidden[piece])
        ce_total = ce_total + ce
        kl_total += float(kl)
        if to_target is None:
            correct += int((tops[0] == tops[1]).sum())
        else:
            correct += int((to_target(tops[0]) == target_top[piece]).sum())
    return DistillStats(ce_total / count, kl_total / count, correct, count)


def feature_loss(predicted: torch.Tensor, target_features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smooth L1 between predicted and true features, mean over masked positions (EAGLE's regression term)."""
    per_position = F.smooth_l1_loss(predicted.float(), target_features.float(), reduction="none").mean(-1)
    weights = mask.to(per_position.dtype)
    return (per_position * weights).sum() / weights.sum().clamp_min(1.0)
