"""Training losses for draft heads.

Distillation compares the head's next-token distribution with the target's,
computed from the stored pre-norm last-layer state through the target's own
frozen final norm and LM head. Vocabularies are large (128k for Llama-3), so
logits are made one chunk of positions at a time. Each chunk is
recomputed in backward (activation checkpointing): only one chunk's
[chunk, vocab] logits exist at any moment, in forward and in backward.

    soft cross-entropy  CE(p, q) = -sum_v p_v log q_v
    forward KL          KL(p || q) = CE(p, q) - H(p)   (same gradient in q)

p = target distribution, q = head distribution. KL is reported because it reads
as a distance (0 = equal).

What is minimised (`Loss.kind`):

    kl         the soft cross-entropy (forward KL's gradient); the default
    tv         1 - alpha, with alpha = sum_v min(p_v, q_v) = 1 - TV(p, q): the
               probability that speculative sampling accepts a token drawn
               from q (Leviathan et al., arXiv:2211.17192), so TV is the loss
               of acceptance itself; its gradient fades where alpha is small
    lk         -log alpha: TV's gradient scaled by 1 / alpha, usable from a
               cold start (the LK losses in vLLM's speculators documentation)
    lk-hybrid  l * KL + (1 - l) * (1 - alpha) with l = exp(-eta * alpha), alpha
               held constant in l: KL while the head is far from the target,
               TV as acceptance grows (the same documentation's adaptive blend)

alpha is reported for every kind: the head's expected acceptance at
temperature 1 at that draft position, given the positions before it.

`Loss.reachable` scores draft position p only where positions 1..p-1 drafted
the target's own choices: the only places a greedy chain ever drafts position p
from (the token-alignable training of GRIFFIN, Hu et al., arXiv:2502.11018).
Each position's loss is then the mean over its reachable places; the metrics
stay over every place, so that runs with and without it compare.

`Loss.topk` adds topk_weight x (-sum over the target's K most likely tokens of
p_v log q_v) to each position's loss: those tokens' share of the
cross-entropy counted again, so that the head spends its capacity on ranking
the tokens a draft can be accepted on (the top-K term of HASS's harmonized
objective distillation, Zhang et al., arXiv:2408.15766).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


LOSS_KINDS = ("kl", "tv", "lk", "lk-hybrid")
ALPHA_FLOOR = 1e-5  # lk: -log alpha is bounded where the head gives the target's tokens no mass at all


@dataclass(frozen=True)
class Loss:
    """What distillation minimises per position (module docstring); eta is lk-hybrid's blend rate."""

    kind: str = "kl"
    eta: float = 3.0
    reachable: bool = False  # position p scored only where positions 1..p-1 drafted the target's choices
    topk: int = 0  # > 0: the target's top-k tokens' cross-entropy added, times topk_weight
    topk_weight: float = 1.0

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r}: the losses are {', '.join(LOSS_KINDS)}")

    def per_position(self, cross_entropy: torch.Tensor, entropy: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        if self.kind == "kl":
            return cross_entropy
        if self.kind == "tv":
            return 1.0 - alpha
        if self.kind == "lk":
            return -torch.log(alpha.clamp_min(ALPHA_FLOOR))
        blend = torch.exp(-self.eta * alpha.detach())
        return blend * (cross_entropy - entropy) + (1.0 - blend) * (1.0 - alpha)


@dataclass
class DistillStats:
    """One draft position's loss and metrics. The metrics stay tensors on the loss's device (float64, int64): the
    trainer adds them up there and reads them on the host once per log, not once per chunk and position."""

    loss: torch.Tensor  # mean loss (Loss.kind) over masked positions (differentiable)
    kl: torch.Tensor  # mean forward KL(target || head)
    correct: torch.Tensor  # positions where the head's top-1 equals the target's top-1
    count: int  # masked positions
    alpha: torch.Tensor | float = 0.0  # mean sum_v min(p_v, q_v): the expected acceptance at temperature 1
    hits: torch.Tensor | None = None  # loss.reachable: [...] as the mask, 1 where the head's top-1 is the target's


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over a large vocabulary in at least float32."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def _chunk_terms(head_logits: Callable, target_logits: Callable, predicted: torch.Tensor, target_hidden: torch.Tensor,
                 loss: Loss, weight: torch.Tensor | None = None):
    with torch.no_grad():
        target_logp = F.log_softmax(_upcast(target_logits(target_hidden)), dim=-1)
        target_p = target_logp.exp()
        entropy = -(target_p * target_logp).sum(-1)
    head_logp = F.log_softmax(_upcast(head_logits(predicted)), dim=-1)
    cross_entropy = -(target_p * head_logp).sum(-1)
    if loss.kind == "kl" or not torch.is_grad_enabled():
        # A metric only: in place, since a fresh [chunk, vocabulary] temporary costs more than the arithmetic on
        # a CPU (1024 x 8192 float32: 4.3 ms against 12.7 ms out of place, on a 2-core AMD EPYC).
        with torch.no_grad():
            probs = head_logp.exp()
            alpha = torch.minimum(probs, target_p, out=probs).sum(-1)
    else:
        alpha = torch.minimum(head_logp.exp(), target_p).sum(-1)
    with torch.no_grad():
        tops = torch.stack([head_logp.argmax(-1), target_logp.argmax(-1)])
    value = loss.per_position(cross_entropy, entropy, alpha)
    if loss.topk:
        top_p, top_ids = target_p.topk(min(loss.topk, target_p.shape[-1]), dim=-1)
        value = value - loss.topk_weight * (top_p * head_logp.gather(-1, top_ids)).sum(-1)
    value = value.sum() if weight is None else (value * weight.to(value.dtype)).sum()
    return (value, (cross_entropy.detach() - entropy).sum(),
            alpha.detach().sum(), tops)


