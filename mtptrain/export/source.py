"""What an export reads: a trained head directory, and the target it was trained on.

The head's config.json records the recipe it was trained with, so the
target's config (and, for formats that carry them, its embedding and LM head)
is found without a recipe on the command line. `target` overrides where the
target lives on this machine (a local directory or a hub id).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mtptrain.config import EMBEDDED_TARGET, TargetConfig
from mtptrain.export.formats import read_export
from mtptrain.export.sidecar import SIDECAR, ExportError, is_export, read_sidecar
from mtptrain.heads.checkpoint import head_from, read_head, read_head_config
from mtptrain.heads.spec import HeadSpec
from mtptrain.io import read_json_object
from mtptrain.heads.common import FrozenTarget
from mtptrain.target import (
    identity_mismatch, load_identified_parts, read_weight_map, resolve_local_dir,
)

# The hub model the embedded GGUF (a Q4_1 quantisation) was made from: what a server loads as the target.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class HeadSource:
    directory: Path
    config: dict  # the head's own config.json
    spec: HeadSpec
    state: dict[str, torch.Tensor]  # the head's weights, our names
    target_config: dict  # the target's transformers config, as a dict (every key, defaults spelled out)
    target_source: str  # what from_pretrained loads: a local directory or a hub id
    target_cfg: TargetConfig  # the recipe's target section (with export.target as its model when set)

    @property
    def target_model(self) -> str:
        return self.target_cfg.model

    def verify_target(self) -> None:
        """Refuse the target unless its identity is the head's: the fingerprint of every weight (read from the
        safetensors files one tensor at a time, or from a whole load on CPU), the tokenizer's and the
        architecture's."""
        cfg = self.target_cfg.model_copy(update={"dtype": "bfloat16", "device": "cpu"})
        _, loaded = load_identified_parts(cfg)
        key = identity_mismatch(self.identity, loaded)
        if key is not None:
            raise ExportError(f"target '{self.target_model}' has {key} {loaded.get(key)}, but the head was trained "
                              f"for '{self.identity.get('name')}' ({self.identity.get(key)}): point export.target at "
                              "the checkpoint the head was trained on")

    @property
    def identity(self) -> dict:
        return self.config["target"]

    @property
    def float_dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.state.values() if t.is_floating_point())

    def served_target(self) -> str:
        """The target as a serving engine loads it: a hub id or a local directory, never a GGUF file."""
        if self.target_model == EMBEDDED_TARGET:
            return EMBEDDED_HUB_ID
        if self.target_model.endswith(".gguf") or self.config.get("train", {}).get("recipe", {}).get(
                "target", {}).get("gguf_file"):
            raise ExportError(f"the target {self.target_model} is a GGUF file, which vLLM and SGLang do not serve as "
                              "a verifier: set export.verifier to its hub id or a local model directory")
        path = Path(self.target_model).expanduser()
        return str(path.resolve()) if path.is_dir() else self.target_model

    def _checkpoint(self) -> tuple[Path, dict[str, str]]:
        """The target's local checkpoint directory and its tensor -> file map (hub ids are downloaded)."""
        directory = Path(self.target_source)
        if not directory.is_dir():
            # huggingface_hub's download client takes ~0.15 s to import: only a target named by hub id needs it
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(self.target_source, allow_patterns=["*.json", "*.safetensors"]))
        index = directory / "model.safetensors.index.json"
        files = (read_weight_map(index, ExportError) if index.is_file()
                 else {k: "model.safetensors" for k in _keys(directory / "model.safetensors")})
        return directory, files

    def target_config_json(self) -> dict:
        """The target's config.json as the checkpoint holds it (every key the checkpoint's authors wrote)."""
        directory, _ = self._checkpoint()
        return read_json_object(directory / "config.json", ExportError, "the target's checkpoint is damaged: "
                                "download or save the model again")

    def target_tensor(self, *names: str) -> torch.Tensor:
        """The first of `names` found in the target's safetensors checkpoint (read alone, not the whole model)."""
        directory, files = self._checkpoint()
        for name in names:
            if name in files:
                with safe_open(str(directory / files[name]), framework="pt") as fh:
                    return fh.get_tensor(name)
        raise ExportError(f"{directory}: none of {', '.join(names)} in the target's safetensors checkpoint")

    def target_layer_shapes(self) -> dict[str, tuple]:
        """Tensor name (within the layer) -> shape for the target's last decoder layer."""
        directory, files = self._checkpoint()
        prefix = f"model.layers.{self.target_config['num_hidden_layers'] - 1}."
        shapes = {}
        for name, file in files.items():
            if name.startswith(prefix):
                with safe_open(str(directory / file), framework="pt") as fh:
                    shapes[name[len(prefix):]] = tuple(fh.get_slice(name).get_shape())
        return shapes


