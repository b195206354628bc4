"""Runs vLLM's `speculators` (0.9.0) EAGLE-3 trainer on a CPU, in its own environment (scripts/setup_interop.sh):

    .venv-speculators/bin/python scripts/speculators_train_cpu.py --verifier-name-or-path DIR --data-path DIR \
        --save-path DIR --draft-attn-impl sdpa --loss-implementation eager --on-missing raise ...

The arguments are its trainer's own (`python -m speculators.train --help`). Four places in it assume an
accelerator; each is replaced here for this process, leaving the installed package untouched:

1. the model and every batch move to `get_local_rank()` (an int: a CUDA device): here "cpu";
2. the trainer's autocast device type falls back to "cuda" when no accelerator is present: here "cpu";
3. the checkpointer loads a resumed state on `get_current_device()`, "cuda:0" without an accelerator: "cpu";
4. the step timer calls torch.accelerator.synchronize(), which raises without one: a no-op here.

It runs as one process: speculators starts torch.distributed only when LOCAL_RANK is set, and then requires an
accelerator.
"""

import os

import torch

for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
    os.environ.pop(name, None)

import speculators.train.checkpointer as checkpointer  # noqa: E402
import speculators.train.trainer as trainer  # noqa: E402
from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

if not torch.accelerator.is_available():
    trainer.get_local_rank = lambda: "cpu"  # 1
    original_init = trainer.Trainer.__init__

    def _init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # 2

    trainer.Trainer.__init__ = _init
    checkpointer.get_current_device = lambda: "cpu"  # 3
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # 4

if __name__ == "__main__":
    main(TrainConfig.resolve())
