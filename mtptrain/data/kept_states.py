"""The target's states kept while `mtptrain regenerate` decodes, for `mtptrain precompute` to copy.

Regenerating a conversation runs the target over every one of its tokens: the
prompts as prefill chunks, the answers one decoding step at a time. With
`regenerate.keep_states` (the native runtime only), the decoder keeps the
states after `precompute.layers` at each position a row takes in
(runtime/batch.py), and when a conversation's last answer ends, its row takes
in the whole conversation as precompute will tokenize it (its cached prefix is
kept, so only the end-of-turn tail, and any part the chat template tokenizes
differently from the decoded ids, is computed). The states of each position
are therefore those of the sample precompute builds, computed once.

Each group of conversations (the unit regenerate writes and resumes) goes to
`<data.regenerated>.states/group-NNNNN.safetensors`: the samples' ids, their
offsets and one [tokens, hidden] tensor per layer, keyed by conversation id.
The regeneration's state file lists each group's file with its sha256, the
layers, the precision and the runtime that computed them.

Precompute uses them only where they fit: the same target and tokenizer (the
regeneration's own check), the store's layers among those kept, the store's
precision and the runtime's dtype, each file matching its recorded sha256 and
shapes, and each sample's ids equal to the kept ones. Anything else is
computed by the target as before, so a stale, partial or tampered copy costs
time, never correctness.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from mtptrain.data.samples import Sample
from mtptrain.io import atomic_write, load_json, sha256_file, write_safetensors

log = logging.getLogger(__name__)

VERSION = 1
TARGET_TOP = "target_top"  # the target's greedy next token after each position, -1 where decoding did not compute it


def hidden_key(layer: int) -> str:
    """A kept file's tensor of the states after `layer` (named as in a feature store's shards)."""
    return f"hidden.{layer}"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def states_dir(output: Path) -> Path:
    """Where a regeneration into `output` keeps its states."""
    return output.with_name(output.name + ".states")


def group_file(name: str) -> bool:
    """Whether a group's recorded file name is one `write_group` gives, inside the states directory."""
    return Path(name).name == name and name.startswith("group-") and name.endswith(".safetensors")


def on_disk(output: Path, groups: list[dict]) -> dict:
    """What the kept states of a regeneration into `output` (its recorded `groups`) still hold on disk: the
    directory is deleted once the store is built, so a rerun reports only the group files that remain."""
    directory = states_dir(output)
    present = [g for g in groups if group_file(g["file"]) and (directory / g["file"]).is_file()]
    return {"directory": str(directory), "conversations": sum(g["samples"] for g in present),
            "tokens": sum(g["tokens"] for g in present), "bytes": sum(g["bytes"] for g in present),
            "missing_files": len(groups) - len(present)}


def kept_dtype(store_dtype: str) -> str:
    """The precision states are kept in for a store of `store_dtype`: its own, or bfloat16 for a float8 store
    (whose rows precompute quantizes from bfloat16 as it writes them)."""
    return store_dtype if store_dtype in _DTYPES else "bfloat16"


def write_group(directory: Path, group: int, keys: list[str], ids: list[np.ndarray], states: list[torch.Tensor],
                tops: list[torch.Tensor], layers: list[int]) -> dict:
    """Write one group's kept states atomically: `states[i]` [len(ids[i]), len(layers), hidden] for conversation
    `keys[i]` (at least one), and `tops[i]`, the target's greedy next token after each position where decoding
    computed it (-1 elsewhere). Returns its entry for the regeneration's state."""
    name = f"group-{group:05d}.safetensors"
    offsets = np.cumsum([0] + [len(row) for row in ids]).astype(np.int64)
    every = torch.cat(states)
    tensors = {"input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int32)),
               "offsets": torch.from_numpy(offsets),
               TARGET_TOP: torch.cat(tops).to(torch.int32),
               **{hidden_key(layer): every[:, i].contiguous() for i, layer in enumerate(layers)}}
    written: dict = {}
    atomic_write(directory / name, lambda tmp: written.update(
        write_safetensors(tmp, tensors, {"keys": json.dumps(keys), "version": str(VERSION)})))
    return {"file": name, "samples": len(keys), "tokens": int(offsets[-1]), **written}


