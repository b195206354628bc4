"""Head files: the trained weights alone (safetensors) and a config that rebuilds the head.

    <dir>/model.safetensors   the head's state_dict: never the target's embedding or LM head
    <dir>/config.json         head spec, the target's identity, captured layers, recipe

Exports of a head (`mtptrain export`) are read back by mtptrain/export/source.py, which hands their config and
weights to `head_from`.

Loading checks the target's fingerprints and refuses a head trained for another target.
"""

from __future__ import annotations

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
from mtptrain.io import atomic_write, atomic_write_json, read_marked_json
from mtptrain.target import identity_mismatch

log = logging.getLogger(__name__)

HEAD_FORMAT = "mtptrain-head/1"

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
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    atomic_write_json(directory / "config.json", {"format": HEAD_FORMAT, "head": asdict(spec),
                                                  "target": target_identity, **(extra or {})})


def read_head_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    return read_marked_json(path, HEAD_FORMAT, HeadCheckpointError,
                            f"{path} does not exist: not a head directory written by mtptrain train")


def load_head(directory: Path, frozen: FrozenTarget, target_identity: dict) -> tuple[nn.Module, HeadSpec]:
    """A head directory written by `mtptrain train` (an export: `mtptrain.export.source.load_head_directory`)."""
    directory = Path(directory)
    config = read_head_config(directory)
    return head_from(config, load_file(str(directory / "model.safetensors")), frozen, target_identity,
                     directory / "config.json")


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
