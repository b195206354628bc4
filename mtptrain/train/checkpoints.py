"""Training checkpoints: which ones a run may load, and loading them without running their code.

DeepSpeed writes a checkpoint as torch pickles and, left alone, reads back whatever `latest` names with
`torch.load(weights_only=False)`: a `latest` edited to '../../x', a symlinked step directory or a planted .pt
file would run code that is not the project's. So the run records what it wrote, each file's name and sha256
and the run's fingerprint, in RECORD inside the step directory, before it points `latest` at that directory;
and it loads a checkpoint only when `latest` names a step-NNNNNNN directory inside checkpoints/ whose .pt
files are exactly the recorded ones, unchanged. The load itself then goes through `weights_only=True`
(`WeightsOnlyLoads`), which rebuilds tensors, containers and the few DeepSpeed classes its optimizer state
holds, and calls nothing.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from mtptrain.errors import MtptrainError
from mtptrain.io import atomic_write_json, atomic_write_text, contained, load_json, sha256_file

LATEST = "latest"  # in the checkpoints directory: the tag of the last complete checkpoint
RECORD = "mtptrain-checkpoint.json"  # in each step directory: its files and their sha256
MARKER = "mtptrain-checkpoint/1"
_TAG = re.compile(r"step-\d{7}")
# What DeepSpeed pickles besides tensors and containers (ZeRO's partition bookkeeping, the loss scaler of its
# mixed precision); weights_only rebuilds them from their fields.
_DEEPSPEED_CLASSES = [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


class CheckpointRefused(MtptrainError, RuntimeError):
    pass


class RunMismatch(MtptrainError, RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def commit(ckpt_dir: Path, tag: str, fingerprint: str, made_with: dict) -> None:
    """Record the files DeepSpeed wrote for `tag` and what the run computed with (`made_with`: its training
    precision and the runtime of its features), then point `latest` at it (DeepSpeed is told not to).

    Called once, after the save returned on every rank, so the record covers each rank's optimizer state. A run
    killed before `latest` moves resumes from the checkpoint before, which is still whole.
    """
    step_dir = ckpt_dir / tag
    files = {path.relative_to(step_dir).as_posix(): sha256_file(path) for path in sorted(step_dir.rglob("*.pt"))}
    atomic_write_json(step_dir / RECORD, {"format": MARKER, "fingerprint": fingerprint, "made_with": made_with,
                                          "files": files})
    atomic_write_text(ckpt_dir / LATEST, tag)


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag `latest` names (None before the first checkpoint), refused unless it is a step-NNNNNNN name."""
    latest = ckpt_dir / LATEST
    if not latest.is_symlink() and not latest.exists():
        return None
    if latest.is_symlink() or not latest.is_file():
        raise CheckpointRefused(f"{latest} is not a plain file, so no checkpoint was loaded. {_fix(ckpt_dir)}")
    tag = latest.read_bytes().decode(errors="replace").strip()
    if not _TAG.fullmatch(tag):
        raise CheckpointRefused(f"{latest} names {tag[:80]!r}, not a step-NNNNNNN directory of this run, so no "
                                f"checkpoint was loaded. {_fix(ckpt_dir)}")
    return tag