def new_entry(layers: list[int], dtype: str, runtime: dict) -> dict:
    """The state's record of what is kept, before any group is written."""
    return {"version": VERSION, "layers": list(layers), "dtype": dtype, "runtime": runtime, "groups": {}}


GROUP_FIELDS = {"file": str, "samples": int, "tokens": int, "bytes": int, "sha256": str}


def valid_entry(entry: object) -> bool:
    """Whether a state's "states" record has the form `new_entry` and `write_group` give it (a hostile or torn
    state file's is dropped, never followed)."""
    if not isinstance(entry, dict) or entry.get("version") != VERSION or entry.get("dtype") not in _DTYPES:
        return False
    layers, groups = entry.get("layers"), entry.get("groups")
    if not isinstance(layers, list) or not all(type(i) is int for i in layers) or not isinstance(entry.get("runtime"), dict):
        return False
    return isinstance(groups, dict) and all(
        isinstance(g, dict) and all(type(g.get(k)) is t for k, t in GROUP_FIELDS.items()) for g in groups.values())


def entry_fits(entry: object, layers: list[int], dtype: str, runtime: dict) -> bool:
    """Whether a state's record was kept with these layers, precision and runtime (a run resumed with others
    starts a new record: one record, one way of computing)."""
    return valid_entry(entry) and entry["layers"] == list(layers) and entry["dtype"] == dtype and \
        entry["runtime"] == runtime


