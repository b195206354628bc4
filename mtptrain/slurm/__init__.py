"""`mtptrain slurm`: sbatch scripts for precompute, train and eval, rendered from a recipe, and submitted.

Each stage's resources come from the recipe's `slurm` section; nothing about a
particular cluster (account, partition, paths) is written in the templates
(mtptrain/slurm/templates/). Rendering writes the fully resolved recipe next to
the scripts, so a job runs exactly what was rendered, whatever later edits the
recipe file sees. `pipeline` submits the three stages chained with afterok
dependencies; a train job that requeues itself keeps its job id, so eval waits
for its final success.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2

from mtptrain.config import Recipe, dump_recipe
from mtptrain.errors import MtptrainError
from mtptrain.tracking import pipeline_group

STAGES = ("precompute", "train", "eval")
TEMPLATES = Path(__file__).with_name("templates")


class SlurmError(MtptrainError, RuntimeError):
    """sbatch is missing or refused a script; the message has its output."""


def slurm_dir(recipe: Recipe) -> Path:
    return Path(recipe.slurm.output_dir or Path(recipe.train.output_dir) / "slurm").absolute()


def _job(recipe: Recipe, stage: str) -> dict:
    res = getattr(recipe.slurm, stage)
    job = {"nodes": res.nodes, "ntasks_per_node": res.tasks_per_node, "gpus_per_node": res.gpus_per_node,
           "cpus_per_task": res.cpus_per_task, "mem": res.mem, "time": res.time}
    if stage == "train":  # one launcher per node, which starts tasks_per_node processes
        job["ntasks_per_node"] = 1
    return job


def check_gpus(recipe: Recipe, stage: str) -> None:
    """Precompute and eval ranks each take target.gpus_per_rank GPUs: a node must have them all."""
    res, per_rank = getattr(recipe.slurm, stage), recipe.target.gpus_per_rank
    if stage == "train" or res.gpus_per_node == 0 or res.tasks_per_node * per_rank <= res.gpus_per_node:
        return
    raise SlurmError(
        f"slurm.{stage}: {res.tasks_per_node} task(s) per node × target.gpus_per_rank {per_rank} = "
        f"{res.tasks_per_node * per_rank} GPUs, but slurm.{stage}.gpus_per_node is {res.gpus_per_node}: set "
        f"slurm.{stage}.tasks_per_node={max(1, res.gpus_per_node // per_rank)} (or gpus_per_node="
        f"{res.tasks_per_node * per_rank})")


def render(recipe: Recipe, stage: str, recipe_path: Path) -> str:
    """The sbatch script of `stage`, running the recipe at `recipe_path`."""
    if stage not in STAGES:
        raise SlurmError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)} (or pipeline)")
    check_gpus(recipe, stage)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    cfg = recipe.slurm
    return env.get_template(f"{stage}.sbatch.j2").render(
        recipe_name=recipe.name, job=_job(recipe, stage), workdir=Path.cwd(), log_dir=slurm_dir(recipe) / "logs",
        partition=cfg.partition, account=cfg.account, sbatch_args=cfg.sbatch_args, setup=cfg.setup,
        python=sys.executable if cfg.python == "auto" else cfg.python, recipe_path=recipe_path,
        run_dir=Path(recipe.train.output_dir).absolute(), procs_per_node=cfg.train.tasks_per_node,
        warning_seconds=cfg.warning_seconds, gpus_per_rank=recipe.target.gpus_per_rank)


def write_scripts(recipe: Recipe, stages: tuple[str, ...]) -> dict[str, Path]:
    """The resolved recipe and one script per stage, in slurm_dir(recipe); returns the script paths."""
    directory = slurm_dir(recipe)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    recipe_path = directory / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    scripts = {}
    for stage in stages:
        scripts[stage] = directory / f"{stage}.sbatch"
        scripts[stage].write_text(render(recipe, stage, recipe_path))
    return scripts


def sbatch(script: Path, after: str | None = None) -> str:
    """Submit `script` (after job `after` succeeded, when given); returns the job id."""
    cmd = ["sbatch", "--parsable", *([f"--dependency=afterok:{after}"] if after else []), str(script)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SlurmError("sbatch is not on PATH: run `mtptrain slurm` on a Slurm login node, or use --dry-run "
                         "to see the scripts") from None
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def submit(recipe: Recipe, stage: str) -> list[tuple[str, str, Path]]:
    """Submit one stage, or with stage 'pipeline' all three chained; returns (stage, job id, script)."""
    stages = STAGES if stage == "pipeline" else (stage,)
    if stage == "pipeline":
        tracking = recipe.tracking.model_copy(update={"group": pipeline_group(recipe)})  # one W&B group for the run
        recipe = recipe.model_copy(update={"tracking": tracking})
    scripts = write_scripts(recipe, stages)
    submitted, previous = [], None
    for name in stages:
        previous = sbatch(scripts[name], previous)
        submitted.append((name, previous, scripts[name]))
    return submitted