def verify(ckpt_dir: Path, tag: str, fingerprint: str, made_with: dict) -> Path:
    """The step directory of `tag`, once its record says it is this run's, computed as this run computes
    (`made_with`: a precision left at auto may resolve otherwise on another machine or with other ranks, and a
    run must not continue in another precision), and every .pt file in it (what DeepSpeed reads) is one the
    record lists, with the recorded sha256."""
    fix = _fix(ckpt_dir)
    step_dir = contained(ckpt_dir, tag, ckpt_dir / LATEST, "its tag", CheckpointRefused, fix)
    if not step_dir.is_dir():
        raise CheckpointRefused(f"{ckpt_dir / LATEST} names {tag}, and {step_dir} is not a directory. {fix}")
    record_path = step_dir / RECORD
    record = _read_record(record_path, fix)
    if record["fingerprint"] != fingerprint:
        raise RunMismatch(f"{step_dir} is a checkpoint of another run (other recipe, store or number of ranks). "
                          "Rerun with the recipe, store and ranks that wrote it, or use a new train.output_dir.")
    if record.get("made_with") != made_with:
        theirs = record.get("made_with") if isinstance(record.get("made_with"), dict) else {}
        raise RunMismatch(
            f"{step_dir} was trained with {_made_with(theirs)}, and this run would continue with "
            f"{_made_with(made_with)} ({record_path}). Set train.precision={theirs.get('precision', '...')} (and "
            "target.dtype as the features were computed) to resume it, or use a new train.output_dir.")
    listed = {contained(step_dir, name, record_path, f"files[{name!r}]", CheckpointRefused, fix): digest
              for name, digest in record["files"].items()}
    unlisted = sorted(str(path) for path in step_dir.rglob("*.pt") if path not in listed)
    if unlisted:
        raise CheckpointRefused(f"{step_dir} holds {', '.join(unlisted)}, which {record_path} does not list: files "
                                f"this run did not write there. Nothing was loaded. {fix}")
    for path, digest in listed.items():
        if not path.is_file() or sha256_file(path) != digest:
            what = "changed since it was written" if path.is_file() else "missing"
            raise CheckpointRefused(f"{path} is {what} (its sha256 is recorded in {record_path}), so that "
                                    f"checkpoint was not loaded. {fix}")
    return step_dir


def load(engine, ckpt_dir: Path, tag: str) -> dict:
    """Load the verified checkpoint `tag` into `engine`; returns the client state the trainer saved with it."""
    engine.checkpoint_engine = WeightsOnlyLoads(engine.checkpoint_engine)
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_lr_scheduler_states=True)
    if client is None:
        raise CheckpointRefused(f"{ckpt_dir / tag} holds no model states for this run's ranks. {_fix(ckpt_dir)}")
    return client


class WeightsOnlyLoads:
    """DeepSpeed's checkpoint engine with `torch.load(weights_only=True)` for its loads; saves are its own."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(_DEEPSPEED_CLASSES):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            called = re.search(r"GLOBAL (\S+)", str(exc))
            found = f"it calls {called.group(1)}" if called else "a pickle weights_only refuses"
            raise CheckpointRefused(f"{path} holds more than tensors and DeepSpeed's training state ({found}), "
                                    f"so it was not loaded. {_fix(Path(path).parent.parent)}") from None


def rng_state() -> dict:
    """Every generator training draws from, in types `weights_only` loads back (numpy's key as a list)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [name, key.tolist(), pos, has_gauss, gauss],
            "python": random.getstate(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])


def _read_record(path: Path, fix: str) -> dict:
    """The record of a step directory, refused unless it is one this project wrote."""
    if not path.is_file():
        raise CheckpointRefused(
            f"{path} is missing: {path.parent} was not recorded by the run that wrote it (a checkpoint of an "
            f"mtptrain before checkpoint records, or of a run killed while saving it), and its pickles are not "
            f"loaded unchecked. {fix}")
    try:
        record = load_json(path.read_bytes())
    except ValueError as exc:
        raise CheckpointRefused(f"{path} is not JSON ({exc}), so that checkpoint was not loaded. {fix}") from None
    if not _is_record(record):
        raise CheckpointRefused(f"{path} is not a checkpoint record of mtptrain ({MARKER}), so that checkpoint "
                                f"was not loaded. {fix}")
    return record


def _made_with(made_with: dict) -> str:
    features = made_with.get("features") or {}
    return (f"precision {made_with.get('precision')} on features computed in {features.get('dtype', 'an unrecorded')} "
            f"dtype ({features.get('runtime', 'unrecorded')} runtime)")


def _is_record(record: object) -> bool:
    return (isinstance(record, dict) and record.get("format") == MARKER
            and isinstance(record.get("fingerprint"), str) and isinstance(record.get("files"), dict)
            and all(isinstance(digest, str) for digest in record["files"].values()))


def _fix(ckpt_dir: Path) -> str:
    return (f"Point {ckpt_dir / LATEST} at a step-NNNNNNN directory this run wrote (one with {RECORD}), or start "
            "the run in a fresh train.output_dir.")
