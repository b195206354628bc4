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

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from mtptrain.config import PrecomputeConfig
from mtptrain.errors import MtptrainError
from mtptrain.io import (SAFETENSORS_DTYPES, atomic_write, atomic_write_json, contained, load_json, sha256_file,
                         write_safetensors)
from mtptrain.target import identity_mismatch

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
REQUIRED_MANIFEST_KEYS = ("schema_version", "target", "layers", "dtype", "max_length", "plan_id", "totals", "shards")
STORE_DTYPES = get_args(PrecomputeConfig.model_fields["dtype"].annotation)
# A shard entry of the manifest: its fields and their JSON types.
SHARD_FIELDS = {"file": str, "split": str, "samples": int, "tokens": int, "bytes": int, "sha256": str}
_TYPE_NAMES = {str: "a string", int: "an integer"}
# What to do about a shard that does not hold what its manifest says: a rerun into the same directory trusts every
# shard that still matches its record (the .json beside it), so only a new directory is sure to rebuild it.
RECOMPUTE = ("recompute the store: run `mtptrain precompute` with its recipe.yaml into a new precompute.output_dir "
             "(a rerun into this one recomputes only the shards that differ from their records)")
# A rerun sets aside a manifest that load_manifest refuses and writes it anew from the shards' records.
REWRITE_MANIFEST = ("run `mtptrain precompute` again with the store's recipe.yaml and the same "
                    "precompute.output_dir: it writes the manifest anew from the shards' records")
HOSTILE_MANIFEST_FIX = "Precompute again into a new directory, or restore the manifest from the run that wrote it."


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


