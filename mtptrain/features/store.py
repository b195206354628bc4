"""The feature store: what precompute writes and the trainer reads.

Layout of a store directory:

    manifest.json             written last, atomically: a store without it is incomplete
    recipe.yaml               the resolved recipe that produced it
    summary.json              throughput and size figures of the run
    train-00000.safetensors   shards: many samples packed back to back
    train-00000.json          the shard's record, written right after the shard (resume marker)
    validation-00000.safetensors ...

Tensors of one shard (N samples, T tokens in all, H hidden size):

    input_ids        int32 [T]
    loss_mask        uint8 [T]     1 = assistant token
    offsets          int64 [N+1]   sample i is rows offsets[i]:offsets[i+1]
    hidden.<layer>   dtype [T, H]  output of decoder layer <layer> (0-based); the
                                   last layer's entry is its pre-norm output
    scale.<layer>    float32 [T]   float8_e4m3fn stores only: each row's scale (its
                                   largest magnitude / 448), the row being hidden * scale
    target_top       int32 [T]     the target's greedy next token at each position

The shard's safetensors metadata holds the sample keys (JSON list) and the
plan id. Layer numbering is "output of decoder layer i", 0-based, everywhere
in the project; exports convert to each engine's own numbering.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from mtptrain.errors import MtptrainError
from mtptrain.io import atomic_write, atomic_write_json, contained, sha256_file
from mtptrain.target import identity_mismatch

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
REQUIRED_MANIFEST_KEYS = ("schema_version", "target", "layers", "dtype", "max_length", "plan_id", "shards")


class FeatureStoreError(MtptrainError, RuntimeError):
    """A store that cannot be used as asked; the message names the file and the fix."""


TARGET_TOP = "target_top"  # shard tensor: the target's greedy next token per position (stores since 2026-11)


def hidden_key(layer: int) -> str:
    return f"hidden.{layer}"


def scale_key(layer: int) -> str:
    return f"scale.{layer}"


FP8 = "float8_e4m3fn"  # precompute.dtype of 1-byte storage with a scale per row
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
READ_DTYPE = torch.bfloat16  # what a float8 store's rows are read back as


def quantize_rows(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn rows [T, H] and their float32 scales [T]: each row divided by its largest magnitude / 448,
    so that every row uses the format's whole range (3 mantissa bits: within 1/16 of each value)."""
    wide = states.float()
    scale = (wide.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (wide / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (rows.float() * scale[:, None].float()).to(READ_DTYPE)


def as_stored(states: torch.Tensor, dtype: str) -> torch.Tensor:
    """States [T, H] as a store of `dtype` (precompute.dtype) returns them once written and read back."""
    if dtype == FP8:  # precompute quantizes rows from its bfloat16 shard buffer
        return dequantize_rows(*quantize_rows(states.to(READ_DTYPE)))
    return states.to(getattr(torch, dtype))


def stored_bits(dtype: str) -> int:
    """Bits per stored value of precompute.dtype (a float8 store's per-row scales come on top)."""
    return torch.finfo(getattr(torch, dtype)).bits


@dataclass
class ShardRecord:
    file: str
    split: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    plan_id: str
    rank: int  # which rank wrote it (provenance; any rank may redo it on resume)


def record_path(shard_path: Path) -> Path:
    return shard_path.with_suffix(".json")


def write_shard(path: Path, split: str, keys: list[str], input_ids: np.ndarray, loss_mask: np.ndarray,
                offsets: np.ndarray, hidden: dict[int, torch.Tensor], plan_id: str, rank: int = 0,
                target_top: torch.Tensor | None = None, scales: dict[int, torch.Tensor] | None = None) -> ShardRecord:
    """Write one shard atomically, then its record; the record's presence marks the shard complete.
    `target_top` [tokens] (int32): the target's greedy next token at each position, where computed; `scales`
    (layer -> [tokens]): the per-row scales of float8 hidden states."""
    tensors = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int32)),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        "offsets": torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64)),
        **{hidden_key(layer): states.contiguous() for layer, states in hidden.items()},
        **{scale_key(layer): scale.to(torch.float32).contiguous() for layer, scale in (scales or {}).items()},
    }
    if target_top is not None:
        tensors[TARGET_TOP] = target_top.to(torch.int32).contiguous()
    metadata = {"keys": json.dumps(keys), "plan_id": plan_id, "split": split}
    written: dict[str, Any] = {}
    atomic_write(path, lambda tmp: written.update(write_safetensors(tmp, tensors, metadata)))
    record = ShardRecord(path.name, split, len(keys), int(len(input_ids)), written["bytes"], written["sha256"], plan_id,
                         rank)
    atomic_write_json(record_path(path), asdict(record))
    return record


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write a safetensors file with a deterministic header, hashing it on the way.

    The library's own writer orders the metadata map at random, so the same
    shard would not be byte-identical across runs; this writer streams the
    tensors from their buffers without an intermediate copy of the whole file.
    Layout: u64 little-endian header length, JSON header padded to 8 bytes,
    then the tensors' bytes back to back.
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for chunk in (len(head).to_bytes(8, "little"), head):
            fh.write(chunk)
            digest.update(chunk)
        for tensor in tensors.values():
            raw = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
            fh.write(raw)
            digest.update(raw)
    return {"bytes": 8 + len(head) + offset, "sha256": digest.hexdigest()}


