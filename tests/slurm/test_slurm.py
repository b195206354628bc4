"""`mtptrain slurm` against a real single-node Slurm (cluster.py): the rendered scripts, the chained pipeline on
the embedded default, and a train job that is warned, checkpoints, requeues itself and ends as an uninterrupted
run would."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster import LocalSlurm, install
from safetensors.torch import load_file
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.config import load_recipe
from mtptrain.slurm import SlurmError, render

REPO = Path(__file__).resolve().parents[2]
CPU_JOBS = ["slurm.precompute.tasks_per_node=2", "slurm.precompute.gpus_per_node=0",
            "slurm.train.tasks_per_node=2", "slurm.train.gpus_per_node=0", "slurm.train.cpus_per_task=2",
            "slurm.eval.gpus_per_node=0", "slurm.precompute.time=00:20:00", "slurm.train.time=00:20:00",
            "slurm.eval.time=00:20:00"]
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the Slurm tests: {reason}")
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield slurm
    slurm.stop()


def submit(cluster: LocalSlurm, stage: str, overrides: list[str], recipe: str | None = None) -> dict[str, str]:
    """`mtptrain slurm STAGE` as a user runs it; returns stage -> job id."""
    env = {k: v for k, v in cluster.env.items() if k not in LAUNCHER_VARS}
    cmd = [sys.executable, "-m", "mtptrain.cli", "slurm", stage, *(["--recipe", recipe] if recipe else []),
           *[a for o in overrides for a in ("--set", o)]]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split()[1]: line.split()[4].rstrip(":") for line in done.stdout.splitlines()
            if line.startswith("submitted ")}


def log_of(directory: Path, job: str) -> str:
    return "".join(p.read_text() for p in (directory / "logs").glob(f"*-{job}.out"))


def test_scripts_are_filled_from_the_recipe_with_nothing_of_a_cluster_baked_in(tmp_path):
    recipe = load_recipe(None, ["name=big", f"train.output_dir={tmp_path / 'run'}", "slurm.train.nodes=4",
                                "slurm.train.time=2-00:00:00", "slurm.warning_seconds=600"])
    script = render(recipe, "train", tmp_path / "recipe.yaml")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue",
                 "--nproc-per-node=8", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
                 f"-m mtptrain.cli train --recipe {tmp_path / 'recipe.yaml'}", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script, line
    assert "--partition" not in script and "--account" not in script and str(Path.home()) not in script
    directives = [n for n, line in enumerate(script.splitlines()) if line.startswith("#SBATCH")]
    first_command = next(n for n, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    assert max(directives) < first_command  # sbatch reads no directive after the first command
    pre = render(load_recipe(None, ["slurm.partition=gpu", "slurm.account=lab", "slurm.sbatch_args=[--qos=high]",
                                    "slurm.precompute.nodes=2"]), "precompute", tmp_path / "r.yaml")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=lab", "#SBATCH --qos=high", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=8", "srun --kill-on-bad-exit=1"):
        assert line in pre, line
    partial = load_recipe(None, ["slurm.train.nodes=2", "slurm.eval.gpus_per_node=0"]).slurm
    assert (partial.train.time, partial.eval.tasks_per_node) == ("24:00:00", 1)  # other defaults of the stage kept
    dry = CliRunner().invoke(app, ["slurm", "pipeline", "--dry-run"])
    assert dry.exit_code == 0 and dry.output.count("#!/usr/bin/env bash") == 3
    assert CliRunner().invoke(app, ["slurm", "finetune"]).exit_code == 2


def test_ranks_split_over_several_gpus_fit_their_nodes(tmp_path):
    big = load_recipe(REPO / "recipes/llama-3.1-70b-eagle3.yaml")
    scripts = {stage: render(big, stage, tmp_path / "r.yaml") for stage in ("precompute", "train", "eval")}
    assert "#SBATCH --ntasks-per-node=4" in scripts["precompute"] and "#SBATCH --gpus-per-node=8" in scripts["precompute"]
    assert "#SBATCH --gpus-per-node=2" in scripts["eval"] and "--nproc-per-node=8" in scripts["train"]
    crowded = load_recipe(None, ["target.gpus_per_rank=2"])  # the default 8 precompute tasks on 8 GPUs
    with pytest.raises(SlurmError, match=r"8 task\(s\) per node × target.gpus_per_rank 2 = 16 GPUs.*"
                                         r"set slurm.precompute.tasks_per_node=4"):
        render(crowded, "precompute", tmp_path / "r.yaml")
    render(crowded, "train", tmp_path / "r.yaml")  # training ranks hold the frozen parts only: one GPU each


@pytest.mark.real_model
def test_the_pipeline_runs_chained_on_slurm_with_two_cpu_tasks(cluster, tmp_path):
    out = tmp_path / "run"
    overrides = [*CPU_JOBS, "name=slurm-pipeline", "data.max_conversations=24", "data.max_length=128",
                 f"precompute.output_dir={out / 'features'}", "precompute.shard_mb=2", f"train.features={out / 'features'}",
                 f"train.output_dir={out / 'train'}", "train.max_steps=3", "train.eval_every=3",
                 "tracking.wandb=disabled", f"eval.output_dir={out / 'eval'}", "eval.max_prompts=1", "eval.max_turns=1",
                 "eval.max_new_tokens=8", "eval.methods=[chain]", "eval.k=[2]"]
    jobs = submit(cluster, "pipeline", overrides, "recipes/quickstart.yaml")
    assert list(jobs) == ["precompute", "train", "eval"]
    assert cluster.job(jobs["train"])["Dependency"] == f"afterok:{jobs['precompute']}(unfulfilled)"
    assert cluster.job(jobs["eval"])["Dependency"] == f"afterok:{jobs['train']}(unfulfilled)"
    for stage, job in jobs.items():
        info = cluster.wait(job, timeout=900)
        assert info["JobState"] == "COMPLETED", (stage, info, log_of(out / "train" / "slurm", job))
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert {shard["rank"] for shard in manifest["shards"]} == {0, 1}  # two srun tasks wrote disjoint shards
    assert (out / "train" / "head" / "model.safetensors").is_file()
    assert json.loads((out / "train" / "summary.json").read_text())["world_size"] == 2
    results = json.loads((out / "eval" / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["baseline", "chain K=2"]
    rendered = load_recipe(out / "train" / "slurm" / "recipe.yaml")
    assert rendered.tracking.group.startswith("slurm-pipeline-")  # one W&B group for the three jobs of this run


def test_a_warned_train_job_checkpoints_requeues_and_ends_as_an_uninterrupted_run(cluster, tiny_target_dir,
                                                                                   tiny_store, tmp_path):
    def train_overrides(name: str) -> list[str]:
        return [*CPU_JOBS, f"name={name}", f"target.model={tiny_target_dir}", f"train.features={tiny_store}",
                f"train.output_dir={tmp_path / name}", "head.kind=eagle", "train.max_steps=150",
                "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=1000", "train.num_workers=0",
                "train.checkpoint_every=1000", "tracking.wandb=disabled", "slurm.warning_seconds=60"]

    clean = submit(cluster, "train", train_overrides("clean"))["train"]
    warned = submit(cluster, "train", train_overrides("warned"))["train"]
    metrics = tmp_path / "warned" / "metrics.jsonl"
    deadline = time.time() + 600
    while cluster.job(warned)["JobState"] != "RUNNING" or not metrics.is_file() or \
            len(metrics.read_text().splitlines()) < 3:
        assert time.time() < deadline and cluster.job(warned)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.1)
    cluster.run("scancel", "--signal=USR1", "--batch", warned)  # what Slurm sends slurm.warning_seconds ahead
    assert cluster.wait(clean, timeout=600)["JobState"] == "COMPLETED"
    info = cluster.wait(warned, timeout=600)
    log = log_of(tmp_path / "warned" / "slurm", warned)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log)
    assert "warning signal: asking the trainer to checkpoint and stop" in log
    stopped_at = int(log.split("stopped on request at step ")[1].split()[0])
    assert 3 <= stopped_at < 150 and f"requeueing job {warned}" in log
    assert f"at step {stopped_at}" in log.split("restart 1")[1]  # the requeued job resumed there
    assert not (tmp_path / "warned" / "REQUEUE").exists() and not (tmp_path / "warned" / "STOP").exists()
    a, b = (load_file(tmp_path / name / "head" / "model.safetensors") for name in ("clean", "warned"))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name
    assert json.loads((tmp_path / "warned" / "summary.json").read_text())["steps"] == 150
