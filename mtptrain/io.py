"""Crash-safe file writes: write a temporary name, fsync, rename.

A reader never sees a half-written file under its final name, whatever moment
the writer is killed at; a write the disk refuses is said as such (`writing_to`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError

from mtptrain.errors import MtptrainError

_CHUNK = 8 << 20

# A write the disk refuses, by errno: what is wrong with the directory, and the way past it.
_REFUSED = {
    errno.ENOSPC: ("no space left on {dir}", "Free space there, or {elsewhere}"),
    errno.EDQUOT: ("the disk quota on {dir} is used up", "Free space there, or {elsewhere}"),
    errno.EFBIG: ("a file in {dir} would pass the file size limit of this process (ulimit -f)",
                  "Raise the limit (ulimit -f unlimited in the shell that runs mtptrain)"),
    errno.EROFS: ("{dir} is read-only", "Make it writable, or {elsewhere}"),
    errno.EACCES: ("{dir} is not writable by this user", "Make it writable, or {elsewhere}"),
    errno.EPERM: ("{dir} may not be written here (operation not permitted)", "Make it writable, or {elsewhere}"),
}


class WriteRefusedError(MtptrainError, RuntimeError):
    """The disk refused a write (full, over the file size limit, read-only); the message says where and what
    was kept."""


SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
                      "uint8": "U8", "float8_e4m3fn": "F8_E4M3"}  # a torch dtype's name -> safetensors' name


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write a safetensors file with a deterministic header, hashing it on the way.

    The library's own writer orders the metadata map at random, so the same
    shard would not be byte-identical across runs; this writer streams the
    tensors from their buffers without an intermediate copy of the whole file.
    Layout: u64 little-endian header length, JSON header padded to 8 bytes,
    then the tensors' bytes back to back.
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(tensor.dtype).removeprefix("torch.")],
                        "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for chunk in (len(head).to_bytes(8, "little"), head):
            fh.write(chunk)
            digest.update(chunk)
        for tensor in tensors.values():
            raw = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
            fh.write(raw)
            digest.update(raw)
    return {"bytes": 8 + len(head) + offset, "sha256": digest.hexdigest()}


class NestedTooDeep(json.JSONDecodeError):
    """A JSON document nested past the parser's depth: broken JSON like any other (a ValueError), with its message
    alone (no line and column: the parser stops deep inside)."""

    def __init__(self):
        super().__init__("nested past the JSON parser's depth", "", 0)
        self.args = (self.msg,)


def load_json(text: str | bytes) -> Any:
    """json.loads for what a file or a file's metadata holds, which may be hostile: a document nested past the
    parser's depth (a few thousand "[") fails as other broken JSON does, with a json.JSONDecodeError that every
    reader already turns into its error naming the file, instead of a RecursionError that none expects."""
    try:
        return json.loads(text)
    except RecursionError:
        raise NestedTooDeep() from None


def read_json_object(path: Path, error: type[Exception], fix: str) -> dict:
    """The JSON object the file at `path` holds; `error`, naming the file, what is wrong and `fix`, where it cannot
    be read, is not JSON (nested past the parser's depth included) or holds something else than an object."""
    try:
        obj = load_json(Path(path).read_bytes())
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, not JSON
        raise error(f"{path} does not read as JSON ({exc}): {fix}") from None
    if not isinstance(obj, dict):
        raise error(f"{path} holds a JSON {type(obj).__name__}, not an object: {fix}")
    return obj


def read_marked_json(path: Path, marker: str, error: type[Exception], missing: str) -> dict:
    """A JSON object whose "format" must be `marker` (a file this project wrote, of that kind); `error` with
    `missing` when there is no such file, or saying why it does not read back (cut short, not an object, another
    format)."""
    if not path.is_file():
        raise error(missing)

    def unreadable(why: object) -> Exception:
        return error(f"{path} does not read as a {marker!r} file ({why}): it was cut short or changed after it was "
                     "written. Restore it, or write it again with the command that made it.")

    try:
        obj = load_json(path.read_text())
    except ValueError as exc:  # cut short, not text, or nested past the parser's depth
        raise unreadable(exc) from None
    if not isinstance(obj, dict):
        raise unreadable(f"a JSON {type(obj).__name__}, not an object")
    if obj.get("format") != marker:
        raise error(f"{path}: format {obj.get('format')!r}, expected {marker!r}")
    return obj


def cache_root() -> Path:
    """Where derived files are kept between runs (converted GGUF targets, this machine's measured choices)."""
    return Path(os.environ.get("MTPTRAIN_CACHE", Path.home() / ".cache" / "mtptrain"))


def read_machine_cache(path: Path, invalid: Callable[[object], str | None], what: str, log: logging.Logger,
                       quiet: bool = False, keep: Callable[[str], bool] = lambda key: True) -> dict:
    """The entries of a per-machine cache file (a JSON object of key -> entry) whose key `keep` keeps and that
    `invalid` finds nothing wrong with; the others dropped, with one warning to `log` (`what`: what is measured
    again) unless `quiet`. A missing file is an empty cache; one that does not parse or is not an object, one
    warning."""
    warn = (lambda *args: None) if quiet else log.warning
    try:
        known = load_json(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warn("%s cannot be read (%s): %s measured again", path, exc, what)
        return {}
    if not isinstance(known, dict):
        warn("%s holds %s, not an object of measured choices: %s measured again", path, type(known).__name__, what)
        return {}
    known = {key: entry for key, entry in known.items() if keep(key)}
    bad = {key: why for key, why in ((key, invalid(entry)) for key, entry in known.items()) if why is not None}
    if bad:
        key, why = next(iter(bad.items()))
        warn("%s: dropping %d entr%s not validate (the first, for %s: %s); measured again when needed", path,
             len(bad), "y that does" if len(bad) == 1 else "ies that do", key.split("|")[1] if "|" in key else key,
             why)
    return {key: entry for key, entry in known.items() if key not in bad}


def store_machine_cache(path: Path, key: str, entry: dict, invalid: Callable[[object], str | None], what: str,
                        log: logging.Logger, keep: Callable[[str], bool] = lambda key: True) -> None:
    """`entry` under `key` in a per-machine cache file (`read_machine_cache`, whose entries `keep` does not keep
    are dropped), written atomically; a cache that cannot be written (a read-only home) gets one warning: `what` is
    measured again next time."""
    known = read_machine_cache(path, invalid, what, log, quiet=True, keep=keep)  # said when it was read
    known[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    except OSError as exc:
        log.warning("could not cache %s in %s (%s); set MTPTRAIN_CACHE to a writable directory to keep it", what,
                    path, exc)


def tmp_name(path: Path) -> Path:
    """A sibling name no other writer uses, even ranks on other hosts sharing the file system."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)`, fsync the result and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: tmp.write_text(text))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(Path(path), json.dumps(obj, indent=2, sort_keys=False) + "\n")


def create_json_once(path: Path, obj: Any) -> bool:
    """Write `obj` to `path` whole (a temporary name, fsync, then a hard link) unless `path` exists: False when
    another writer (another rank, on this host or another sharing the file system) made it first. Unlike a
    rename, a link never replaces what is there."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        atomic_write_json(tmp, obj)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def contained(directory: Path, name: object, listed_in: Path, entry: str, error: type[Exception],
              fix: str = "") -> Path:
    """`directory / name` for a `name` read from the file `listed_in` (at `entry`), refused with `error` unless it
    is a relative path that stays inside `directory` once every symlink is resolved.

    Files such as manifests can be edited by anyone: followed blindly, '/etc/passwd', '../x' or a symlink would
    make the project read, and its error messages point at, files that are not its own.
    """
    if isinstance(name, str) and name and not Path(name).is_absolute() and ".." not in Path(name).parts:
        path = Path(directory) / name
        root = Path(directory).resolve()
        if path.resolve() != root and path.resolve().is_relative_to(root):
            return path
    raise error(f"{listed_in}: {entry} names {name!r}, which is outside {directory}: a corrupt or hostile "
                f"{Path(listed_in).name}. Nothing was read from that path. "
                + (fix or f"Write {Path(listed_in).name} again with the tool that made it."))


@contextmanager
def writing_to(directory: Path, what: str, elsewhere: str, kept: str) -> Iterator[None]:
    """Raise WriteRefusedError, naming `directory`, for a write under it that the disk refuses; `elsewhere` is the
    setting that moves `what` to another disk, `kept` says what is left as it was. Other errors pass unchanged.

    safetensors raises its own error, with the errno only in its message ('... (os error 27)'). A refusal that
    names a path outside `directory` (a file being read, say) is not this write's and passes unchanged too.
    """
    try:
        yield
    except (OSError, SafetensorError) as exc:
        refused = _REFUSED.get(_errno(exc))
        if refused is None or not _inside(getattr(exc, "filename", None), directory):
            raise
        reason, fix = (text.format(dir=directory, elsewhere=elsewhere) for text in refused)
        raise WriteRefusedError(f"cannot write {what}: {reason}. {fix}. {kept}") from exc


def _errno(exc: Exception) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def _inside(filename: object, directory: Path) -> bool:
    """Whether a failing call's path lies in `directory` or one of the parents it creates (unnamed: a write)."""
    if not filename:
        return True
    path, root = Path(os.fsdecode(filename)).absolute(), Path(directory).absolute()
    return path.is_relative_to(root) or root.is_relative_to(path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
