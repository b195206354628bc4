"""`mtptrain stitch`: a deepseek-mtp export written into a copy of the target checkpoint.

The result is the target's own checkpoint with its MTP layers after the last
decoder layer (model.layers.N .. N+m-1, in model-mtp.safetensors, listed in
model.safetensors.index.json) and num_nextn_predict_layers in config.json:
the layout of DeepSeek-V3's published checkpoint, which vLLM and SGLang serve
with MTP from the one directory. The target's weight files are hard-linked
when the file system allows (copied otherwise) and never modified.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtptrain.config import TargetConfig
from mtptrain.export.sidecar import SIDECAR, ExportError, read_sidecar, sidecar_weights
from mtptrain.target import identity_mismatch, load_target, read_weight_map
from mtptrain.io import read_json_object, tmp_name

MTP_FILE = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


def stitch_mtp(export_dir: Path, target_dir: Path, out: Path) -> dict:
    export_dir, target_dir, out = Path(export_dir), Path(target_dir), Path(out)
    sidecar = read_sidecar(export_dir)
    if sidecar.get("export_format") != "deepseek-mtp":
        raise ExportError(f"{export_dir} is a {sidecar.get('export_format')} export; stitch takes a deepseek-mtp "
                          "export (mtptrain export --format deepseek-mtp)")
    if not (target_dir / "config.json").is_file():
        raise ExportError(f"{target_dir} holds no config.json: --target must be the target's local checkpoint "
                          "directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory: stitch writes a new directory")
    if not (export_dir / "config.json").is_file():
        raise ExportError(f"{export_dir / 'config.json'} is missing: the export is incomplete; export again")
    target_config = read_json_object(target_dir / "config.json", ExportError, "point at the target's own checkpoint "
                                     "directory, as it was downloaded")
    export_config = read_json_object(export_dir / "config.json", ExportError, "the export was changed after it was "
                                     "written: export again")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if target_config.get(key) != export_config.get(key):
            raise ExportError(f"{target_dir}: {key} is {target_config.get(key)}, the export's target has "
                              f"{export_config.get(key)}: stitch into the checkpoint the head was trained on")
    if target_config.get("num_nextn_predict_layers"):
        raise ExportError(f"{target_dir} already has {target_config['num_nextn_predict_layers']} MTP layer(s) "
                          "(num_nextn_predict_layers): stitch into a checkpoint without them")
    _verify_target(target_dir, sidecar["head_config"]["target"])
    files = _weight_map(target_dir)
    mtp = load_file(str(sidecar_weights(export_dir, sidecar)))
    clash = sorted(set(mtp) & set(files))
    if clash:
        raise ExportError(f"{target_dir} already holds {clash[0]} (and {len(clash) - 1} more MTP-layer tensors)")

    stage = tmp_name(out)
    try:
        stage.mkdir(parents=True)
        for item in target_dir.iterdir():
            if item.name in ("config.json", INDEX, SIDECAR) or item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, stage / item.name)
            else:
                _link_or_copy(item, stage / item.name)
        save_file(mtp, str(stage / MTP_FILE), metadata={"format": "pt"})
        weight_map = {**files, **{name: MTP_FILE for name in mtp}}
        total = sum((stage / f).stat().st_size for f in set(weight_map.values()))
        (stage / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                               "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        config = {**target_config, "num_nextn_predict_layers": export_config["num_nextn_predict_layers"]}
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage / SIDECAR).write_text(json.dumps({**sidecar, "weights": MTP_FILE, "stitched_into": str(target_dir)},
                                                indent=2) + "\n")
        readme = (export_dir / "README.md").read_text() if (export_dir / "README.md").is_file() else ""
        written = [MTP_FILE, INDEX, "config.json", SIDECAR, "README-mtp.md"]
        (stage / "README-mtp.md").write_text(
            f"# MTP layers stitched into {target_dir.name}\n\n`mtptrain stitch` added {len(mtp)} tensors "
            f"(model.layers.{config['num_hidden_layers']}..) in {MTP_FILE} and num_nextn_predict_layers "
            f"{config['num_nextn_predict_layers']} to a copy of `{target_dir}`.\n\n" + readme)
        for name in written:  # readable by a server running as another user; the linked target files keep theirs
            (stage / name).chmod(0o644)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"out": str(out), "mtp_tensors": len(mtp), "mtp_layers": config["num_nextn_predict_layers"],
            "target_tensors": len(files)}


def _verify_target(directory: Path, identity: dict) -> None:
    """The checkpoint must be the one the head was trained on: same fingerprint (loaded once, bfloat16, CPU)."""
    loaded = load_target(TargetConfig(model=str(directory), dtype="bfloat16", device="cpu")).identity()
    key = identity_mismatch(identity, loaded)
    if key is not None:
        raise ExportError(f"{directory} has {key} {loaded.get(key)}, but the head was trained for "
                          f"'{identity.get('name')}' ({identity.get(key)}): stitch into that checkpoint")


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX
    if index.is_file():
        return read_weight_map(index, ExportError)
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ExportError(f"{directory} holds neither {INDEX} nor model.safetensors: stitch needs a safetensors "
                          "checkpoint")
    with safe_open(str(single), framework="pt") as fh:
        return {name: "model.safetensors" for name in fh.keys()}


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
