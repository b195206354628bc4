"""Training batches from a feature store: deterministic, length-bucketed, resumable, rank-sharded.

The run's micro-batches form one global sequence, epoch after epoch, fixed
by the seed. Epoch e shuffles the samples, sorts them by length inside
windows of `bucket` micro-batches (little padding, still random), cuts them
into micro-batches and shuffles those. Rank r of W takes the global
micro-batches r, r+W, r+2W, ..., so one optimizer step of W ranks x A
accumulation steps consumes the same W x A micro-batches as one process with
W x A accumulation steps. Resuming is starting the sequence at a saved index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mtptrain.features.online import OnlineFeatures
from mtptrain.features.store import FeatureStore


def epoch_batches(lengths: list[int], micro_batch_size: int, seed: int, epoch: int, bucket: int = 32) -> list[list[int]]:
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    window = micro_batch_size * bucket
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window].tolist(), key=lambda i: (-lengths[i], i))
        batches.extend(chunk[i : i + micro_batch_size] for i in range(0, len(chunk), micro_batch_size))
    rng.shuffle(batches)
    return batches


@dataclass
class BatchPlan:
    """The run's micro-batches for this rank, from a global position on."""

    lengths: list[int]
    micro_batch_size: int
    seed: int
    world_size: int
    rank: int
    steps: int  # optimizer steps in the run
    grad_accum: int

    @property
    def micro_batches_per_step(self) -> int:
        return self.world_size * self.grad_accum

    def global_sequence(self) -> list[list[int]]:
        needed = self.steps * self.micro_batches_per_step
        sequence: list[list[int]] = []
        epoch = 0
        while len(sequence) < needed:
            sequence.extend(epoch_batches(self.lengths, self.micro_batch_size, self.seed, epoch))
            epoch += 1
        return sequence[:needed]

    def tokens_through(self, step: int) -> int:
        """Tokens in the micro-batches of steps 1..step, over all ranks."""
        seen = self.global_sequence()[: step * self.micro_batches_per_step]
        return sum(self.lengths[i] for batch in seen for i in batch)

    def for_rank(self, start: int = 0) -> list[list[int]]:
        """This rank's micro-batches from global micro-batch `start` (a multiple of micro_batches_per_step)."""
        return self.global_sequence()[start + self.rank :: self.world_size]


def steps_for(num_samples: int, micro_batch_size: int, world_size: int, grad_accum: int, epochs: float,
              max_steps: int | None) -> int:
    per_step = micro_batch_size * world_size * grad_accum
    steps = max_steps if max_steps is not None else int(epochs * num_samples // per_step)
    if steps < 1:
        raise ValueError(f"{num_samples} training samples make no full step of {per_step} samples "
                         f"({world_size} rank(s) x grad_accum {grad_accum} x micro_batch_size {micro_batch_size}); "
                         "lower train.micro_batch_size or set train.max_steps")
    return steps


def steps_for_tokens(lengths: list[int], micro_batch_size: int, seed: int, tokens: int) -> int:
    """The step count (one process, no accumulation) whose micro-batches, in the trainer's order, hold the number of
    tokens nearest to `tokens`: how arms of an ablation on different stores train for equal tokens."""
    if not lengths or tokens < 1:
        raise ValueError(f"no step count reaches {tokens} tokens in a store of {len(lengths)} samples")
    seen, steps, epoch = 0, 0, 0
    while True:
        for batch in epoch_batches(lengths, micro_batch_size, seed, epoch):
            size = sum(lengths[i] for i in batch)
            if seen + size >= tokens:  # this step crosses the mark: keep it if that lands nearer
                return steps + 1 if steps == 0 or seen + size - tokens <= tokens - seen else steps
            seen, steps = seen + size, steps + 1
        epoch += 1


class BatchDataset(Dataset):
    """Micro-batch k of a list, padded: input_ids / loss_mask [B, T], hidden {layer: [B, T, H]}, T the longest
    sample rounded up to a multiple of `multiple`."""

    def __init__(self, store: FeatureStore | OnlineFeatures, batches: list[list[int]], multiple: int = 1):
        self.store, self.batches, self.multiple = store, batches, multiple

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict:
        return collate(self.store.items(self.batches[k]), self.multiple)


def collate(items: list[dict], multiple: int = 1) -> dict:
    """Right padding, to the longest item rounded up to a multiple of `multiple`: under causal attention a real
    token never sees the padding after it, and the padding's loss mask is 0."""
    longest = -(-max(len(item["input_ids"]) for item in items) // multiple) * multiple
    batch = {
        "input_ids": torch.zeros(len(items), longest, dtype=torch.long),
        "loss_mask": torch.zeros(len(items), longest, dtype=torch.long),
        "lengths": torch.tensor([len(item["input_ids"]) for item in items]),
        "hidden": {},
    }
    if all("target_top" in item for item in items):  # the target's choices, where the store holds them
        batch["target_top"] = torch.full((len(items), longest), -1, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        batch["input_ids"][row, :n] = item["input_ids"]
        batch["loss_mask"][row, :n] = item["loss_mask"]
        if "target_top" in batch:
            batch["target_top"][row, :n] = item["target_top"]
        for layer, states in item["hidden"].items():
            if layer not in batch["hidden"]:
                batch["hidden"][layer] = torch.zeros(len(items), longest, states.shape[-1], dtype=states.dtype)
            batch["hidden"][layer][row, :n] = states
    return batch


def loader(store: FeatureStore | OnlineFeatures, batches: list[list[int]], num_workers: int,
           pin: bool = False, multiple: int = 1) -> DataLoader:
    """Micro-batches in order; online features are computed in this process, by the target loaded here. `pin`
    (training on CUDA): a store's batches come in page-locked memory, so that their copies to the GPU
    (non_blocking) overlap the step before instead of waiting for it; online features are on the GPU already.
    `multiple`: each micro-batch's length is rounded up to a multiple of it (`TrainConfig.pad_multiple_on`)."""
    online = isinstance(store, OnlineFeatures)
    if online:
        num_workers = 0
    return DataLoader(BatchDataset(store, batches, multiple), batch_size=None, shuffle=False, num_workers=num_workers,
                      prefetch_factor=4 if num_workers else None, persistent_workers=False,
                      pin_memory=pin and not online)
