"""Reading an offline W&B run file back, for the tests that compare a run with what the commands printed."""

from __future__ import annotations

import json
from pathlib import Path


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
