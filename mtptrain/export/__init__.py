"""`mtptrain export`: a trained head in the formats serving engines load, and back.

An export directory holds what its engines read (config.json, model.safetensors),
a README.md (target, layers, recipe, measured tau, serve commands) and
mtptrain.json: the head's own config, so `mtptrain eval` loads the export
itself and drafts exactly as the head it came from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtptrain.export.formats import FORMATS, Format, Options
from mtptrain.export.source import ExportError, HeadSource, open_head
from mtptrain.io import tmp_name

SIDECAR = "mtptrain.json"
EXPORT_FORMAT = "mtptrain-export/1"

__all__ = ["EXPORT_FORMAT", "ExportError", "FORMATS", "Options", "SIDECAR", "export_head", "read_export"]


def export_head(head_dir: Path, fmt: str, out: Path, options: Options | None = None, target: str | None = None,
                results: Path | None = None, dtype: torch.dtype | None = None) -> dict:
    """Write the head at `head_dir` to `out` in format `fmt`; returns a summary.

    The files are written to a staging directory, checked against the format's table and only then moved to
    `out` (replacing an earlier export there), so an error leaves `out` as it was.
    """
    options = options or Options()
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    out = Path(out)
    if out.resolve() == Path(head_dir).resolve():
        raise ExportError(f"--out {out} is the head directory itself: export to another directory")
    if out.exists() and any(out.iterdir()) and not (out / SIDECAR).is_file():
        raise ExportError(f"{out} is not empty and holds no earlier export: choose a new or empty directory "
                          "(an earlier export there is replaced)")
    src = open_head(head_dir, target)
    if dtype is not None:
        src.state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in src.state.items()}
    form = FORMATS[fmt]
    form.check(src, options)
    written = form.write(src, options)
    sidecar = {"format": EXPORT_FORMAT, "export_format": fmt, "weights": "model.safetensors",
               "num_hidden_layers": src.target_config["num_hidden_layers"], "sglang_ids": options.sglang_ids,
               "source_head": str(Path(head_dir).resolve()), "head_config": src.config}
    measured = _measured(src, results)
    from mtptrain.export.conformance import check_export
    from mtptrain.export.readme import export_readme

    stage = tmp_name(out)
    try:
        stage.mkdir(parents=True)
        save_file(written.tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        write_json(stage / "config.json", written.config)
        write_json(stage / SIDECAR, sidecar)
        served = _served(src, options, written)
        (stage / "README.md").write_text(export_readme(form, src, written, sidecar, measured, out, served))
        failures = check_export(stage, src.target_config,
                                src.target_layer_shapes() if fmt == "deepseek-mtp" else None)
        for path in stage.iterdir():  # readable by a server running as another user (safetensors writes 0600)
            path.chmod(0o644)
        if failures:
            raise ExportError(f"the {fmt} export does not conform to mtptrain/export/specs/{fmt}.yaml:\n  "
                              + "\n  ".join(failures))
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"format": fmt, "out": str(out), "tensors": len(written.tensors),
            "bytes": sum(t.numel() * t.element_size() for t in written.tensors.values()), "notes": written.notes,
            "serve": form.serve(str(out.resolve()), served, sidecar)}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _served(src: HeadSource, options: Options, written) -> str:
    """The target as the serve commands name it: the speculators verifier, --verifier, or the recorded target."""
    verifier = written.config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    try:
        return verifier or options.verifier or src.served_target()
    except ExportError:  # a GGUF target: no served form known
        return "<target hub id or directory>"


def _measured(src: HeadSource, results: Path | None) -> dict | None:
    """Eval results for this head: --results, else the eval.json shipped beside it, else the recipe's own eval
    when it measured this head."""
    candidates = [Path(results)] if results else [src.directory / "eval.json"]
    recipe = src.config.get("train", {}).get("recipe", {})
    if not results and recipe.get("eval", {}).get("output_dir"):
        candidates.append(Path(recipe["eval"]["output_dir"]) / "results.json")
    for path in candidates:
        if not path.is_file():
            if results:
                raise ExportError(f"--results {path} does not exist")
            continue
        data = json.loads(path.read_text())
        head_path = data.get("head", {}).get("path") if data.get("head") else None
        if results or path.parent == src.directory or (
                head_path and Path(head_path).resolve() == src.directory.resolve()):
            data["_path"] = str(path)
            return data
    return None


def is_export(directory: Path) -> bool:
    return (Path(directory) / SIDECAR).is_file()


def read_export(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the head's own config, its weights under the head's names) from an export directory."""
    directory = Path(directory)
    path = directory / SIDECAR
    sidecar = json.loads(path.read_text())
    if sidecar.get("format") != EXPORT_FORMAT or sidecar.get("export_format") not in FORMATS:
        raise ExportError(f"{path}: format {sidecar.get('format')!r} / {sidecar.get('export_format')!r} is not an "
                          f"{EXPORT_FORMAT} sidecar of a known export format")
    form: Format = FORMATS[sidecar["export_format"]]
    tensors = _load_weights(directory, sidecar["weights"])
    return sidecar["head_config"], form.to_head(tensors, sidecar)


def _load_weights(directory: Path, name: str) -> dict[str, torch.Tensor]:
    path = directory / name
    if not path.is_file():
        raise ExportError(f"{path} is missing: the export directory is incomplete; export again")
    return load_file(str(path))