def read_complete_record(path: Path, plan_id: str) -> ShardRecord | None:
    """The record of a shard that is complete for this plan, or None if it must be (re)written.

    A record from another plan means the directory belongs to another recipe:
    refusing is the only way not to mix or destroy someone's data.
    """
    rec_path = record_path(path)
    if not rec_path.is_file():
        return None
    try:
        record = ShardRecord(**load_json(rec_path.read_text()))
    except (json.JSONDecodeError, TypeError):
        return None
    if record.file != path.name:
        log.warning("%s describes %r, not %s: a corrupt or hostile record, ignored (the shard is computed again)",
                    rec_path, record.file, path.name)
        return None
    if record.plan_id != plan_id:
        raise FeatureStoreError(
            f"{rec_path} was written by another recipe (other data, target, layers or dtype). "
            "Point precompute.output_dir at a new directory; this one is left as it is.")
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
        shard_of: dict[str, Path] = {}  # sample key -> the shard holding it
        for shard_no, shard in enumerate(self.shards):
            path = self._path(shard_no)
            verify_shard(path, shard, verify)
            handle = self._handle(shard_no)
            self._check_plan(shard_no, handle.metadata() or {})
            keys, offsets = read_shard_index(handle, path, shard, self.manifest)
            for key in keys:
                if shard_of.setdefault(key, path) != path:
                    raise FeatureStoreError(
                        f"{path}: sample {key!r} is also in {shard_of[key].name}: {self.directory / MANIFEST} lists "
                        "the same samples twice, and they would be trained on twice; a corrupt or hostile manifest. "
                        + HOSTILE_MANIFEST_FIX)
            self._index.extend((shard_no, offsets[i], offsets[i + 1]) for i in range(len(keys)))
            self.keys.extend(keys)
        # The target's choices come with every sample only when every shard holds them (a store written before
        # they were stored, or resumed across that change, has none: training then computes them).
        self.has_target_top = bool(self.shards) and all(TARGET_TOP in self._handle(n).keys()
                                                        for n in range(len(self.shards)))

    def _check_plan(self, shard_no: int, metadata: dict[str, str]) -> None:
        """A shard of another store, even one inside this directory, must not be read as this store's."""
        if metadata.get("plan_id") != self.manifest["plan_id"]:
            raise FeatureStoreError(
                f"{self.directory / MANIFEST}: shard {self._entry(shard_no)} is {self._path(shard_no).name}, a shard "
                f"written for another store (plan {metadata.get('plan_id')!r}, this store's is "
                f"{self.manifest['plan_id']!r}): a corrupt or hostile manifest. " + HOSTILE_MANIFEST_FIX)

    def _entry(self, shard_no: int) -> int:
        """The shard's index in the manifest's list (shards of both splits)."""
        return self.manifest["shards"].index(self.shards[shard_no])

    def _path(self, shard_no: int) -> Path:
        return contained(self.directory, self.shards[shard_no].get("file"), self.directory / MANIFEST,
                         f"shard {self._entry(shard_no)}", FeatureStoreError, HOSTILE_MANIFEST_FIX)

    def _handle(self, shard_no: int):
        if shard_no not in self._handles:
            path = self._path(shard_no)
            try:
                self._handles[shard_no] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise FeatureStoreError(f"{path}: not a readable safetensors file, its header is damaged ({exc}); "
                                        + RECOMPUTE) from exc
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
        manifest = load_json(path.read_text())
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
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Refuse what precompute never writes, before any shard is opened: a storage dtype or target sizes the shards
    cannot be checked against, shard entries with missing or impossible counts or a path out of the store, a shard
    listed twice (its samples would be trained on twice) and totals that are not the sum of the entries."""
    if manifest["dtype"] not in STORE_DTYPES:
        raise FeatureStoreError(f"{path}: dtype {manifest['dtype']!r} is none of {list(STORE_DTYPES)}; "
                                + REWRITE_MANIFEST)
    target = manifest["target"] if isinstance(manifest["target"], dict) else {}
    for field in ("hidden_size", "vocab_size"):
        if not _is_count(target.get(field)) or target[field] < 1:
            raise FeatureStoreError(f"{path}: target.{field} is {target.get(field)!r}, not a positive integer; "
                                    + REWRITE_MANIFEST)
    layers = manifest["layers"]
    if not isinstance(layers, list) or not layers or not all(_is_count(i) and i >= 0 for i in layers) \
            or len(set(layers)) != len(layers):
        raise FeatureStoreError(f"{path}: layers is {layers!r}, not a list of distinct layer numbers (0-based); "
                                + REWRITE_MANIFEST)
    if not isinstance(manifest["plan_id"], str):
        raise FeatureStoreError(f"{path}: plan_id is {manifest['plan_id']!r}, not a string; " + REWRITE_MANIFEST)
    if not isinstance(manifest["shards"], list):
        raise FeatureStoreError(f"{path}: shards must be a list of shard entries; " + REWRITE_MANIFEST)
    listed: dict[Path, int] = {}  # shard file, every link resolved -> its first entry
    for index, entry in enumerate(manifest["shards"]):
        check_shard_entry(entry, f"{path}: shard {index}")
        file = contained(path.parent, entry["file"], path, f"shard {index}", FeatureStoreError, HOSTILE_MANIFEST_FIX)
        first = listed.setdefault(file.resolve(), index)
        if first != index:
            raise FeatureStoreError(f"{path}: shard {index} ({entry['file']}) is shard {first} listed twice: its "
                                    "samples would be trained on twice; " + REWRITE_MANIFEST)
    for split in SPLITS:
        for field in ("samples", "tokens"):
            total = sum(entry[field] for entry in manifest["shards"] if entry["split"] == split)
            stated = _stated_total(manifest["totals"], split, field)
            if stated != total:
                raise FeatureStoreError(f"{path}: totals.{split}.{field} is {stated!r}, but the {split} shards add "
                                        f"up to {total}; " + REWRITE_MANIFEST)


def check_shard_entry(entry: Any, where: str) -> None:
    """One shard entry of a manifest: every field of its JSON type, a split, and at least one token per sample."""
    if not isinstance(entry, dict):
        raise FeatureStoreError(f"{where} is {entry!r}, not a shard entry; " + REWRITE_MANIFEST)
    where = f"{where} ({entry.get('file')})"
    for field, kind in SHARD_FIELDS.items():
        value = entry.get(field)
        if not isinstance(value, kind) or (kind is int and not _is_count(value)):
            raise FeatureStoreError(f"{where}: {field} is {value!r}, not {_TYPE_NAMES[kind]}; " + REWRITE_MANIFEST)
    if entry["split"] not in SPLITS:
        raise FeatureStoreError(f"{where}: split {entry['split']!r} is none of {list(SPLITS)}; " + REWRITE_MANIFEST)
    least = {"samples": 1, "tokens": entry["samples"]}  # precompute writes no empty shard or sample
    for field, low in least.items():
        if entry[field] < low:
            raise FeatureStoreError(f"{where}: {field} is {entry[field]}, fewer than {low}: a shard holds at least "
                                    "one sample, and at least one token per sample; " + REWRITE_MANIFEST)


def _stated_total(totals: Any, split: str, field: str) -> Any:
    """totals[split][field] of a manifest, or None where that is not there."""
    stated = totals.get(split) if isinstance(totals, dict) else None
    return stated.get(field) if isinstance(stated, dict) else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_target(manifest: dict[str, Any], identity: dict[str, Any], directory: Path) -> None:
    stored = manifest["target"]
    key = identity_mismatch(stored, identity)
    if key is not None:
        raise FeatureStoreError(
            f"{Path(directory) / MANIFEST}: made for target '{stored.get('name')}' ({key} {stored.get(key)}), "
            f"but the target given is '{identity.get('name')}' ({key} {identity.get(key)}). "
            "Use the same target.model as the precompute run, or precompute again for this target.")


def verify_shard(path: Path, shard: dict[str, Any], verify: str) -> None:
    if not path.is_file():
        raise FeatureStoreError(f"{path} is listed in the manifest but missing; {RECOMPUTE}")
    size = path.stat().st_size
    if size != shard["bytes"]:
        raise FeatureStoreError(f"{path}: {size} bytes, manifest says {shard['bytes']}; the shard is damaged; "
                                + RECOMPUTE)
    if verify == "sha256" and sha256_file(path) != shard["sha256"]:
        raise FeatureStoreError(f"{path}: sha256 does not match the manifest; the shard is corrupted; {RECOMPUTE}")


def shard_layout(manifest: dict[str, Any], shard: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """Name -> (safetensors dtype, shape) of every tensor a shard of this manifest holds (`target_top` may be
    absent: stores written before it existed have none)."""
    tokens = shard["tokens"]
    layout = {"input_ids": ("I32", [tokens]), "loss_mask": ("U8", [tokens]),
              "offsets": ("I64", [shard["samples"] + 1]), TARGET_TOP: ("I32", [tokens])}
    stored = SAFETENSORS_DTYPES[manifest["dtype"]]
    for layer in manifest["layers"]:
        layout[hidden_key(layer)] = (stored, [tokens, manifest["target"]["hidden_size"]])
        if manifest["dtype"] == FP8:
            layout[scale_key(layer)] = ("F32", [tokens])
    return layout


def read_shard_index(handle, path: Path, shard: dict[str, Any],
                     manifest: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The shard's sample keys and row offsets, once its content is what the manifest says: names, dtypes and
    shapes from the header alone (the hidden states are never read here), then the small integer tensors in full."""
    metadata = handle.metadata() or {}
    problem = _header_problem(handle, shard, manifest) or _metadata_problem(metadata, shard)
    if problem is None:  # every dtype and shape is right: the small tensors can be read
        offsets = handle.get_tensor("offsets")
        problem = _offsets_problem(offsets, shard["tokens"]) or _values_problem(handle, manifest)
    if problem is not None:
        raise FeatureStoreError(f"{path}: {problem}; {RECOMPUTE}")
    return load_json(metadata["keys"]), offsets.tolist()