def distill_loss(head_logits: Callable[[torch.Tensor], torch.Tensor],
                 target_logits: Callable[[torch.Tensor], torch.Tensor],
                 predicted: torch.Tensor, target_hidden: torch.Tensor, mask: torch.Tensor,
                 chunk: int = 1024, to_target: Callable | None = None,
                 target_top: torch.Tensor | None = None, recompute: bool = True, loss: Loss = Loss(),
                 weight: torch.Tensor | None = None) -> DistillStats:
    """predicted [..., H] (head states), target_hidden [..., D] (what `target_logits` turns into the target's
    logits: its states, already index-shifted, or logits computed ahead with `target_logits` the identity),
    mask [...] (1 = counts), best left on the host: which positions count is shape information (how many chunks,
    which rows), read there without waiting for the device; a mask on the device is read once.

    Top-1 agreement compares the argmax of the two logit sets. A head over a reduced vocabulary passes
    `to_target` (its ids -> target ids) and `target_top` [...] (the target's top-1 over its full vocabulary,
    computed once per batch), so that a target choice outside the draft vocabulary counts as a miss.
    `recompute` False keeps each chunk's logits for backward instead of computing them again (a small draft
    vocabulary, where they are cheap to hold). `loss` is what is minimised (Loss). `weight` [...] (on the device,
    0 or 1) keeps only some of the masked positions in the loss, which is then their mean; the metrics and `hits`
    (kept for `loss.reachable` only: the next position's weight) cover every masked position."""
    shape = mask.shape
    rows = mask.reshape(-1).bool().cpu().nonzero().squeeze(1)
    count = len(rows)
    rows = rows.to(predicted.device, non_blocking=True)
    if weight is not None:
        weight = weight.reshape(-1).to(predicted.device).index_select(0, rows)
    predicted = predicted.reshape(-1, predicted.shape[-1]).index_select(0, rows)
    target_hidden = target_hidden.reshape(-1, target_hidden.shape[-1]).index_select(0, rows.to(target_hidden.device))
    if target_top is not None:
        target_top = target_top.reshape(-1).index_select(0, rows.to(target_top.device))
    metric = predicted.new_zeros((), dtype=torch.float64)
    hits = torch.zeros(shape, dtype=torch.bool, device=predicted.device) if loss.reachable else None
    if count == 0:
        return DistillStats(predicted.sum() * 0.0, metric, metric.long(), 0, metric, hits)
    total = predicted.new_zeros((), dtype=torch.promote_types(predicted.dtype, torch.float32))
    kl_total, alpha_total, chunk_hits = metric, metric, []
    for start in range(0, count, chunk):
        piece = slice(start, start + chunk)
        w = weight[piece] if weight is not None else None
        if recompute and torch.is_grad_enabled() and predicted.requires_grad:
            value, kl, alpha, tops = checkpoint(_chunk_terms, head_logits, target_logits, predicted[piece],
                                                target_hidden[piece], loss, w, use_reentrant=False)
        else:
            value, kl, alpha, tops = _chunk_terms(head_logits, target_logits, predicted[piece], target_hidden[piece],
                                                  loss, w)
        total = total + value
        kl_total = kl_total + kl.double()
        alpha_total = alpha_total + alpha.double()
        if to_target is None:
            chunk_hits.append(tops[0] == tops[1])
        else:
            chunk_hits.append(to_target(tops[0]) == target_top[piece].to(tops.device))
    hit = torch.cat(chunk_hits)
    if hits is not None:
        hits.view(-1)[rows] = hit
    scored = count if weight is None else weight.sum().clamp_min(1.0)
    return DistillStats(total / scored, kl_total / count, hit.sum(), count, alpha_total / count, hits)


def feature_loss(predicted: torch.Tensor, target_features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smooth L1 between predicted and true features, mean over masked positions (EAGLE's regression term); the
    mask on the host or the device."""
    per_position = F.smooth_l1_loss(predicted.float(), target_features.float(), reduction="none").mean(-1)
    weights = mask.to(per_position.device, per_position.dtype, non_blocking=True)
    return (per_position * weights).sum() / weights.sum().clamp_min(1.0)
