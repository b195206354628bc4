"""Features computed while training (`train.online`): the target runs in the trainer, and no store is written.

`OnlineFeatures` answers what the trainer asks of a `FeatureStore` (lengths, token ids, prompts, padded
micro-batches) from prepared samples, computing each micro-batch's hidden states on the target's runtime when
the batch is read. Everything that decides a batch is the same as offline: the samples are prepared and
ordered as `plan.py` orders a split's shards, the states come from `compute.forward_batch` (the target's
runtime, the layers the head reads and the last one) narrowed to `precompute.dtype`, the target's choices come
with them, and the batch is padded by the same `collate`. So a run whose micro-batches hold the samples that
precompute computed together trains the same weights online and offline (tests/train/test_online.py).

The price: every epoch runs the target again (precompute runs it once), and on one machine the target's
forward and the head's training share its cores. What it buys: data is bounded by compute, not by disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtptrain.config import Recipe
from mtptrain.data.prepare import prepare_samples
from mtptrain.data.samples import Sample
from mtptrain.features.compute import forward_batch
from mtptrain.features.plan import make_plan_id, plan_shards
from mtptrain.target.layers import resolve_layers
from mtptrain.features.store import SCHEMA_VERSION, TARGET_TOP, as_stored
from mtptrain.runtime.runner import runtime_for
from mtptrain.target import Target

ONLINE = "online"  # what a head trained online records as its feature store


@dataclass
class OnlineData:
    """The prepared samples of both splits, and the manifest a store of them would have had."""

    train: list[Sample]
    validation: list[Sample]
    manifest: dict


def prepare_online(recipe: Recipe, target: Target, show_progress: bool = True) -> OnlineData:
    """Prepare the recipe's data for online training: each split in the order of a store's shards."""
    layers = resolve_layers(recipe.precompute.layers, target.num_layers)
    samples, stats = prepare_samples(recipe.data, target.tokenizer, show_progress=show_progress)
    shards = plan_shards(samples, tokens_per_shard=1 << 62)  # one shard per split: the order is what matters
    ordered = {split: [s for shard in shards if shard.split == split for s in shard.samples]
               for split in ("train", "validation")}
    manifest = {
        "schema_version": SCHEMA_VERSION, "target": target.identity(), "layers": layers,
        "last_layer": target.num_layers - 1, "dtype": recipe.precompute.dtype, "max_length": recipe.data.max_length,
        "data": {**recipe.data.model_dump(mode="json"), "rows": stats.to_dict()},
        # a digest of the target, layers, dtype and samples, as a store's: a checkpoint knows what it was trained on
        "plan_id": make_plan_id(target, recipe, layers, shards), "online": True,
    }
    return OnlineData(ordered["train"], ordered["validation"], manifest)


class OnlineFeatures:
    """One split's samples, with their hidden states computed by the target when a micro-batch is read."""

    directory = ONLINE

    def __init__(self, target: Target, samples: list[Sample], layers: list[int], dtype: str, runtime: str = "auto"):
        self.target, self.samples = target, samples
        self.source = runtime_for(target.model, runtime, batched=True)  # the target's batched decoder, built once
        self.layers = sorted(set(layers) | {target.num_layers - 1})  # the last layer gives the target's choices
        self.read = sorted(set(layers))
        self.dtype = dtype  # precompute.dtype: states are returned as a store of it would return them
        self.keys = [s.key for s in samples]
        self.has_target_top = True

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        return [len(s) for s in self.samples]

    def token_ids(self, i: int, assistant_only: bool = False) -> torch.Tensor:
        sample = self.samples[i]
        ids = torch.from_numpy(sample.input_ids)
        return ids[torch.from_numpy(sample.loss_mask).bool()] if assistant_only else ids

    def prompt_ids(self, i: int) -> list[int]:
        sample = self.samples[i]
        trained = sample.loss_mask.nonzero()[0]
        return sample.input_ids[: int(trained[0]) if len(trained) else len(sample)].tolist()

    def items(self, indices: list[int]) -> list[dict]:
        """Samples `indices` as a store returns them, their states computed in one padded forward pass."""
        batch = [self.samples[i] for i in indices]
        states, top = forward_batch(self.target, self.source, self.layers, batch)
        return [{"key": sample.key,
                 "input_ids": torch.from_numpy(sample.input_ids),
                 "loss_mask": torch.from_numpy(sample.loss_mask),
                 "hidden": {layer: as_stored(states[layer][row, : len(sample)].cpu(), self.dtype)
                            for layer in self.read},
                 TARGET_TOP: top[row, : len(sample)].cpu()}
                for row, sample in enumerate(batch)]

    def __getitem__(self, i: int) -> dict:
        return self.items([i])[0]
