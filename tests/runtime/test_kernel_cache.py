"""The compiled kernels' cache (runtime/native_kernels.py) loads a .so only once it is the very file its build
recorded: a truncated or overwritten one, which would kill the process that loads it (bus error, segmentation
fault), is rebuilt after one warning, and every build says so.

Each load runs in a subprocess, as the damage guarded against crashes the process, and builds a few-line
extension in place of the runtime's kernels (`extension()` with SOURCES set to it): about a second each."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtptrain.io import sha256_file

TINY = r"""
#include <Python.h>
#define INIT_NAME(name) PyInit_##name
#define INIT(name) INIT_NAME(name)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef definition = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&definition); }
"""

LOAD = """
import logging, sys
from pathlib import Path
from mtptrain.runtime import native_kernels
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
native_kernels.SOURCES, native_kernels.HEADERS = [Path(sys.argv[1])], []
print("answer", native_kernels.extension().answer())
"""


def _load(source: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MTPTRAIN_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", LOAD, str(source)], env=env, capture_output=True, text=True,
                          timeout=300)


def _loaded(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0 and "answer 42" in run.stdout, f"rc {run.returncode}\n{run.stdout}\n{run.stderr}"


def _lines(run: subprocess.CompletedProcess, level: str) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith(level + " ")]


def _library(cache: Path) -> Path:
    (library,) = (cache / "kernels").glob("*/*.so")
    return library


def _recorded(library: Path) -> dict:
    return json.loads(library.with_suffix(".sha256.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The tiny extension's source and a cache holding its first build, with that build's run."""
    root = tmp_path_factory.mktemp("kernel_cache")
    source = root / "tiny.cpp"
    source.write_text(TINY)
    return source, root / "cache", _load(source, root / "cache")


@pytest.fixture
def cache(built, tmp_path) -> Path:
    """A copy of the built cache, for this test to damage."""
    shutil.copytree(built[1], tmp_path / "cache")
    return tmp_path / "cache"


def test_a_first_build_says_where_and_records_its_library(built):
    _, cache, run = built
    _loaded(run)
    library = _library(cache)
    said = _lines(run, "INFO")
    assert len(said) == 1 and said[0].startswith("INFO compiling tiny.cpp") and str(library.parent) in said[0]
    assert _recorded(library) == {"file": library.name, "size": library.stat().st_size,
                                  "sha256": sha256_file(library)}


def test_a_recorded_library_loads_as_it_is_from_another_checkout_of_its_sources(built, cache, tmp_path):
    """ninja would rebuild it, unannounced, for sources at another path or newer than the .so (the same bytes
    in another checkout or environment sharing the cache)."""
    source = tmp_path / "checkout" / "tiny.cpp"
    source.parent.mkdir()
    shutil.copy(built[0], source)
    library = _library(cache)
    before = (library.read_bytes(), library.stat().st_mtime_ns)
    run = _load(source, cache)
    _loaded(run)
    assert not _lines(run, "INFO") and not _lines(run, "WARNING")
    assert (library.read_bytes(), library.stat().st_mtime_ns) == before


def _truncate(library: Path) -> None:
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])


def _overwrite(library: Path) -> None:
    library.write_bytes(os.urandom(library.stat().st_size))


def _lose_record(library: Path) -> None:
    """As a cache written before records were kept holds it."""
    library.with_suffix(".sha256.json").unlink(missing_ok=True)


def _garble_record(library: Path) -> None:
    library.with_suffix(".sha256.json").write_bytes(os.urandom(64))


@pytest.mark.parametrize("damage", [_truncate, _overwrite, _lose_record, _garble_record],
                         ids=["truncated", "random-bytes", "no-record", "garbled-record"])
def test_a_library_unlike_its_record_is_rebuilt_after_one_warning(built, cache, damage):
    library = _library(cache)
    damage(library)
    run = _load(built[0], cache)
    _loaded(run)
    (warning,) = _lines(run, "WARNING")
    assert str(library) in warning and "rebuilt" in warning
    (said,) = _lines(run, "INFO")
    assert said.startswith("INFO compiling tiny.cpp")
    assert _recorded(library)["sha256"] == sha256_file(library)
    _loaded(_load(built[0], cache))  # and the rebuilt library loads as it is
