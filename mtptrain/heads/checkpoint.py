"""Head files: the trained weights alone (safetensors) and a config that rebuilds the head.

    <dir>/model.safetensors   the head's state_dict: never the target's embedding or LM head
    <dir>/config.json         head spec, the target's identity, captured layers, recipe

load_head also reads the directories `mtptrain export` writes (mtptrain/export/).

Loading checks the target's fingerprints and refuses a head trained for another target.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mtptrain.heads.common import FrozenTarget
from mtptrain.heads.eagle import EagleHead
from mtptrain.heads.eagle3 import DraftVocab, Eagle3Head
from mtptrain.heads.mtp import MTPHead
from mtptrain.io import atomic_write, atomic_write_json
from mtptrain.target import identity_mismatch

HEAD_FORMAT = "mtptrain-head/1"
EXPORT_SIDECAR = "mtptrain.json"  # in a directory `mtptrain export` wrote: the head's own config (mtptrain/export/)


class HeadCheckpointError(RuntimeError):
    pass


@dataclass
class HeadSpec:
    kind: str
    norms: str = "restored"
    last_layer: int = -1  # target layer whose states the head reads (eagle, mtp) and is matched to
    feature_layers: list[int] = field(default_factory=list)  # eagle3: fused layers, low to high
    ttt_steps: int = 1
    draft_vocab_size: int = 0
    mtp_depths: int = 1
    mtp_share: bool = False
    mtp_input: str = "raw"  # mtp: the target state depth 1 reads ("normed" or "raw"); absent in older heads = raw

    @property
    def draft_positions(self) -> int:
        return {"eagle": 1, "mtp": self.mtp_depths, "eagle3": self.ttt_steps}[self.kind]


def build_head(spec: HeadSpec, frozen: FrozenTarget, vocab: DraftVocab | None = None) -> nn.Module:
    if spec.kind == "eagle":
        return EagleHead(frozen, norms=spec.norms)
    if spec.kind == "mtp":
        return MTPHead(frozen, depths=spec.mtp_depths, share=spec.mtp_share, norms=spec.norms,
                       target_input=spec.mtp_input)
    if spec.kind == "eagle3":
        if vocab is None:  # rebuilt from a checkpoint: the maps come with the weights
            vocab = DraftVocab.from_counts(Counter(), spec.draft_vocab_size, frozen.config.vocab_size)
        return Eagle3Head(frozen, vocab, num_features=len(spec.feature_layers))
    raise ValueError(f"unknown head kind {spec.kind!r}")


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
    if not path.is_file():
        raise HeadCheckpointError(f"{path} does not exist: not a head directory written by mtptrain train")
    config = json.loads(path.read_text())
    if config.get("format") != HEAD_FORMAT:
        raise HeadCheckpointError(f"{path}: format {config.get('format')!r}, expected {HEAD_FORMAT!r}")
    return config


def load_head(directory: Path, frozen: FrozenTarget, target_identity: dict) -> tuple[nn.Module, HeadSpec]:
    """A head directory written by `mtptrain train`, or an export of one (`mtptrain export`, any format)."""
    directory = Path(directory)
    if (directory / EXPORT_SIDECAR).is_file():
        from mtptrain.export import read_export

        config, state = read_export(directory)
    else:
        config = read_head_config(directory)
        state = load_file(str(directory / "model.safetensors"))
    stored = config["target"]
    key = identity_mismatch(stored, target_identity)
    if key is not None:
        raise HeadCheckpointError(
            f"{directory / 'config.json'}: this head was trained for target '{stored.get('name')}' "
            f"({key} {stored.get(key)}), not for '{target_identity.get('name')}' ({target_identity.get(key)}). "
            "Load it with the target it was trained on.")
    spec = HeadSpec(**config["head"])
    head = build_head(spec, frozen)
    head.load_state_dict(state, strict=True)
    return head.to(next(frozen.embed.parameters()).device), spec
