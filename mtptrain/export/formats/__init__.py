"""The export formats: how each names a head's tensors, what its config says, what it cannot express.

Every fact here is listed, with the source it was read from, in the format's
table under mtptrain/export/specs/; each export is checked against it.

    eagle3        EAGLE-3 draft directory that SGLang (LlamaForCausalLMEagle3) and vLLM
                  (Eagle3LlamaForCausalLM) both load as a draft model          (eagle3.py)
    speculators   vLLM's speculators format: `vllm serve <dir>` alone         (eagle3.py)
    eagle         EAGLE-1/2 draft as the official EAGLE code and SGLang read it (eagle.py)
    deepseek-mtp  DeepSeek-V3 MTP layers named as the target's extra layers    (mtp.py)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mtptrain.export.formats.base import Format, Written
from mtptrain.export.formats.eagle import Eagle
from mtptrain.export.formats.eagle3 import Eagle3, Speculators
from mtptrain.export.formats.mtp import DeepSeekMTP
from mtptrain.export.sidecar import SIDECAR, ExportError, read_sidecar, sidecar_weights
from mtptrain.heads.checkpoint import check_config_digest
from mtptrain.heads.spec import HeadSpec

FORMATS: dict[str, Format] = {f.name: f for f in (Eagle3(), Speculators(), Eagle(), DeepSeekMTP())}

__all__ = ["FORMATS", "Format", "Written", "format_for", "read_export"]


def format_for(name: str, spec: HeadSpec) -> Format:
    """The format `name`, refused when it cannot hold the head `spec` describes (naming those that can)."""
    form, fits, kind = FORMATS[name], spec.family.export_formats, spec.kind
    if name not in fits:
        raise ExportError(f"a {kind} head cannot be exported as {form.name} ({form.title}), which holds "
                          f"{' or '.join(form.kinds)} heads only; formats for {kind} heads: {', '.join(fits) or 'none'}")
    return form


def read_export(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the head's own config, its weights under the head's names) from an export directory."""
    sidecar = read_sidecar(directory)
    if sidecar.get("export_format") not in FORMATS:
        raise ExportError(f"{Path(directory) / SIDECAR}: export format {sidecar.get('export_format')!r} is not one "
                          f"of {', '.join(FORMATS)}")
    path = sidecar_weights(directory, sidecar)
    if not path.is_file():
        raise ExportError(f"{path} is missing: the export directory is incomplete; export again")
    check_config_digest(sidecar["head_config"], Path(directory) / SIDECAR)  # the head's config, as trained
    return sidecar["head_config"], FORMATS[sidecar["export_format"]].to_head(load_file(str(path)), sidecar)
