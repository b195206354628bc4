"""Where training metrics go: metrics.jsonl in the run directory always, W&B when enabled.

W&B runs offline unless credentials are configured (WANDB_API_KEY, or a
`wandb login` entry in ~/.netrc), so a run never blocks on the network and
never asks for a key; `wandb sync <run dir>/wandb/offline-run-*` uploads later.
Only the resolved recipe goes into the W&B config: no environment, no keys.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, mode: str, project: str, name: str, group: str, config: dict,
                 resume_id: str | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = wandb_mode(mode)
        if mode == "disabled":
            return
        import wandb

        self.wandb_run = wandb.init(project=project, name=name, group=group, job_type="train", config=config,
                                    dir=str(run_dir), mode=mode, id=resume_id, resume="allow" if resume_id else None,
                                    settings=wandb.Settings(silent=True, console="off"))
        log.info("W&B %s run %s in %s", mode, self.wandb_run.id, self.wandb_run.dir)

    @property
    def run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def forget_after(self, step: int) -> None:
        """Drop metrics.jsonl rows past `step` (a resumed run logs those steps again).

        W&B keeps its rows and ignores re-logged steps that are not past its last one; they carry the
        same values, since training from a checkpoint is deterministic.
        """
        if not self.enabled or not self.path.is_file():
            return
        rows = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in rows))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def read_offline_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (`run-<id>.wandb`), for checks and local inspection.

    wandb ships no reader for these files. Layout: a 7-byte header, then 32 KiB
    blocks of length-prefixed chunks (4-byte checksum, 2-byte length, 1-byte
    type: 1 full, 2 first, 3 middle, 4 last); chunks join into protobuf
    `Record`s from wandb.proto.wandb_internal_pb2.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    header, block = 7, 32 * 1024
    pos, pending, rows = header, b"", []
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
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
