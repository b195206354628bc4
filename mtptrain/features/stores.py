"""Several feature stores trained on as one: `train.features` given as a list.

A store is what one precompute run wrote from one data source. Training on a mix of sources (ShareGPT
conversations and requests the target wrote itself, say) then needs no new precompute of either: each store is
opened and checked as on its own, and their samples are numbered one after the other, the first store's first.
The batch plan shuffles over all of them, so a run of `train.max_steps` sees the mix in proportion to the
stores' sizes.

The stores must hold features of the same model (the same fingerprint of every weight) at the same layers, and
none may be listed twice or share a sample with another: their samples would be trained on twice.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch

from mtptrain.features.store import MANIFEST, FeatureStore, FeatureStoreError, load_manifest

FIX = "Give train.features stores precomputed for the same target.model with the same precompute.layers."


def store_dirs(features: str | list[str]) -> list[Path]:
    """train.features as a list of store directories."""
    return [Path(d) for d in ([features] if isinstance(features, str) else features)]


def combined_manifest(directories: list[Path]) -> dict[str, Any]:
    """The manifest a run on these stores stands for: the only one's, or the first's with the plans of all (a
    checkpoint resumes only on the same stores in the same order) once every store is checked to agree with it."""
    manifests = [load_manifest(d) for d in directories]
    first = manifests[0]
    if len(manifests) == 1:
        return first
    plans: dict[str, Path] = {}
    for directory, manifest in zip(directories, manifests):
        here = directory / MANIFEST
        earlier = plans.setdefault(manifest["plan_id"], directory)
        if earlier != directory:
            raise FeatureStoreError(f"{here}: the same store as {earlier / MANIFEST} (plan {manifest['plan_id']}), "
                                    "listed twice in train.features: its samples would be trained on twice. List "
                                    "each store once.")
        for field in ("fingerprint", "hidden_size", "vocab_size"):
            if manifest["target"].get(field) != first["target"].get(field):
                raise FeatureStoreError(
                    f"{here}: target {field} {manifest['target'].get(field)!r}, but {directories[0] / MANIFEST} "
                    f"has {first['target'].get(field)!r}: these stores hold features of different models. " + FIX)
        if list(manifest["layers"]) != list(first["layers"]):
            raise FeatureStoreError(f"{here}: layers {manifest['layers']}, but {directories[0] / MANIFEST} has "
                                    f"{first['layers']}. " + FIX)
    return {**first, "plan_id": "+".join(m["plan_id"] for m in manifests)}


def features_runtime(store: FeatureStore | FeatureStores) -> Any:
    """What computed the features of an opened store or list (each manifest's `runtime`): one record when they
    agree, else the list."""
    records = [s.manifest.get("runtime") for s in getattr(store, "stores", [store])]
    return records[0] if all(r == records[0] for r in records) else records


def open_stores(features: str | list[str], split: str, **kwargs: Any) -> FeatureStore | FeatureStores:
    """One split of train.features: the store itself, or several read as one (each checked as FeatureStore
    checks it: `kwargs` are its target, layers and verify)."""
    directories = store_dirs(features)
    stores = [FeatureStore(d, split, **kwargs) for d in directories]
    return stores[0] if len(stores) == 1 else FeatureStores(stores)


class FeatureStores:
    """Samples of several stores' split, numbered one store after the other, read as FeatureStore reads them."""

    def __init__(self, stores: list[FeatureStore]):
        self.stores = stores
        self.split = stores[0].split
        self.layers = stores[0].layers
        self.keys: list[str] = []
        held: dict[str, Path] = {}
        for store in stores:
            for key in store.keys:
                if held.setdefault(key, store.directory) != store.directory:
                    raise FeatureStoreError(
                        f"{store.directory / MANIFEST}: sample {key!r} is also in {held[key] / MANIFEST}: the two "
                        "stores share samples, which would be trained on twice. Precompute the mix from data "
                        "without repeats, or list one of them.")
            self.keys.extend(store.keys)
        self.starts = [0]
        for store in stores:
            self.starts.append(self.starts[-1] + len(store))
        # The target's choices come with a batch only when all its samples have them (data.collate).
        self.has_target_top = all(store.has_target_top for store in stores)

    def _locate(self, i: int) -> tuple[FeatureStore, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        n = bisect_right(self.starts, i) - 1
        return self.stores[n], i - self.starts[n]

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        return [length for store in self.stores for length in store.lengths()]

    def token_ids(self, i: int, assistant_only: bool = False) -> torch.Tensor:
        store, j = self._locate(i)
        return store.token_ids(j, assistant_only)

    def loss_mask(self, i: int) -> torch.Tensor:
        store, j = self._locate(i)
        return store.loss_mask(j)

    def prompt_ids(self, i: int) -> list[int]:
        store, j = self._locate(i)
        return store.prompt_ids(j)

    def spread(self, count: int) -> list[int]:
        """`count` sample numbers taken from the stores in turn (the first of each, then the second of each, ...),
        so that validation prompts come from every source."""
        taken: list[int] = []
        for j in range(max(map(len, self.stores), default=0)):
            taken += [start + j for start, store in zip(self.starts, self.stores) if j < len(store)]
            if len(taken) >= count:
                break
        return taken[:count]

    def items(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]

    def __getitem__(self, i: int) -> dict[str, Any]:
        store, j = self._locate(i)
        return store[j]