def _header_problem(handle, shard: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """What in the shard's header differs from the tensors its manifest entry implies, or None."""
    layout, names = shard_layout(manifest, shard), set(handle.keys())
    missing, unknown = sorted(set(layout) - names - {TARGET_TOP}), sorted(names - set(layout))
    if missing:
        return f"tensors {missing} are missing"
    if unknown:
        return f"tensors {unknown} are not part of a store of layers {manifest['layers']} in {manifest['dtype']}"
    for name in [name for name in layout if name in names]:  # the counts (input_ids, offsets) first
        dtype, shape = layout[name]
        found = handle.get_slice(name)
        if (found.get_dtype(), found.get_shape()) != (dtype, shape):
            return (f"{name} is {found.get_dtype()} {found.get_shape()}, where a shard of {shard['samples']} samples "
                    f"and {shard['tokens']} tokens (its manifest entry's samples and tokens) of a {manifest['dtype']} "
                    f"store holds {dtype} {shape}")
    return None


def _metadata_problem(metadata: dict[str, str], shard: dict[str, Any]) -> str | None:
    """What in the shard's metadata differs from its manifest entry (split, sample keys), or None."""
    if metadata.get("split") != shard["split"]:
        return f"its metadata's split is {metadata.get('split')!r}, the manifest lists it as {shard['split']!r}"
    try:
        keys = load_json(metadata["keys"])
    except (KeyError, TypeError, json.JSONDecodeError):
        keys = None
    if not isinstance(keys, list) or len(keys) != shard["samples"] or not all(isinstance(k, str) for k in keys):
        return f"its metadata's keys are not a JSON list of {shard['samples']} sample keys (the manifest's samples)"
    return None


def _offsets_problem(offsets: torch.Tensor, tokens: int) -> str | None:
    """Why `offsets` do not cut the shard's `tokens` rows into samples of at least one row, or None."""
    if offsets[0] != 0 or offsets[-1] != tokens:
        return f"offsets run from {int(offsets[0])} to {int(offsets[-1])}, not from 0 to the shard's {tokens} tokens"
    empty = (offsets[1:] <= offsets[:-1]).nonzero()
    if len(empty):
        i = int(empty[0, 0])
        return f"offsets give sample {i} the rows {int(offsets[i])}:{int(offsets[i + 1])}, not at least one row"
    return None


def _values_problem(handle, manifest: dict[str, Any]) -> str | None:
    """The first token id outside the target's vocabulary, or loss-mask value other than 0 and 1, or None."""
    vocab = manifest["target"]["vocab_size"]
    ends = {"input_ids": vocab, TARGET_TOP: vocab, "loss_mask": 2}
    for name in [name for name in ends if name in handle.keys()]:
        values = handle.get_tensor(name)
        outside = ((values < 0) | (values >= ends[name])).nonzero()
        if len(outside):
            row = int(outside[0, 0])
            return f"{name}[{row}] is {int(values[row])}, outside 0..{ends[name] - 1}"
    return None