class KeptStates:
    """The kept states of a finished regeneration, looked up by sample. Files are opened, checked against their
    sha256 and indexed when a sample of theirs is first asked for."""

    def __init__(self, directory: Path, groups: list[dict], layers: list[int], dtype: torch.dtype, hidden: int,
                 vocab: int):
        self.directory, self.layers, self.dtype, self.hidden, self.vocab = directory, layers, dtype, hidden, vocab
        self.files = {g["file"]: g for g in groups}
        self.where: dict[str, tuple[str, int]] | None = None  # key -> (file, row), built on first use
        self.opened: dict[str, dict] = {}  # file -> its tensors (memory-mapped), once checked
        self.bad: set[str] = set()
        self.copied = self.computed = 0  # samples found / not found

    @classmethod
    def open(cls, output: Path, state_file: Path, layers: list[int], store_dtype: str, runtime: dict, hidden: int,
             vocab: int) -> "KeptStates | None":
        """The states a regeneration into `output` (its state in `state_file`) kept, where they can stand in for
        this store's (see the module's docstring); None otherwise, saying why in the log."""
        try:
            state = load_json(state_file.read_text())
        except (OSError, ValueError):
            return None
        entry = state.get("states") if isinstance(state, dict) else None
        if entry is None:
            return None
        if not valid_entry(entry):
            log.warning("%s: its \"states\" entry is not one mtptrain wrote; computing every sample", state_file)
            return None
        why = None
        if not set(layers) <= set(entry["layers"]):
            why = f"they hold layers {entry['layers']}, this store takes {layers}"
        elif entry["dtype"] != kept_dtype(store_dtype):
            why = f"they are in {entry['dtype']}, this store is in {store_dtype}"
        elif (entry["runtime"].get("runtime"), entry["runtime"].get("dtype")) != \
                (runtime.get("runtime"), runtime.get("dtype")):
            why = (f"the regeneration computed on {entry['runtime']}, this store computes on {runtime}: one store "
                   "holds one precision")
        if why is not None:
            log.info("precompute: not copying the states %s kept (%s); computing them", output.name, why)
            return None
        groups = [g for g in entry["groups"].values() if group_file(g["file"])]
        if not groups:
            return None
        return cls(states_dir(output), groups, list(layers), _DTYPES[entry["dtype"]], hidden, vocab)

    def _index(self) -> dict[str, tuple[str, int]]:
        """Every kept conversation's key -> its file and row, from the files' metadata (headers only)."""
        where: dict[str, tuple[str, int]] = {}
        for name in self.files:
            path = self.directory / name
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys = load_json((handle.metadata() or {}).get("keys", "null"))
            except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # missing or unreadable: computed
                log.warning("%s cannot be read (%s); its conversations are computed", path, exc)
                self.bad.add(name)
                continue
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                log.warning("%s names its conversations in a form mtptrain did not write; they are computed", path)
                self.bad.add(name)
                continue
            for row, key in enumerate(keys):
                where.setdefault(key, (name, row))
        return where

    def _tensors(self, name: str) -> dict | None:
        """A file's ids, offsets and handle once its bytes match the recorded sha256 and its shapes each other;
        None otherwise. The states are read a sample at a time, from the file."""
        if name in self.bad:
            return None
        if name in self.opened:
            return self.opened[name]
        path, entry = self.directory / name, self.files[name]
        problem, opened = None, None
        try:
            if sha256_file(path) != entry["sha256"]:
                problem = "it does not match the sha256 the regeneration recorded"
            else:
                handle = safe_open(str(path), framework="pt")
                wanted = {"input_ids", "offsets", TARGET_TOP, *(hidden_key(layer) for layer in self.layers)}
                if not wanted <= set(handle.keys()):
                    problem = f"it lacks {sorted(wanted - set(handle.keys()))}"
                else:
                    opened = {"handle": handle, "input_ids": handle.get_tensor("input_ids"),
                              "offsets": handle.get_tensor("offsets"), TARGET_TOP: handle.get_tensor(TARGET_TOP)}
                    problem = self._shape_problem(opened, len(load_json(handle.metadata()["keys"])))
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            problem = f"it cannot be read ({exc})"
        if problem is not None:
            log.warning("%s: %s; its conversations are computed instead", path, problem)
            self.bad.add(name)
            return None
        self.opened[name] = opened
        return opened

    def _shape_problem(self, opened: dict, samples: int) -> str | None:
        ids, offsets, handle = opened["input_ids"], opened["offsets"], opened["handle"]
        if ids.dtype != torch.int32 or ids.dim() != 1 or offsets.dtype != torch.int64 or \
                tuple(offsets.shape) != (samples + 1,):
            return "its ids or offsets are not laid out as mtptrain writes them"
        if offsets[0] != 0 or offsets[-1] != ids.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
            return "its offsets do not cut its ids into conversations"
        tops = opened[TARGET_TOP]
        if tops.dtype != torch.int32 or tuple(tops.shape) != tuple(ids.shape) or bool((tops < -1).any()) or \
                bool((tops >= self.vocab).any()):
            return f"its {TARGET_TOP} is not one token id (or -1) of the target's {self.vocab} per position"
        names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
        for layer in self.layers:
            states = handle.get_slice(hidden_key(layer))
            if states.get_dtype() != names[self.dtype] or list(states.get_shape()) != [ids.shape[0], self.hidden]:
                return (f"its layer {layer} is {states.get_dtype()} {states.get_shape()}, not {names[self.dtype]} "
                        f"[{ids.shape[0]}, {self.hidden}]")
        return None

    def states_for(self, sample: Sample) -> tuple[dict[int, torch.Tensor], torch.Tensor] | None:
        """The kept states [len(sample), hidden] per layer of `sample` and the target's greedy next token after
        each (-1 where decoding did not compute it), if its ids are the ones kept; else None."""
        if self.where is None:
            self.where = self._index()
        found = self.where.get(sample.key)
        tensors = self._tensors(found[0]) if found is not None else None
        if tensors is None:
            self.computed += 1
            return None
        row = found[1]
        start, end = int(tensors["offsets"][row]), int(tensors["offsets"][row + 1])
        if end - start != len(sample) or not np.array_equal(tensors["input_ids"][start:end].numpy(),
                                                           sample.input_ids.astype(np.int32)):
            self.computed += 1
            return None
        self.copied += 1
        return ({layer: tensors["handle"].get_slice(hidden_key(layer))[start:end] for layer in self.layers},
                tensors[TARGET_TOP][start:end])
