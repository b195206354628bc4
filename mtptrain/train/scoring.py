"""Teacher-forced scoring of a head: the loss, KL, acceptance and top-1 agreement per draft position, summed on
the device between two logging steps (`Window`), over a whole store (`score_store`: the trainer's validation,
benchmarks/head_agreement.py), and the batches moved to the device for it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as torch_dist

from mtptrain.dist import DistInfo
from mtptrain.features.store import FeatureStore
from mtptrain.features.stores import FeatureStores
from mtptrain.heads.losses import Loss
from mtptrain.heads.spec import HeadSpec
from mtptrain.train.data import loader


def nonfinite(value: torch.Tensor) -> torch.Tensor:
    """1.0 where `value` (a loss, a norm) is NaN or infinite, else 0.0: a flag on the device, added up there."""
    return (~torch.isfinite(value.detach())).float()


class Window:
    """Loss and top-1 agreement per draft position, accumulated between two logging steps: the sums on the
    device (the metrics come as tensors there, `DistillStats`), the counts on the host; `reduce` reads them once."""

    def __init__(self, positions: int, device: torch.device | str = "cpu"):
        self.positions = positions
        # per position: loss x count, KL x count, alpha x count, correct; then the objective's sum
        self.sums = torch.zeros(4 * positions + 1, dtype=torch.float64, device=device)
        self.counts = [0] * positions + [0]  # masked positions per position; then micro-batches

    def add(self, result) -> None:
        values = []
        for p, stats in enumerate(result.positions):
            values += [stats.loss.detach().double() * stats.count, stats.kl * stats.count, stats.alpha * stats.count,
                       stats.correct]
            self.counts[p] += stats.count
        values.append(result.loss.detach())
        self.sums += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.sums.device) for v in values])
        self.counts[-1] += 1

    def reduce(self, dist: DistInfo | None) -> dict:
        sums = torch.cat([self.sums, torch.tensor(self.counts, dtype=torch.float64).to(self.sums.device)])
        if dist is not None and dist.world_size > 1:  # on the device: NCCL reduces only CUDA tensors
            torch_dist.all_reduce(sums)
        sums = sums.tolist()
        self.sums.zero_()
        self.counts = [0] * len(self.counts)
        sums, counts = sums[: 4 * self.positions + 1], sums[4 * self.positions + 1:]
        out = {"train/loss": sums[-1] / max(counts[-1], 1)}
        for p in range(self.positions):
            (loss, kl, alpha, correct), count = sums[4 * p : 4 * p + 4], counts[p]
            out[f"train/loss_{p + 1}"] = loss / max(count, 1)
            out[f"train/kl_{p + 1}"] = kl / max(count, 1)
            out[f"train/alpha_{p + 1}"] = alpha / max(count, 1)
            out[f"train/acc_{p + 1}"] = correct / max(count, 1)
        return out


@torch.no_grad()
def score_store(head, spec: HeadSpec, store: FeatureStore | FeatureStores, batch_size: int, weights: list[float],
                feature_weight: float, loss_chunk: int, device: torch.device, dtype: torch.dtype,
                dist: DistInfo | None = None, loss: Loss = Loss(),
                keep: Callable[[torch.Tensor], torch.Tensor] | None = None, multiple: int = 1) -> Window:
    """Teacher-forced loss and top-1 agreement of `head` over every sample of `store` (with `dist`, this rank's
    share of the batches); reduce the returned window for the numbers. `keep` maps a batch's loss mask [B, T] to
    the one scored (a subset of its tokens: benchmarks/head_agreement.py scores each answer's first tokens).
    `multiple`: batches padded to a multiple of it (train.pad_multiple)."""
    window = Window(spec.draft_positions, device)
    batches = [list(range(i, min(i + batch_size, len(store)))) for i in range(0, len(store), batch_size)]
    if dist is not None:
        batches = batches[dist.rank :: dist.world_size]
    for batch in loader(store, batches, 0, multiple=multiple):
        if keep is not None:
            batch["loss_mask"] = keep(batch["loss_mask"])
        window.add(spec.family.objective(head, to_device(batch, device, dtype), spec, weights, feature_weight,
                                         loss_chunk, loss))
    return window


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch on `device`, copied without waiting for it; the loss mask and lengths stay on the host, where the
    positions that count are picked (`distill_loss`) without reading the device."""
    moved = {"target_top": batch["target_top"].to(device, non_blocking=True)} if "target_top" in batch else {}
    return {"input_ids": batch["input_ids"].to(device, non_blocking=True), "loss_mask": batch["loss_mask"],
            "lengths": batch["lengths"], **moved,
            "hidden": {k: v.to(device=device, dtype=dtype, non_blocking=True) for k, v in batch["hidden"].items()}}
