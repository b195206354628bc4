"""Training throughput: the precision this machine trains in against float32, 1 -> 2 process scaling, and time
spent waiting for data.

    python benchmarks/train_throughput.py [--features runs/quickstart/features] [--steps 30] [--rounds 2]
                                          [--baseline-features DIR] [--set k=v ...] [--no-scaling]

Before and after: one process with all threads, "before" = train.precision=fp32 (the former CPU default) on
--baseline-features (default: the same store; give a store written before precompute recorded the target's
choices to measure that change too), "after" = precision auto (on a CPU with fast bfloat16 products,
bf16-autocast: mtptrain/train/optimization.py: pick_precision) on --features, alternately, --rounds times each;
the ratio is the median tokens/s of after over before.

Scaling: the same recipe twice in one go: one process with grad_accum 2, then two processes under torchrun
with grad_accum 1, so both consume the same global batch per step. Every process gets one thread
(OMP_NUM_THREADS=1), so the two runs have the same compute per process and the scaling efficiency is
(2-process tokens/s in all) / (2 x 1-process tokens/s). The data-wait fraction is the share of the training
loop spent waiting for the next batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mtptrain.machine import cpu_line, describe_cpu

REPO = Path(__file__).resolve().parents[1]


def run(features: str, out: Path, processes: int, steps: int, overrides: list[str], threads: int | None = 1) -> dict:
    sets = [f"train.features={features}", f"train.output_dir={out}", f"train.max_steps={steps}",
            f"train.grad_accum={2 // processes}", "train.eval_every=100000", "train.checkpoint_every=100000",
            "train.log_every=100000", "train.engine_eval.prompts=0", *overrides]
    cmd = ["-m", "mtptrain.cli", "train", "--no-progress", "--no-wandb", "-r", "recipes/quickstart.yaml",
           *[a for s in sets for a in ("--set", s)]]
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                                   if processes > 1 else [])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(launcher + cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"training with {processes} process(es) failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", default="runs/quickstart/features", help="feature store (run precompute first)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of before and after")
    parser.add_argument("--baseline-features", help="the store of the 'before' runs (default: --features)")
    parser.add_argument("--no-scaling", action="store_true", help="only the precision comparison")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override (repeatable)")
    args = parser.parse_args()
    if not (Path(args.features) / "manifest.json").is_file():
        sys.exit(f"{args.features} is not a complete feature store: run `make quickstart` (or precompute) first")
    cpu = describe_cpu()
    print(cpu_line(cpu))
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"before": (args.baseline_features or args.features, "fp32"), "after": (args.features, "auto")}
        speeds = {path: [] for path in paths}
        for r in range(args.rounds):
            for path, (features, precision) in paths.items():
                summary = run(features, Path(tmp) / f"{path}-{r}", 1, args.steps,
                              [*args.overrides, f"train.precision={precision}"], threads=None)
                speeds[path].append(summary["tokens_per_second"])
                print(f"  round {r + 1}, {path} (precision {precision}, {features}): {speeds[path][-1]:,.0f} "
                      "tokens/s", flush=True)
        before, after = (statistics.median(speeds[p]) for p in paths)
        print(f"{args.steps} steps of the quickstart recipe, 1 process, all threads")
        print(f"before             {before:10,.0f} tokens/s")
        print(f"after              {after:10,.0f} tokens/s   x{after / before:.2f}")
        if args.no_scaling:
            return
        one = run(args.features, Path(tmp) / "one", 1, args.steps, args.overrides)
        two = run(args.features, Path(tmp) / "two", 2, args.steps, args.overrides)
    # Rank 0 reports its own throughput; the ranks see the same number of batches of the same sizes.
    per_process_one, per_process_two = one["tokens_per_second"], two["tokens_per_second"]
    print(f"{args.steps} steps of the quickstart recipe, 1 thread per process")
    print(f"1 process          {per_process_one:10,.0f} tokens/s   data wait {one['data_wait_fraction']:6.1%}")
    print(f"2 processes        {per_process_two:10,.0f} tokens/s per process, {2 * per_process_two:,.0f} in all   "
          f"data wait {two['data_wait_fraction']:6.1%}")
    print(f"scaling 1 -> 2     {2 * per_process_two / (2 * per_process_one):10.3f}   (1.0 = perfect)")


if __name__ == "__main__":
    main()
