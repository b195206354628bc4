"""W&B for every stage: one group per pipeline run, precompute, train and eval as its jobs.

Runs are offline unless credentials are configured (WANDB_API_KEY, or a
`wandb login` entry in ~/.netrc), so a job never blocks on the network and
never asks for a key; `wandb sync <dir>/wandb/offline-run-*` uploads later.
Only the resolved recipe goes into a run's config: no environment, no keys.
The group is recipe.wandb_group, or the recipe's name; `mtptrain pipeline` and
`mtptrain slurm pipeline` set a fresh <name>-<date-time> when it is unset.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from mtptrain.config import Recipe


def wandb_mode(requested: str) -> str:
    """A recipe's explicit mode; for auto, W&B's own WANDB_MODE when set, else online with credentials and
    offline without."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def wandb_group(recipe: Recipe) -> str:
    return recipe.wandb_group or recipe.name


def pipeline_group(recipe: Recipe) -> str:
    """The group a new pipeline run gets when the recipe names none: its name and the time it starts."""
    return recipe.wandb_group or f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def init_run(recipe: Recipe, job_type: str, mode: str, project: str, directory: Path, resume_id: str | None = None):
    """A W&B run of `job_type` in the recipe's group, or None when W&B is disabled."""
    mode = wandb_mode(mode)
    if mode == "disabled":
        return None
    import wandb

    Path(directory).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=f"{recipe.name}-{job_type}", group=wandb_group(recipe),
                      job_type=job_type, config=recipe.model_dump(mode="json"), dir=str(directory), mode=mode,
                      id=resume_id, resume="allow" if resume_id else None,
                      settings=wandb.Settings(silent=True, console="off"))


def read_offline_run(run_file: Path) -> dict:
    """What an offline W&B run file (`run-<id>.wandb`) holds: its group, job type, config, history rows,
    summary and logged artifacts, and whether it has its exit record (`finished`), for checks and local
    inspection.

    wandb ships no reader for these files. Layout: a 7-byte header, then 32 KiB
    blocks of length-prefixed chunks (4-byte checksum, 2-byte length, 1-byte
    type: 1 full, 2 first, 3 middle, 4 last); chunks join into protobuf
    `Record`s from wandb.proto.wandb_internal_pb2.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    header, block = 7, 32 * 1024
    pos, pending = header, b""
    run = {"group": None, "job_type": None, "config": {}, "history": [], "summary": {}, "artifacts": [],
           "finished": False}
    while pos + 7 <= len(data):
        block_end = header + ((pos - header) // block + 1) * block
        if block_end - pos < 7:  # the tail of a block too short for a chunk header is padding
            pos = block_end
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos = block_end
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            _take(run, record)
    return run


def _take(run: dict, record) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "run":
        run["group"], run["job_type"] = record.run.run_group, record.run.job_type
        run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    elif kind == "config":
        run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
    elif kind == "history":
        run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                               for item in record.history.item})
    elif kind == "summary":
        run["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                               for item in record.summary.update})
    elif kind == "exit":  # written by run.finish(): the file is complete
        run["finished"] = True
    elif kind == "artifact":
        run["artifacts"].append({"name": record.artifact.name, "type": record.artifact.type,
                                 "files": sorted(e.path for e in record.artifact.manifest.contents)})