def _keys(path: Path) -> list[str]:
    if not path.is_file():
        raise ExportError(f"{path.parent} holds neither model.safetensors nor model.safetensors.index.json: "
                          "the target's weights must be a safetensors checkpoint")
    with safe_open(str(path), framework="pt") as fh:
        return list(fh.keys())


def open_head(directory: Path, target: str | None = None) -> HeadSource:
    """Read a head written by `mtptrain train` (or an export of one) and locate its target (`target` overrides
    the recorded one)."""
    # transformers takes ~0.7 s to import: training and eval import this module too, and their checks of their
    # inputs answer before any model loads (as in mtptrain.target)
    from transformers import AutoConfig

    directory = Path(directory)
    config, state = read_head_files(directory)  # an earlier export too: re-export it in another format
    recorded = config.get("train", {}).get("recipe", {}).get("target")
    if target is None and recorded is None:
        raise ExportError(f"{directory / 'config.json'} does not record the recipe's target: set export.target "
                          "to the target's model directory or hub id")
    fields = dict(recorded or {})
    if target is not None:
        fields.update(model=target, gguf_file=None, revision=None)
    cfg = TargetConfig(**fields)
    source, _ = resolve_local_dir(cfg)
    try:
        loaded = AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        target_config = loaded.to_dict()
    except (OSError, RecursionError) as exc:  # RecursionError: a config.json nested past the JSON parser's depth
        raise ExportError(f"could not read the config of target '{cfg.model}': {exc}\n"
                          "Set export.target to a local copy of the target's model directory.") from exc
    identity = config["target"]
    if target_config.get("hidden_size") != identity.get("hidden_size") or \
            target_config.get("vocab_size") != identity.get("vocab_size"):
        raise ExportError(f"target '{cfg.model}' has hidden size {target_config.get('hidden_size')} and vocabulary "
                          f"{target_config.get('vocab_size')}, but the head was trained for "
                          f"'{identity.get('name')}' ({identity.get('hidden_size')}, {identity.get('vocab_size')})")
    return HeadSource(directory, config, HeadSpec(**config["head"]), state, target_config, source, cfg)


def read_head_files(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights under the head's names) of a head directory written by `mtptrain train`, or of an export
    of one (`mtptrain export`, any format)."""
    directory = Path(directory)
    if is_export(directory):
        return read_export(directory)
    return read_head(directory)


def load_head_directory(directory: Path, frozen: FrozenTarget, target_identity: dict):
    """(head, spec) from a head directory or an export of one, refused unless trained for `target_identity`."""
    head, spec, _ = load_head_and_config(directory, frozen, target_identity)
    return head, spec


def load_head_and_config(directory: Path, frozen: FrozenTarget, target_identity: dict):
    """(head, spec, the head's own config as training wrote it) from a head directory or an export of one, the
    config read once with the weights (eval records its weights' digest from it)."""
    config, state = read_head_files(directory)
    head, spec = head_from(config, state, frozen, target_identity, Path(directory) / "config.json")
    return head, spec, config


def read_head_config_of(directory: Path) -> dict:
    """The head's own config (as training wrote it) of a head directory or of an export of one, without its
    weights."""
    if not is_export(directory):
        return read_head_config(directory)
    config = read_sidecar(directory).get("head_config")
    if not isinstance(config, dict):
        raise ExportError(f"{Path(directory) / SIDECAR} holds no head config: it was changed after `mtptrain "
                          "export` wrote it; export the head again")
    return config
