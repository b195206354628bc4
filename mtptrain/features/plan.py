"""Planning precompute: which layers, which samples in which shard, which batches.

The plan depends only on the recipe, the target and the data, never on the
number of ranks, so shard names and contents are the same however a run is
split up or resumed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from mtptrain.data.samples import Sample
from mtptrain.config import Recipe
from mtptrain.features.store import SPLITS
from mtptrain.target import Target


@dataclass
class ShardPlan:
    name: str
    split: str
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)


def plan_shards(samples: list[Sample], tokens_per_shard: int) -> list[ShardPlan]:
    shards: list[ShardPlan] = []
    for split in SPLITS:
        ordered = sorted((s for s in samples if s.split == split), key=lambda s: (len(s), s.key))
        current: list[Sample] = []
        tokens = index = 0
        for sample in ordered + [None]:  # None flushes the last, partial shard
            if sample is not None:
                current.append(sample)
                tokens += len(sample)
            if current and (sample is None or tokens >= tokens_per_shard):
                shards.append(ShardPlan(f"{split}-{index:05d}.safetensors", split, current))
                current, tokens, index = [], 0, index + 1
    return shards


def make_plan_id(target: Target, recipe: Recipe, layers: list[int], shards: list[ShardPlan]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"target": target.fingerprint, "tokenizer": target.tokenizer_fingerprint,
                              "layers": layers, "dtype": recipe.precompute.dtype,
                              "data": recipe.data.model_dump(mode="json")}, sort_keys=True).encode())
    for shard in shards:
        digest.update(shard.name.encode())
        for sample in shard.samples:
            digest.update(sample.key.encode())
            digest.update(sample.input_ids.tobytes())
            digest.update(sample.loss_mask.tobytes())
    return digest.hexdigest()[:32]


def make_batches(samples: list[Sample], batch_tokens: int, max_batch_size: int) -> list[list[Sample]]:
    """Consecutive groups of length-sorted samples whose padded size stays within the token budget."""
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        new_longest = max(longest, len(sample))
        if current and ((len(current) + 1) * new_longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current, new_longest = [], len(sample)
        current.append(sample)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


