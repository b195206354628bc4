"""Output files the target writes a group of conversations at a time, which a killed job resumes.

`mtptrain regenerate` (data/regenerate.py) and `mtptrain self-prompts` (data/self_prompts.py) write JSONL this
way: after each group its lines are appended and fsynced, then a state file beside the output
(`<output>.state.json`, written atomically) records the groups done and the file's byte length. A rerun trusts no
state it cannot check (another target, a torn or hostile file, an output shorter than recorded), cuts the output
back to the recorded length and goes on with the next group, so a killed job ends with the file an uninterrupted
one writes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mtptrain.errors import MtptrainError
from mtptrain.io import fsync_dir, load_json
from mtptrain.target import identity_mismatch

log = logging.getLogger(__name__)
GROUP_BATCHES = 8  # a group (the unit written and resumed) holds this many batches of conversations


class RegenerateError(MtptrainError, RuntimeError):
    """The output cannot be written or resumed; the message says why and what to do."""


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.json")


def load_state(output: Path, fresh: dict, setting: str, command: str, optional: tuple[str, ...] = ()) -> dict:
    """The state file beside `output` (a regeneration's or a self-prompts run's), or `fresh` where there is none
    yet. A state is refused, naming its file, unless each entry of `fresh` (and of its counts) has the type it has
    there, entries named in `optional` only where present: a hostile or torn file neither crashes the run nor
    steers its resume."""
    path = state_path(output)
    if not path.is_file():
        if output.exists() and output.stat().st_size:
            raise RegenerateError(f"{output} exists but has no {path.name}: it was not written by `mtptrain "
                                  f"{command}`; move it away or choose another {setting} path")
        return fresh
    try:
        state = load_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise RegenerateError(f"{path} is not valid JSON ({exc}); delete it and {output} to start over") from None

    def typed(entries: object, like: dict) -> bool:
        return isinstance(entries, dict) and all(type(entries.get(k)) is type(v) for k, v in like.items()
                                                 if k in entries or k not in optional)
    if not typed(state, {k: v for k, v in fresh.items() if k != "counts"}) or \
            not typed(state.get("counts"), fresh["counts"]):
        raise RegenerateError(f"{path} is not a state mtptrain wrote; delete it and {output} to start over")
    return state


def check_written(state: dict, output: Path, identity: dict, setting: str) -> None:
    """A state to resume must come from this target, and its output hold at least the bytes it records."""
    if identity_mismatch(state["target"], identity) is not None:
        raise RegenerateError(f"{output} was written by another target or tokenizer "
                              f"({state['target'].get('name')}); set {setting} to a new path")
    if not output.is_file() or output.stat().st_size < state["bytes"]:
        raise RegenerateError(f"{output} is shorter than {state_path(output).name} records ({state['bytes']} bytes): "
                              "the file was changed outside mtptrain; delete both to start over")


def truncate_to(output: Path, size: int) -> None:
    """Drop whatever a killed run appended after the last recorded group."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "ab") as fh:
        if fh.tell() != size:
            log.info("cutting %s back to %d bytes (a group left unfinished)", output, size)
            fh.truncate(size)


def append_lines(output: Path, lines: list[str]) -> int:
    """Append and fsync `lines`; the file's new length, for the state to record."""
    with open(output, "ab") as fh:
        fh.write("".join(lines).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
        size = fh.tell()
    fsync_dir(output.parent)
    return size

