"""The GPU check's training part (scripts/gpu_check.py): `mtptrain train` under torchrun with NCCL, bf16 and ZeRO-1,
with AdamW and with Muon, each run uninterrupted and stopped then resumed; the resumed head must equal the
uninterrupted one.

Two torchrun launches, each a fresh set of processes running trainings one after the other (run_train, the library
call behind `mtptrain train`, in this file's worker, which also reads each rank's peak memory):
  first    per optimizer, the uninterrupted run; then the same run stopped on request: rank 0 writes the run's STOP
           file (what a Slurm time-limit warning does) once the metrics show STOP_AT steps, and the trainer
           checkpoints at the next step and returns
  resumed  the stopped runs started again from their checkpoints, to the end, in new processes
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

from gpu_check_env import gpu_count, skip_without_cuda

OPTIMIZERS = ("adamw", "muon")
GPU_RUN = {"steps": 100, "stop_at": 50}
DRY_RUN = {"steps": 8, "stop_at": 3}
# Settings of every run: bf16 and ZeRO-1 as the recipes for real targets train, a metrics row every step (the STOP
# watcher reads them), no checkpoint or validation before the end, no drafting during training.
TRAIN = ["train.precision=bf16", "train.zero_stage=1", "train.log_every=1", "train.eval_every=100000",
         "train.checkpoint_every=100000", "train.engine_eval.prompts=0", "tracking.wandb=disabled"]
# A GPU run's store: the embedded target's features of 400 ShareGPT conversations (quickstart recipe).
GPU_STORE = ["data.max_conversations=400", "data.max_length=512"]
QUICKSTART = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"
SUBSTITUTE = ("gloo and 2 CPU processes, a tiny random target and its store, {steps} steps (stopped after "
              "{stop_at}); bf16 through DeepSpeed's CPU accelerator; torch.compile off (Muon's step runs eager); peak "
              "memory as each process's max RSS")


def check_torchrun_train(args) -> dict:
    skipped = skip_without_cuda(args)
    if skipped:
        return skipped
    size = DRY_RUN if args.dry_run else GPU_RUN
    processes = 2 if args.dry_run else min(2, gpu_count())
    recipe, settings = store_recipe(args)
    settings = settings + TRAIN + [f"train.max_steps={size['steps']}"]
    base = args.work / "train"
    shutil.rmtree(base, ignore_errors=True)  # a run directory left by an earlier check would be resumed
    plans = {"first": [run_plan(base, opt, "straight", None) for opt in OPTIMIZERS]
                      + [run_plan(base, opt, "stopped", size["stop_at"]) for opt in OPTIMIZERS],
             "resumed": [run_plan(base, opt, "stopped", None) for opt in OPTIMIZERS]}
    launches = {name: torchrun(args, base / f"{name}.json", processes, recipe, settings, runs)
                for name, runs in plans.items()}
    details = {"processes": processes, "backend": "gloo" if args.dry_run else "nccl", **size,
               "optimizers": {opt: compare(base, opt, launches, size) for opt in OPTIMIZERS}}
    details["checks"] = {f"{opt}: {name}": passed for opt, found in details["optimizers"].items()
                         for name, passed in found.pop("checks").items()}
    details["headline"] = "; ".join(
        f"{opt}: {found['tokens_per_second']:.0f} tok/s per rank, peak {found['peak_memory']}, resumed max |diff| "
        f"{found['max_abs_diff']:.2e}" for opt, found in details["optimizers"].items())
    if args.dry_run:
        details["cpu_substitute"] = SUBSTITUTE.format(**size)
    return details


def run_plan(base: Path, optimizer: str, kind: str, stop_at: int | None) -> dict:
    return {"optimizer": optimizer, "kind": kind, "output_dir": str(base / kind / optimizer), "stop_at": stop_at}


def store_recipe(args) -> tuple[str | None, list[str]]:
    """(recipe file, overrides) naming a feature store to train on: on a GPU, the embedded target's, computed here
    first (bf16 on cuda:0); in a dry run, or on a GPU given --tiny-target, --tiny-store or one computed from the
    tiny target."""
    from mtptrain.config import load_recipe
    from mtptrain.features.precompute import run_precompute

    features = args.work / "features"
    if args.dry_run or args.tiny_target is not None:
        from gpu_check_engine import tiny_target

        target = tiny_target(args)
        if args.tiny_store is not None:
            features = Path(args.tiny_store)
        settings = [f"target.model={target}", "target.dtype=float32", "head.kind=eagle3", "head.ttt_steps=2",
                    "head.draft_vocab_size=64", "train.micro_batch_size=4", "train.lr=3e-3", "train.num_workers=0",
                    f"train.features={features}"]
        store = ["data.max_length=128", "data.max_conversations=48", "precompute.layers=[0, 1, 2]",
                 f"precompute.output_dir={features}"]
        recipe = None
    else:
        settings, recipe = [f"train.features={features}", "train.num_workers=1"], str(QUICKSTART)
        store = GPU_STORE + [f"precompute.output_dir={features}"]
    if not (features / "manifest.json").is_file():
        run_precompute(load_recipe(recipe, settings + store + ["tracking.wandb=disabled"]), show_progress=False)
        release_gpu_memory()
    return recipe, settings


def release_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def torchrun(args, plan_file: Path, processes: int, recipe: str | None, settings: list[str], runs: list[dict]) -> dict:
    """One launch of `processes` workers running `runs` in order; returns {"seconds", "ranks": [per rank record]}."""
    import subprocess

    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps({"recipe": recipe, "settings": settings, "runs": runs}))
    for rank in range(processes):
        plan_file.with_suffix(f".rank{rank}.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               str(Path(__file__).resolve()), str(plan_file)]
    started = time.perf_counter()
    # A dry run leaves torch.compile off: DeepSpeed's Muon compiles its Newton-Schulz step on first use, which on a
    # CPU is a minute of C++ compilation per process (a GPU run compiles it for Triton, as training does).
    env = {**os.environ, **({"TORCH_COMPILE_DISABLE": "1"} if args.dry_run else {})}
    done = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"torchrun {plan_file.stem} exited with status {done.returncode} (its output is above in "
                           "this part's log)")
    ranks = [json.loads(plan_file.with_suffix(f".rank{rank}.json").read_text()) for rank in range(processes)]
    return {"seconds": round(seconds, 1), "ranks": ranks}


def compare(base: Path, optimizer: str, launches: dict, size: dict) -> dict:
    """One optimizer's runs: the stopped one stopped where asked, the resumed one finished, and its head's weights
    against the uninterrupted head's."""
    import torch
    from safetensors.torch import load_file

    def run_of(launch: str, kind: str) -> list[dict]:
        """Every rank's record of the optimizer's run of that kind in that launch."""
        return [next(r for r in rank["runs"] if (r["optimizer"], r["kind"]) == (optimizer, kind))
                for rank in launches[launch]["ranks"]]

    straight, stopped, resumed = run_of("first", "straight"), run_of("first", "stopped"), run_of("resumed", "stopped")
    a = load_file(base / "straight" / optimizer / "head" / "model.safetensors")
    b = load_file(base / "stopped" / optimizer / "head" / "model.safetensors")
    diff = max(((a[k].double() - b[k].double()).abs().max().item() for k in a if k in b and a[k].is_floating_point()),
               default=float("inf"))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    close = a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double(), atol=1e-6, rtol=1e-5) for k in a)
    stop_step = stopped[0]["summary"]["steps"]
    checks = {
        f"stopped on request after step {size['stop_at']} (at step {stop_step})":
            all(r["summary"].get("stopped") for r in stopped) and size["stop_at"] < stop_step < size["steps"],
        f"resumed to step {size['steps']}": all(r["summary"]["steps"] == size["steps"] for r in resumed),
        "resumed head equals the uninterrupted head (atol 1e-6, rtol 1e-5)": close,
    }
    return {"checks": checks, "stopped_at": stop_step, "identical": same, "max_abs_diff": diff,
            "tokens_per_second": min(r["summary"]["tokens_per_second"] for r in straight),
            "tokens_per_second_per_rank": [round(r["summary"]["tokens_per_second"], 1) for r in straight],
            "seconds": [round(r["seconds"], 1) for r in straight],
            "peak_memory": peak_line(straight), "memory_per_rank": [r["memory"] for r in straight],
            "launch_seconds": {name: launch["seconds"] for name, launch in launches.items()}}


