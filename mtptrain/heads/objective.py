"""The training objective's bookkeeping, shared by every head family; each family's own part is its
`objective` (mtptrain/heads/family.py), on one padded batch.

Every draft position p (EAGLE step, MTP depth, EAGLE-3 TTT step) is scored
against the target's own distribution at the matching position, and counted
only where the token it predicts is an assistant token (loss_mask of that
token). Index bookkeeping, for a sample of T tokens x_0..x_{T-1} with target
states h_0..h_{T-1} (h_t produced the distribution of x_{t+1}):

    eagle            position t reads (h_t, x_{t+1}); predicts x_{t+2}; matched to h_{t+1}
    mtp depth k      position t reads (h^{k-1}_t, x_{t+k}); predicts x_{t+k+1}; matched to h_{t+k}
    eagle3 step j    position t reads (f^j_t, x_{t+1+j}); predicts x_{t+2+j}; matched to h_{t+1+j}

so draft position p (1-based) at t predicts x_{t+1+p} and is matched to
h_{t+p}, with mask loss_mask[t+1+p] (0 past the end of the sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mtptrain.heads.losses import DistillStats, Loss, distill_loss


@dataclass
class BatchResult:
    loss: torch.Tensor
    positions: list[DistillStats] = field(default_factory=list)  # one per draft position, 1-based order


def step_weights(spec: list[float] | str, positions: int) -> list[float]:
    if spec == "auto":
        return [0.8**p for p in range(positions)]
    if len(spec) != positions:
        raise ValueError(f"head.step_weights has {len(spec)} entries for {positions} draft positions")
    return list(spec)


def target_mask(loss_mask: torch.Tensor, position: int, length: int) -> torch.Tensor:
    """loss_mask[t + 1 + position] for t < length, zero beyond the sample."""
    shifted = loss_mask[:, 1 + position :]
    return torch.nn.functional.pad(shifted, (0, length - shifted.shape[1]))[:, :length]


def given(logits: torch.Tensor) -> torch.Tensor:
    """The target's logits when they were computed ahead (distill_loss takes a function of its input)."""
    return logits


def distill_positions(outputs: list[torch.Tensor], logits: list[Callable], target_logits: Callable,
                      table: torch.Tensor, loss_mask: torch.Tensor, weights: list[float], chunk: int,
                      to_target: Callable | None = None, target_top: torch.Tensor | None = None,
                      recompute: bool = True, loss: Loss = Loss()) -> BatchResult:
    """Distillation at every draft position: outputs[p - 1] [B, T_p, H] (the head's states of position p, which
    `logits[p - 1]` turns into its logits) against the target's at h_{t+p}, read from `table` [B, T, ...] through
    `target_logits`, weighted by weights[p - 1]. `to_target`, `target_top` and `recompute` as in distill_loss (a
    head over a reduced vocabulary); `loss` is what is minimised."""
    result = BatchResult(table.new_zeros((), dtype=torch.float32))
    reached = None  # loss.reachable: [B, T_p] 1 where positions 1..p-1 drafted the target's choices
    for position, (out, to_logits) in enumerate(zip(outputs, logits), start=1):
        m = target_mask(loss_mask, position, out.shape[1])
        width = slice(position, position + out.shape[1])
        weight = reached[:, : out.shape[1]] if reached is not None else None
        stats = distill_loss(to_logits, target_logits, out, table[:, width], m, chunk, to_target=to_target,
                             target_top=target_top[:, width] if target_top is not None else None,
                             recompute=recompute, loss=loss, weight=weight)
        result.loss = result.loss + weights[position - 1] * stats.loss
        result.positions.append(stats)
        if loss.reachable:  # column t of position p+1 extends the chain of column t of position p
            hits = stats.hits.to(torch.float32)
            reached = hits if reached is None else reached[:, : hits.shape[1]] * hits
    return result