def read_complete_record(path: Path, plan_id: str) -> ShardRecord | None:
    """The record of a shard that is complete for this plan, or None if it must be (re)written.

    A record from another plan means the directory belongs to another recipe:
    refusing is the only way not to mix or destroy someone's data.
    """
    rec_path = record_path(path)
    if not rec_path.is_file():
        return None
    try:
        record = ShardRecord(**json.loads(rec_path.read_text()))
    except (json.JSONDecodeError, TypeError):
        return None
    if record.file != path.name:
        log.warning("%s describes %r, not %s: a corrupt or hostile record, ignored (the shard is computed again)",
                    rec_path, record.file, path.name)
        return None
    if record.plan_id != plan_id:
        raise FeatureStoreError(
            f"{rec_path} was written by another recipe (other data, target, layers or dtype). "
            "Point precompute.output_dir at a new directory, or delete this one to start over.")
    if not path.is_file() or path.stat().st_size != record.bytes:
        return None
    return record


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(directory / MANIFEST, manifest)


# --------------------------------------------------------------------------- reading


class FeatureStore:
    """Random access to the samples of one split, memory-mapped shard by shard.

    `target` (a `mtptrain.target.Target` or its identity dict) and `layers`
    are checked against the manifest before anything is read, so a store made
    for another model or other layers is refused up front. `verify` is
    "sha256" (hash every shard once, catches any corruption) or "size"
    (cheap: file sizes and headers only).
    """

    def __init__(self, directory: str | Path, split: str = "train", *, target: Any = None,
                 layers: list[int] | None = None, verify: str = "sha256"):
        self.directory = Path(directory)
        self.manifest = load_manifest(self.directory)
        self.split = split
        if target is not None:
            check_target(self.manifest, target if isinstance(target, dict) else target.identity(), self.directory)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if verify not in ("sha256", "size"):
            raise ValueError(f"verify must be 'sha256' or 'size', not {verify!r}")
        stored = list(self.manifest["layers"])
        if layers is not None:
            missing = sorted(set(layers) - set(stored))
            if missing:
                raise FeatureStoreError(f"{self.directory / MANIFEST}: layers {missing} were not captured "
                                        f"(store has {stored}); rerun precompute with these layers")
        self.layers = sorted(set(layers)) if layers is not None else stored  # only these are read
        self.shards = [s for s in self.manifest["shards"] if s["split"] == split]
        self._handles: dict[int, Any] = {}
        self._index: list[tuple[int, int, int]] = []  # (shard, start row, end row) per sample
        self.keys: list[str] = []
        for shard_no, shard in enumerate(self.shards):
            path = self._path(shard_no)
            verify_shard(path, shard, verify)
            handle = self._handle(shard_no)
            metadata = handle.metadata() or {}
            if metadata.get("plan_id") != self.manifest["plan_id"]:
                raise FeatureStoreError(
                    f"{self.directory / MANIFEST}: shard {self._entry(shard_no)} is {path.name}, a shard written for "
                    f"another store (plan {metadata.get('plan_id')!r}, this store's is {self.manifest['plan_id']!r}): "
                    "a corrupt or hostile manifest. Precompute again into a new directory.")
            offsets = handle.get_tensor("offsets").tolist()
            keys = json.loads(metadata["keys"])
            if len(keys) != shard["samples"] or len(offsets) != shard["samples"] + 1:
                raise FeatureStoreError(f"{path}: holds {len(keys)} samples, manifest says {shard['samples']}; "
                                        "the shard is corrupted: delete it and its .json, then rerun precompute")
            self._index.extend((shard_no, offsets[i], offsets[i + 1]) for i in range(len(keys)))
            self.keys.extend(keys)
        # The target's choices come with every sample only when every shard holds them (a store written before
        # they were stored, or resumed across that change, has none: training then computes them).
        self.has_target_top = bool(self.shards) and all(TARGET_TOP in self._handle(n).keys()
                                                        for n in range(len(self.shards)))

    def _entry(self, shard_no: int) -> int:
        """The shard's index in the manifest's list (shards of both splits)."""
        return self.manifest["shards"].index(self.shards[shard_no])

    def _path(self, shard_no: int) -> Path:
        return contained(self.directory, self.shards[shard_no].get("file"), self.directory / MANIFEST,
                         f"shard {self._entry(shard_no)}", FeatureStoreError,
                         "Precompute again into a new directory, or restore the manifest from the run that wrote it.")

    def _handle(self, shard_no: int):
        if shard_no not in self._handles:
            path = self._path(shard_no)
            try:
                self._handles[shard_no] = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise FeatureStoreError(f"{path}: not a readable safetensors file ({exc}); "
                                        "delete it and its .json, then rerun precompute") from exc
        return self._handles[shard_no]

    def __getstate__(self):  # safetensors handles do not pickle (data-loader workers reopen them)
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        return [end - start for _, start, end in self._index]

    def token_ids(self, i: int, assistant_only: bool = False) -> torch.Tensor:
        """Token ids of sample i without touching its hidden states (all, or only the loss-masked ones)."""
        shard_no, start, end = self._index[i]
        handle = self._handle(shard_no)
        ids = handle.get_slice("input_ids")[start:end]
        return ids[handle.get_slice("loss_mask")[start:end].bool()] if assistant_only else ids

    def loss_mask(self, i: int) -> torch.Tensor:
        """Sample i's loss mask (1 = a trained, assistant token) without touching its hidden states."""
        shard_no, start, end = self._index[i]
        return self._handle(shard_no).get_slice("loss_mask")[start:end]

    def prompt_ids(self, i: int) -> list[int]:
        """The tokens of sample i before its first trained (loss-masked) token: the prompt of its first answer."""
        shard_no, start, end = self._index[i]
        handle = self._handle(shard_no)
        trained = handle.get_slice("loss_mask")[start:end].nonzero()
        first = int(trained[0, 0]) if len(trained) else end - start
        return handle.get_slice("input_ids")[start:start + first].tolist()

    def _hidden(self, handle, layer: int, start: int, end: int) -> torch.Tensor:
        rows = handle.get_slice(hidden_key(layer))[start:end]
        if self.manifest["dtype"] == FP8:
            return dequantize_rows(rows, handle.get_slice(scale_key(layer))[start:end])
        return rows

    def items(self, indices: list[int]) -> list[dict[str, Any]]:
        """Samples `indices`, as a micro-batch reads them (features/online.py computes them instead)."""
        return [self[i] for i in indices]

    def __getitem__(self, i: int) -> dict[str, Any]:
        shard_no, start, end = self._index[i]
        handle = self._handle(shard_no)
        item = {
            "key": self.keys[i],
            "input_ids": handle.get_slice("input_ids")[start:end],
            "loss_mask": handle.get_slice("loss_mask")[start:end],
            "hidden": {layer: self._hidden(handle, layer, start, end) for layer in self.layers},
        }
        if self.has_target_top:
            item[TARGET_TOP] = handle.get_slice(TARGET_TOP)[start:end]
        return item


