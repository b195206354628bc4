"""What an export directory holds, and its sidecar: the lowest layer of mtptrain/export/.

    config.json         what the format's engines read
    model.safetensors   the weights, under the format's names
    README.md           target, layers, recipe, measured tau, serve commands
    mtptrain.json       the sidecar: the head's own config and the format, so that `mtptrain eval` (and a later
                        export in another format) reads the export back as the head it came from
"""

from __future__ import annotations

from pathlib import Path

from mtptrain.errors import MtptrainError
from mtptrain.io import contained, read_marked_json

SIDECAR = "mtptrain.json"
EXPORT_FORMAT = "mtptrain-export/1"
# What an export directory holds; a directory with anything else is never replaced (a stitched checkpoint, say).
EXPORT_FILES = {"config.json", "model.safetensors", SIDECAR, "README.md"}


class ExportError(MtptrainError, ValueError):
    """The head cannot be written in the asked format, or its inputs are missing; the message says why."""


def is_export(directory: Path) -> bool:
    return (Path(directory) / SIDECAR).is_file()


def read_sidecar(directory: Path) -> dict:
    """The sidecar of the export at `directory`, refused unless `mtptrain export` wrote it."""
    return read_marked_json(Path(directory) / SIDECAR, EXPORT_FORMAT, ExportError,
                            f"{Path(directory)} holds no {SIDECAR}: not a directory written by mtptrain export")


def sidecar_weights(directory: Path, sidecar: dict) -> Path:
    """The weights file an export's sidecar names, which must lie in the export directory."""
    return contained(Path(directory), sidecar.get("weights"), Path(directory) / SIDECAR, "weights", ExportError)
