"""Recipes and commands for trainer tests."""

import sys
from pathlib import Path

from mtptrain.config import DEFAULT_HEAD_KIND, HEAD_CONFIGS, dump_recipe, load_recipe

REPO = Path(__file__).resolve().parents[2]


def train_recipe(target_dir, store, out, *overrides):
    # Pinned, not measured: on a tiny model bfloat16 and float32 run in a near tie the machine may break either
    # way, and runs compared across processes must not differ in precision (a test of auto sets it again).
    kind = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("head.kind=")), DEFAULT_HEAD_KIND)
    vocab = ["head.draft_vocab_size=128"] if "draft_vocab_size" in HEAD_CONFIGS[kind].model_fields else []
    return load_recipe(None, [f"target.model={target_dir}", "target.dtype=float32", "train.precision=fp32",
                              f"train.features={store}", f"train.output_dir={out}",
                              "train.micro_batch_size=4", "train.lr=3e-3", "train.warmup_ratio=0.1",
                              "train.log_every=5", "train.eval_every=1000", "train.num_workers=0",
                              "tracking.wandb=disabled", *vocab,
                              "train.engine_eval.prompts=0", *overrides])  # tests of drafting turn it on


LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def clean_env() -> dict:
    """This process's environment without the rendezvous that in-process training runs left in it."""
    import os

    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}


def train_cmd(recipe, path: Path, *overrides: str) -> list[str]:
    dump_recipe(recipe, path)
    return [sys.executable, "-m", "mtptrain.cli", "train", "--no-progress", "-r", str(path),
            *[a for o in overrides for a in ("--set", o)]]