def load_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        partial = any(Path(directory).glob("*.safetensors")) if Path(directory).is_dir() else False
        hint = ("precompute has not finished: rerun it with the same recipe to complete the store"
                if partial else "run `mtptrain precompute` first, or check the path")
        raise FeatureStoreError(f"{path} does not exist: {hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FeatureStoreError(f"{path} is not valid JSON ({exc}); rerun precompute to rewrite it") from exc
    if not isinstance(manifest, dict):
        raise FeatureStoreError(f"{path} must hold a JSON object; rerun precompute to rewrite it")
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise FeatureStoreError(f"{path} lacks {missing}: not a feature store manifest, or a damaged one; "
                                "rerun precompute to rewrite it")
    if manifest["schema_version"] != SCHEMA_VERSION:
        raise FeatureStoreError(f"{path} has schema version {manifest['schema_version']}, this mtptrain reads "
                                f"{SCHEMA_VERSION}; rerun precompute with this version")
    return manifest


def check_target(manifest: dict[str, Any], identity: dict[str, Any], directory: Path) -> None:
    stored = manifest["target"]
    key = identity_mismatch(stored, identity)
    if key is not None:
        raise FeatureStoreError(
            f"{Path(directory) / MANIFEST}: made for target '{stored.get('name')}' ({key} {stored.get(key)}), "
            f"but the target given is '{identity.get('name')}' ({key} {identity.get(key)}). "
            "Use the same target.model as the precompute run, or precompute again for this target.")


def verify_shard(path: Path, shard: dict[str, Any], verify: str) -> None:
    fix = "delete it and its .json, then rerun precompute to rewrite it"
    if not path.is_file():
        raise FeatureStoreError(f"{path} is listed in the manifest but missing; {fix}")
    size = path.stat().st_size
    if size != shard["bytes"]:
        raise FeatureStoreError(f"{path}: {size} bytes, manifest says {shard['bytes']}; the shard is damaged; {fix}")
    if verify == "sha256" and sha256_file(path) != shard["sha256"]:
        raise FeatureStoreError(f"{path}: sha256 does not match the manifest; the shard is corrupted; {fix}")
