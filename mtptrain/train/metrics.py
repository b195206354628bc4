"""Where training metrics go: metrics.jsonl in the run directory always, W&B (mtptrain/tracking.py) when
enabled."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mtptrain.config import Recipe
from mtptrain.io import load_json
from mtptrain.tracking import init_run

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, recipe: Recipe, mode: str, resume_id: str | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb_run = init_run(recipe, "train", mode, run_dir, resume_id)
        if self.wandb_run is not None:
            log.info("W&B run %s in %s", self.wandb_run.id, self.wandb_run.dir)

    @property
    def run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def forget_after(self, step: int) -> None:
        """Drop metrics.jsonl rows past `step` (a resumed run logs those steps again).

        W&B keeps its rows and ignores re-logged steps that are not past its last one; they carry the
        same values, since training from a checkpoint is deterministic. A row that does not read as one of
        ours (the last, torn by a kill mid-write, or a line edited) goes too, with a warning.
        """
        if not self.enabled or not self.path.is_file():
            return
        kept, dropped = [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                row = load_json(line)
                keep = row["step"] <= step
            except (ValueError, TypeError, KeyError):
                keep, dropped = False, dropped + 1
            if keep:
                kept.append(line)
        if dropped:
            log.warning("%s: %d line(s) that are not metrics rows dropped (a row torn by a kill mid-write, or edited)",
                        self.path, dropped)
        self.path.write_text("".join(line + "\n" for line in kept))

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