def peak_line(ranks: list[dict]) -> str:
    memory = [r["memory"] for r in ranks]
    if memory[0].get("max_allocated_gib") is not None:
        return "/".join(f"{m['max_allocated_gib']:.2f}" for m in memory) + " GiB allocated"
    return "/".join(f"{m['max_rss_gib']:.2f}" for m in memory) + " GiB RSS"


# ---------------------------------------------------------------- the worker torchrun starts


def worker(plan_file: Path) -> None:
    """Run the plan's trainings one after the other in this rank; write what each returned, its time and this
    rank's peak memory to <plan>.rank<R>.json."""
    import torch

    from mtptrain.config import load_recipe
    from mtptrain.dist import DistInfo, setup_logging
    from mtptrain.train.trainer import run_train

    plan = json.loads(plan_file.read_text())
    dist = DistInfo.from_env()
    setup_logging(dist, logging.INFO)
    records = []
    for run in plan["runs"]:
        recipe = load_recipe(plan["recipe"], plan["settings"] + [f"train.optimizer={run['optimizer']}",
                                                                 f"train.output_dir={run['output_dir']}"])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        watcher = stop_after(Path(run["output_dir"]), run["stop_at"]) if dist.is_main and run["stop_at"] else None
        started = time.perf_counter()
        summary = run_train(recipe, show_progress=False)
        seconds = time.perf_counter() - started
        if watcher is not None:
            watcher.set()
        records.append({"optimizer": run["optimizer"], "kind": run["kind"], "summary": summary, "seconds": seconds,
                        "memory": peak_memory()})
    plan_file.with_suffix(f".rank{dist.rank}.json").write_text(json.dumps({"rank": dist.rank, "runs": records},
                                                                          default=str))


def stop_after(run_dir: Path, step: int) -> threading.Event:
    """Write run_dir/STOP once metrics.jsonl holds a row of `step` or later; returns the event that ends the
    watch."""
    from mtptrain.train.trainer import STOP_FILE

    done = threading.Event()

    def watch() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not done.is_set():
            if any(logged_step(row) >= step for row in (metrics.read_text().splitlines() if metrics.is_file() else [])):
                (run_dir / STOP_FILE).touch()
                return
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    return done


def logged_step(row: str) -> int:
    """The step of a metrics.jsonl row; -1 for a row still being written."""
    try:
        return int(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def peak_memory() -> dict:
    """This rank's peak: torch's allocator on CUDA (allocated and reserved since the run began), and the process's
    max resident set (since it started) everywhere."""
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if not torch.cuda.is_available():
        return {"max_allocated_gib": None, "max_reserved_gib": None, "max_rss_gib": round(rss, 3)}
    return {"max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3), "max_rss_gib": round(rss, 3)}


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
