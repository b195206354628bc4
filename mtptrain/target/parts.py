"""The target read in parts instead of loaded whole: its config, its module tree on the meta device, the parts a
head uses (embedding, final norm, LM head), and named tensors from its safetensors files."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mtptrain.config import TargetConfig
from mtptrain.io import contained, read_json_object
from mtptrain.target.source import TargetError, load_hint, resolve_local_dir

# transformers (~0.7 s to import) and huggingface_hub's download client (~0.1 s) are imported inside the
# functions that read a config or a file of the checkpoint, as in mtptrain/target/source.py: a command's checks
# of its inputs answer before paying for them.

log = logging.getLogger(__name__)


def load_config(cfg: TargetConfig, source: str | None = None):
    from transformers import AutoConfig  # lazy: see the note after the imports

    source = source or resolve_local_dir(cfg)[0]
    try:
        return AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, RecursionError) as exc:
        raise TargetError(load_hint(cfg.model, exc)) from exc


def meta_model(config, dtype: torch.dtype, cfg: TargetConfig) -> nn.Module:
    """The model with every weight on the meta device: shapes and module tree, no memory."""
    from transformers import AutoModelForCausalLM  # lazy: see the note after the imports

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)


def frozen_modules(model: nn.Module) -> list[nn.Module]:
    """The parts of the target a head uses: input embedding, final norm, LM head."""
    return [model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings()]


def frozen_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the frozen parts, in the model's order, a tied weight once."""
    ids = {id(p) for module in frozen_modules(model) for p in module.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def checkpoint_file(source: str, filename: str, cfg: TargetConfig) -> Path | None:
    """A file of the checkpoint: from the model directory, or downloaded alone from the hub; None if absent."""
    if Path(source).is_dir():
        path = Path(source) / filename
        return path if path.is_file() else None
    # lazy: see the note after the imports
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename, revision=cfg.revision))
    except EntryNotFoundError:
        return None
    except Exception as exc:  # hub errors come in many classes
        raise TargetError(load_hint(cfg.model, exc)) from exc


def read_checkpoint_tensors(source: str, cfg: TargetConfig, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The named tensors from the checkpoint's safetensors files, reading only the files that hold them."""
    weight_map = checkpoint_weight_map(source, cfg)
    if weight_map is None:
        log.info("%s has no safetensors files: loading the whole target", cfg.model)
        return None
    missing = [n for n in names if n not in weight_map]
    if missing:
        log.warning("%s names no tensor %s in its safetensors files: loading the whole target", cfg.model,
                    ", ".join(missing))
        return None
    tensors = {}
    for filename in sorted({weight_map[n] for n in names}):
        with open_checkpoint_file(checkpoint_file(source, filename, cfg)) as f:
            tensors.update({n: f.get_tensor(n) for n in names if weight_map[n] == filename})
    return tensors


def open_checkpoint_file(path: Path | str):
    """safe_open over one of the target's safetensors files, a TargetError naming it where it does not read as one
    (a damaged or cut-off download, a header past its limits)."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise TargetError(f"{path} cannot be read as safetensors ({exc}): a damaged or cut-off file; download or "
                          "save the model again") from None


def checkpoint_weight_map(source: str, cfg: TargetConfig) -> dict[str, str] | None:
    """Tensor name -> safetensors file of the checkpoint (an index, or a single file); None without one."""
    index = checkpoint_file(source, "model.safetensors.index.json", cfg)
    if index is not None:
        return read_weight_map(index)
    single = checkpoint_file(source, "model.safetensors", cfg)
    if single is None:
        return None
    with open_checkpoint_file(single) as f:
        return {key: "model.safetensors" for key in f.keys()}


def read_weight_map(index: Path, error: type[Exception] = TargetError) -> dict[str, str]:
    """Tensor name -> file of a checkpoint's model.safetensors.index.json; every file must lie in its directory."""
    fix = "the checkpoint's index is damaged: download or save the model again"
    weight_map = read_json_object(index, error, fix).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise error(f"{index} has no \"weight_map\" object of tensor names to file names: {fix}")
    for file in sorted(set(weight_map.values())):
        contained(Path(index).parent, file, index, "weight_map", error)
    return weight_map
