"""Checks an export directory against its format's specification table (mtptrain/export/specs/<format>.yaml).

Each table row is one fact (a tensor's name, shape and dtype, or a config
key's value) with the source it was read from; a weight row with `when` holds
only for heads where that expression is true (EAGLE-3.1 norms, say). A row that does not hold
gives one line naming the row, so a format change upstream, once written into
the table, shows up as one failing line. Tensors the table does not list fail
too: engines skip unknown names silently.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from mtptrain.export.sidecar import ExportError, read_sidecar, sidecar_weights
from mtptrain.io import read_json_object

SPECS = Path(__file__).with_name("specs")
_MISSING = object()
_DTYPES = {"int64": (torch.int64,), "bool": (torch.bool,),
           "float": (torch.float32, torch.bfloat16, torch.float16)}


def load_table(fmt: str) -> dict:
    return yaml.safe_load((SPECS / f"{fmt}.yaml").read_text())


def symbols(sidecar: dict, target_config: dict) -> dict:
    """The table's symbols, from the target's config and the head's own config (never from the export itself)."""
    head = sidecar["head_config"]["head"]
    tc = target_config
    heads = tc["num_attention_heads"]
    rope = tc.get("rope_parameters") or {}
    j = list(head.get("feature_layers") or [])
    numbering = sidecar.get("sglang_ids", "auto")
    sglang_j = j if numbering != "since-25454" or (j and j[0] == 1) else [x + 1 for x in j]  # PR #25454
    return {"H": tc["hidden_size"], "I": tc["intermediate_size"], "V": tc["vocab_size"],
            "Vd": head.get("draft_vocab_size"), "nh": heads, "nkv": tc.get("num_key_value_heads", heads),
            "hd": tc.get("head_dim") or tc["hidden_size"] // heads, "k": len(j), "j": j, "sglang_j": sglang_j,
            "N": tc["num_hidden_layers"], "eps": tc["rms_norm_eps"], "model_type": tc.get("model_type"),
            "architectures": tc.get("architectures"),
            "rope_theta": rope.get("rope_theta", tc.get("rope_theta")),
            "fc_norm": bool(head.get("fc_norm")), "norm_output": bool(head.get("norm_output"))}


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def check_export(directory: Path, target_config: dict, target_layer: dict[str, tuple] | None = None) -> list[str]:
    """Failures of the export at `directory`, one line per table row that does not hold; [] when it conforms.

    target_layer: name -> shape of the target's own last decoder layer (block rows of deepseek-mtp).
    """
    directory = Path(directory)
    sidecar = read_sidecar(directory)
    fmt = sidecar["export_format"]
    table = load_table(fmt)
    config = read_json_object(directory / "config.json", ExportError, "the export was changed after it was "
                              "written: export again")
    with safe_open(str(sidecar_weights(directory, sidecar)), framework="pt") as fh:
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    env = {"__builtins__": {}, **symbols(sidecar, target_config)}
    modules = config.get("num_nextn_predict_layers", 1)
    return (_check_weights(fmt, table["weights"], tensors, env, modules, target_layer)
            + _check_config(fmt, table["config"], config, env))


def _check_weights(fmt: str, rows: list[dict], tensors: dict, env: dict, modules: int,
                   target_layer: dict[str, tuple] | None) -> list[str]:
    failures, listed = [], set()
    floats = {str(t.dtype) for t in tensors.values() if t.is_floating_point()}
    if len(floats) > 1:
        failures.append(f"{fmt}: tensors in several float dtypes {sorted(floats)}")
    for i, row in enumerate(rows):
        where = f"{fmt}.yaml weights[{i}] {row['name']}"
        if "when" in row and not eval(row["when"], env):  # noqa: S307 - a row for heads with that setting only
            continue
        layers = range(env["N"], env["N"] + modules) if "{L}" in row["name"] else [None]
        for name in (row["name"].format(L=layer) if layer is not None else row["name"] for layer in layers):
            if row.get("block"):  # the target layer's own tensors under this MTP layer's prefix
                if target_layer is None:
                    failures.append(f"{where}: the target's layer is needed to check the block")
                    continue
                expected = {name.split("<block>")[0] + suffix: tuple(shape) for suffix, shape in target_layer.items()}
                listed.update(expected)
                failures += [f"{where}: {n} missing (the target's layer has it)" if n not in tensors else
                             f"{where}: {n} has shape {list(tensors[n].shape)}, the target's layer {list(shape)}"
                             for n, shape in sorted(expected.items())
                             if n not in tensors or tuple(tensors[n].shape) != shape]
            elif row.get("absent"):
                if name in tensors:
                    failures.append(f"{where}: present, must be absent ({row['source']})")
            elif name not in tensors:
                listed.add(name)
                failures.append(f"{where}: missing")
            else:
                listed.add(name)
                want = [eval(str(e), env) for e in row["shape"]]  # noqa: S307 - the repo's own table
                if list(tensors[name].shape) != want:
                    failures.append(f"{where}: shape {list(tensors[name].shape)}, expected {want} ({row['shape']})")
                if tensors[name].dtype not in _DTYPES[row["dtype"]]:
                    failures.append(f"{where}: dtype {str(tensors[name].dtype).removeprefix('torch.')}, "
                                    f"expected {row['dtype']}")
    failures += [f"{fmt}: tensor {name} is not in {fmt}.yaml (engines would skip or reject it)"
                 for name in sorted(set(tensors) - listed)]
    return failures


def _check_config(fmt: str, rows: list[dict], config: dict, env: dict) -> list[str]:
    failures = []
    for i, row in enumerate(rows):
        label = f"{fmt}.yaml config[{i}] {row['key']}"
        value = _lookup(config, row["key"])
        if row.get("absent"):
            if value is not _MISSING:
                failures.append(f"{label}: present ({value!r}), must be absent ({row['source']})")
        elif value is _MISSING:
            failures.append(f"{label}: missing")
        elif "equals" in row and value != row["equals"]:
            failures.append(f"{label}: {value!r}, expected {row['equals']!r}")
        elif "expr" in row and value != eval(row["expr"], env):  # noqa: S307 - the repo's own table
            failures.append(f"{label}: {value!r}, expected {eval(row['expr'], env)!r} ({row['expr']})")
        elif "type" in row and type(value).__name__ != row["type"]:
            failures.append(f"{label}: {type(value).__name__} {value!r}, expected a {row['type']}")
    return failures
