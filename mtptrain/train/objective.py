"""The training objective of each head family, on one padded batch.

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

import torch

from mtptrain.heads.losses import DistillStats, distill_loss, feature_loss


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


def _target_mask(loss_mask: torch.Tensor, position: int, length: int) -> torch.Tensor:
    """loss_mask[t + 1 + position] for t < length, zero beyond the sample."""
    shifted = loss_mask[:, 1 + position :]
    return torch.nn.functional.pad(shifted, (0, length - shifted.shape[1]))[:, :length]


def _given(logits: torch.Tensor) -> torch.Tensor:
    """The target's logits when they were computed ahead (distill_loss takes a function of its input)."""
    return logits


def batch_objective(head, batch: dict, last_layer: int, feature_layers: list[int], weights: list[float],
                    feature_weight: float, ttt_steps: int, chunk: int) -> BatchResult:
    ids, mask = batch["input_ids"], batch["loss_mask"]
    last = batch["hidden"][last_layer]
    if head.kind == "eagle":
        out = head(head.features(last[:, :-1]), ids[:, 1:])
        target = last[:, 1:]
        m = _target_mask(mask, 1, out.shape[1])
        stats = distill_loss(head.logits, head.frozen.target_logits, out, target, m, chunk)
        regression = feature_loss(out, head.features(target), m)
        return BatchResult(weights[0] * stats.loss + feature_weight * regression, [stats])
    if head.kind == "mtp":
        outputs = head(last, ids)
        logits = [lambda x, d=depth: head.logits(x, d) for depth in range(1, len(outputs) + 1)]
    else:
        fused = head.fuse([batch["hidden"][layer] for layer in feature_layers])
        outputs = head.unroll(fused, ids, ttt_steps)
        logits = [head.logits] * len(outputs)
    eagle3 = head.kind == "eagle3"
    if eagle3:
        # Distilled over the draft vocabulary, scored against the target's full-vocabulary choice. Both come
        # from one pass of the target's LM head over the batch; each TTT step reads a shifted slice.
        top, table = head.target_tables(last, chunk)
        target_logits = _given
    else:
        top, table, target_logits = None, last, head.frozen.target_logits
    result = BatchResult(last.new_zeros((), dtype=torch.float32))
    for position, (out, to_logits) in enumerate(zip(outputs, logits), start=1):
        m = _target_mask(mask, position, out.shape[1])
        width = slice(position, position + out.shape[1])
        stats = distill_loss(to_logits, target_logits, out, table[:, width], m, chunk,
                             to_target=head.to_target if eagle3 else None,
                             target_top=top[:, width] if eagle3 else None)
        result.loss = result.loss + weights[position - 1] * stats.loss
        result.positions.append(stats)
    return result
