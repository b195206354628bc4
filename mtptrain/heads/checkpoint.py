"""Head files: the trained weights alone (safetensors) and a config that rebuilds the head.

    <dir>/model.safetensors   the head's state_dict: never the target's embedding or LM head
    <dir>/config.json         head spec, the target's identity, captured layers, recipe, and "sha256": the
                              digests of this config (all but that field) and of the weights, taken when written

Exports of a head (`mtptrain export`) are read back by mtptrain/export/source.py, which hands their config and
weights to `head_from`.

Reading checks the digests, so that a config edited after training (other layer ids, say) never drafts with
weights trained for the recorded ones; loading checks the target's fingerprints and refuses a head trained for
another target.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mtptrain.config import EMBEDDED_TARGET, Recipe
from mtptrain.errors import MtptrainError
from mtptrain.heads.common import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.io import atomic_write, atomic_write_json, read_marked_json, sha256_file
from mtptrain.target import identity_mismatch

log = logging.getLogger(__name__)

HEAD_FORMAT = "mtptrain-head/1"
WEIGHTS = "model.safetensors"
DIGEST = "sha256"  # config.json's field: {"config": ..., "weights": ...}

# The head trained by recipes/reference.yaml on the embedded default, kept in the repository so that
# `mtptrain eval` shows a real head before anything has been trained (its README is in that directory).
PRETRAINED_HEAD = Path(__file__).resolve().parents[2] / "pretrained" / "smollm2-135m-instruct-eagle3"


class HeadCheckpointError(MtptrainError, RuntimeError):
    pass


def save_head(directory: Path, head: nn.Module, spec: HeadSpec, target_identity: dict, extra: dict | None = None,
              dtype: torch.dtype | None = None) -> None:
    """Weights (floating-point ones cast to `dtype` when given; index buffers stay integers) and config."""
    directory = Path(directory)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in head.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    config = json.loads(json.dumps({"format": HEAD_FORMAT, "head": asdict(spec), "target": target_identity,
                                    **(extra or {})}))  # as it reads back: tuples are lists
    config[DIGEST] = {"config": config_digest(config), "weights": sha256_file(directory / WEIGHTS)}
    atomic_write_json(directory / "config.json", config)


def config_digest(config: dict) -> str:
    """sha256 of a head config's content, its own "sha256" field left out (key order and spacing do not count)."""
    content = {k: v for k, v in config.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_head_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    return read_marked_json(path, HEAD_FORMAT, HeadCheckpointError,
                            f"{path} does not exist: not a head directory written by mtptrain train")


def read_head(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a head directory written by `mtptrain train`, refused when either was changed
    after training."""
    directory = Path(directory)
    config, weights = read_head_config(directory), directory / WEIGHTS
    if not weights.is_file():
        raise HeadCheckpointError(f"{weights} is missing: {directory} is not a whole head directory. Restore the "
                                  f"{WEIGHTS} written with its config.json, or train the head again.")
    recorded = check_config_digest(config, directory / "config.json")
    if recorded is not None and recorded.get("weights") != sha256_file(weights):
        raise HeadCheckpointError(f"{weights} was changed after training: its sha256 differs from the one "
                                  f"{directory / 'config.json'} recorded when the head was written, so these are not "
                                  f"the weights that config describes. Restore the {WEIGHTS} written by training, "
                                  "or train the head again.")
    return config, load_file(str(weights))


def weights_digest(config: dict) -> str | None:
    """The sha256 of a head's weights its config recorded when training wrote it (None for a head written before
    heads recorded one); `read_head` checks it against the weights."""
    recorded = config.get(DIGEST)
    return recorded.get("weights") if isinstance(recorded, dict) else None


def check_config_digest(config: dict, where: Path) -> dict | None:
    """The digests `config` records, refused unless its content is the one they were taken of; None, with a
    warning, for a head written before heads recorded them (it is used unchecked)."""
    recorded = config.get(DIGEST)
    if recorded is None:
        log.warning("%s records no sha256 of the head (written before mtptrain recorded one): it is used "
                    "unchecked; train the head again to have edits after training caught", where)
        return None
    if not isinstance(recorded, dict) or recorded.get("config") != config_digest(config):
        raise HeadCheckpointError(f"{where}: the head's config was changed after training (its content no longer "
                                  "matches the sha256 recorded when it was written), so its layers, sizes or "
                                  "target may not be the ones the weights were trained with. Undo the edit (restore "
                                  "the file as it was written), or train the head again.")
    return recorded


def load_head(directory: Path, frozen: FrozenTarget, target_identity: dict) -> tuple[nn.Module, HeadSpec]:
    """A head directory written by `mtptrain train` (an export: `mtptrain.export.source.load_head_directory`)."""
    config, state = read_head(directory)
    return head_from(config, state, frozen, target_identity, Path(directory) / "config.json")


def head_from(config: dict, state: dict[str, torch.Tensor], frozen: FrozenTarget, target_identity: dict,
              where: Path) -> tuple[nn.Module, HeadSpec]:
    """The head a config and its weights describe, refused unless it was trained for `target_identity`."""
    stored = config["target"]
    key = identity_mismatch(stored, target_identity)
    if key is not None:
        raise HeadCheckpointError(
            f"{where}: this head was trained for target '{stored.get('name')}' "
            f"({key} {stored.get(key)}), not for '{target_identity.get('name')}' ({target_identity.get(key)}). "
            "Load it with the target it was trained on.")
    spec = HeadSpec(**config["head"])
    head = spec.family.build(spec, frozen)
    head.load_state_dict(state, strict=True)
    return head.to(next(frozen.embed.parameters()).device), spec


def head_directory(recipe: Recipe) -> Path:
    """The head a recipe's eval and export use: eval.head if set; else the recipe's trained head; else, on the
    embedded default with nothing trained yet, the head shipped in pretrained/."""
    if recipe.eval.head:
        return Path(recipe.eval.head)
    trained = Path(recipe.train.output_dir) / "head"
    if (trained / "config.json").is_file() or recipe.target.model != EMBEDDED_TARGET:
        return trained
    if (PRETRAINED_HEAD / "config.json").is_file():
        log.info("no trained head at %s: using the shipped head %s (recipes/reference.yaml); train one or set "
                 "eval.head to measure another", trained, PRETRAINED_HEAD)
        return PRETRAINED_HEAD
    return trained
