"""`mtptrain export`: write a trained head in a format serving engines load, checked against the format's table."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtptrain.config import ExportConfig, Recipe
from mtptrain.export.conformance import check_export
from mtptrain.export.formats import Format, Written, format_for
from mtptrain.export.readme import export_readme
from mtptrain.export.sidecar import EXPORT_FILES, EXPORT_FORMAT, SIDECAR, ExportError
from mtptrain.export.source import HeadSource, open_head
from mtptrain.heads.checkpoint import head_directory
from mtptrain.io import read_json_object, tmp_name, writing_to


def run_export(recipe: Recipe) -> dict:
    """`mtptrain export`: the recipe's export section, with the head eval would use by default."""
    cfg = recipe.export
    head = Path(cfg.head) if cfg.head else head_directory(recipe)
    out = Path(cfg.output_dir) if cfg.output_dir else Path(recipe.train.output_dir) / "export" / cfg.format
    return export_head(head, out, cfg)


def export_head(head_dir: Path, out: Path, cfg: ExportConfig, check_target: bool = True) -> dict:
    """Write the head at `head_dir` to `out` in format `cfg.format`; returns a summary.

    The files are written to a staging directory and checked against the format's table. Only then does the
    staging directory take `out`'s place (an earlier export there is moved aside first and removed last), so
    an error leaves `out` as it was. The target's fingerprint is checked against the head's record first;
    check_target=False skips that only for a caller that has just checked it (the trainer, when
    train.target_check was full).
    """
    head_dir, out = Path(head_dir), Path(out)
    _check_out(out, head_dir)
    src = open_head(head_dir, cfg.target)
    if cfg.dtype != "as_trained":
        dtype = getattr(torch, cfg.dtype)
        src.state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in src.state.items()}
    form = format_for(cfg.format, src.spec)
    form.check(src, cfg)
    if check_target:  # an export never carries a fingerprint that no check has seen
        src.verify_target()
    written = form.write(src, cfg)
    sidecar = {"format": EXPORT_FORMAT, "export_format": cfg.format, "weights": "model.safetensors",
               "num_hidden_layers": src.target_config["num_hidden_layers"], "sglang_ids": cfg.sglang_ids,
               "source_head": str(head_dir.resolve()), "head_config": src.config}
    measured = _measured(src, Path(cfg.results) if cfg.results else None)
    served = _served(src, cfg, written)
    _write(form, src, written, sidecar, measured, out, served)
    return {"format": cfg.format, "out": str(out), "tensors": len(written.tensors),
            "bytes": sum(t.numel() * t.element_size() for t in written.tensors.values()), "notes": written.notes,
            "serve": form.serve(str(out.resolve()), served, sidecar)}


def _check_out(out: Path, head_dir: Path) -> None:
    if out.resolve() == head_dir.resolve():
        raise ExportError(f"export.output_dir {out} is the head directory itself: export to another directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"export.output_dir {out} is a file: choose a directory")
    if out.exists():
        others = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
        if others or (any(out.iterdir()) and not (out / SIDECAR).is_file()):
            raise ExportError(f"{out} holds {', '.join(others[:3]) or 'files'} besides an earlier export: choose a "
                              "new or empty directory (only a directory holding just an export is replaced)")


def _write(form: Format, src: HeadSource, written: Written, sidecar: dict, measured: dict | None, out: Path,
           served: str) -> None:
    stage, old = tmp_name(out), tmp_name(out)
    try:
        with writing_to(out.parent, f"the export {out}", "set export.output_dir to a directory on another disk",
                        f"Nothing was left half-written: {out} is as it was."):
            stage.mkdir(parents=True)
            save_file(written.tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
            write_json(stage / "config.json", written.config)
            write_json(stage / SIDECAR, sidecar)
            (stage / "README.md").write_text(export_readme(form, src, written, sidecar, measured, out, served))
            for path in stage.iterdir():  # readable by a server running as another user (safetensors writes 0600)
                path.chmod(0o644)
        failures = check_export(stage, src.target_config,
                                src.target_layer_shapes() if form.name == "deepseek-mtp" else None)
        if failures:
            raise ExportError(f"the {form.name} export does not conform to mtptrain/export/specs/{form.name}.yaml:"
                              "\n  " + "\n  ".join(failures))
        if out.exists():
            os.replace(out, old)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _served(src: HeadSource, cfg: ExportConfig, written: Written) -> str:
    """The target as the serve commands name it: the speculators verifier, export.verifier, or the recorded one."""
    verifier = written.config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    try:
        return verifier or cfg.verifier or src.served_target()
    except ExportError:  # a GGUF target: no served form known
        return "<target hub id or directory>"


def _measured(src: HeadSource, results: Path | None) -> dict | None:
    """Eval results for this head: export.results, else the eval.json shipped beside it, else the recipe's own eval
    when it measured this head."""
    candidates = [Path(results)] if results else [src.directory / "eval.json"]
    recipe = src.config.get("train", {}).get("recipe", {})
    if not results and recipe.get("eval", {}).get("output_dir"):
        candidates.append(Path(recipe["eval"]["output_dir"]) / "results.json")
    for path in candidates:
        if not path.is_file():
            if results:
                raise ExportError(f"export.results {path} does not exist")
            continue
        data = read_json_object(path, ExportError, "point export.results at an eval's results.json, or run the "
                                "eval again")
        head_path = data.get("head", {}).get("path") if data.get("head") else None
        if results or path.parent == src.directory or (
                head_path and Path(head_path).resolve() == src.directory.resolve()):
            data["_path"] = str(path)
            return data
    return None
