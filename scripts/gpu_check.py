"""The GPU acceptance check: the CUDA paths of the project, in one command, offline, in at most 25 minutes on
one H100 (`make gpu-check`).

    python scripts/gpu_check.py [--out runs/gpu-check/gpu_check.json] [--parts NAME,NAME] [--dry-run]
                                [--tiny-target DIR] [--tiny-store DIR]

Parts, each in a process of its own, timed, under its own time budget (a part that fails, hangs past its budget
or crashes is recorded, and the next part runs):
  environment              torch, CUDA, cuDNN, NCCL, the GPUs, flash-attn, DeepSpeed's prebuilt and compatible ops,
                           nvcc and CUDA_HOME
  runtime_vs_transformers  `mtptrain eval` of the shipped head on the embedded SmolLM2-135M in bfloat16, on the
                           runtime and on transformers' forward: chain and tree at temperature 0 (every output
                           checked against plain greedy decoding), the chain and a tree of children drawn from
                           the head at temperature 1; tau and tokens/s
  split_target             the same eval with the target split over two GPUs (target.gpus_per_rank 2); not run on
                           one GPU
  torchrun_train           torchrun over min(2, GPUs) processes, NCCL, bf16, ZeRO-1: 100 steps of an EAGLE-3 head on
                           a small store of the embedded target, with AdamW and with Muon, each uninterrupted and
                           stopped (STOP file) then resumed; the resumed weights against the uninterrupted ones,
                           tokens/s and peak memory per rank
  eagle3_real_shapes       one forward and backward of the EAGLE-3 head at Llama-3.1-8B's and 70B's shapes
                           (recipes/shapes/*.json, random weights) at the recipes' micro-batches and 7 TTT steps:
                           time and peak memory against what docs/scale.md assumes
  decode_8b                batch-1 greedy decoding of a random-weight Llama-3.1-8B on the runtime (the engine's
                           loop): tokens/s, host time and GPU time per token apart, against the weights' roofline

Writes one JSON record (--out) and a Markdown table beside it (gpu_check.md, also printed); the parts' logs go to
logs/ beside them. Exit status 1 when a part failed ("not run" is no failure: its reason is recorded).

--dry-run runs every part that can on the CPU at a tiny size (tiny random Llamas for the targets and the real
shapes, gloo and 2 processes for torchrun, float32) and records which parts ran as CPU substitutes; it checks the
command's own plumbing, not the GPU. --tiny-target and --tiny-store give it a tiny target and a feature store of
that target to use (the test suite's); without them it builds both under the output directory.

On a GPU, --tiny-target (with or without --tiny-store) puts that target in the embedded one's place for the eval
and training parts, in bfloat16 on CUDA with NCCL: for a GPU machine where the embedded target's wheel cannot be
installed. Its taus say nothing (a random head); the exactness, sampling, NCCL and resume checks hold as they are.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "runs" / "gpu-check" / "gpu_check.json"
SCHEMA = 1


@dataclass(frozen=True)
class Part:
    name: str
    module: str  # scripts/<module>.py holds `check_<name>(args) -> dict`
    title: str
    budget_s: int  # on a GPU; all six sum to 24 minutes
    dry_budget_s: int


PARTS = [
    Part("environment", "gpu_check_env", "environment", 120, 120),
    Part("runtime_vs_transformers", "gpu_check_engine", "runtime vs transformers, bf16", 330, 180),
    Part("split_target", "gpu_check_engine", "target split over 2 GPUs", 150, 60),
    Part("torchrun_train", "gpu_check_train", "torchrun + NCCL training, resume", 480, 240),
    Part("eagle3_real_shapes", "gpu_check_shapes", "EAGLE-3 head step at 8B / 70B shapes", 210, 120),
    Part("decode_8b", "gpu_check_shapes", "batch-1 decoding, 8B shapes", 150, 120),
]
BY_NAME = {p.name: p for p in PARTS}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON record (the table goes beside it)")
    parser.add_argument("--parts", default=",".join(p.name for p in PARTS), help="comma-separated part names")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at a tiny size")
    parser.add_argument("--tiny-target", type=Path, help="a tiny target model directory to use (a dry run; on a GPU, in the embedded target's place)")
    parser.add_argument("--tiny-store", type=Path, help="a feature store of --tiny-target to train on")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # runs one part in this process, writing --record
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [n for n in args.parts.split(",") if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: the parts are {', '.join(BY_NAME)}")
    if args.tiny_store and not args.tiny_target:
        parser.error("--tiny-store needs --tiny-target, the target it was computed from")
    args.out = args.out.resolve()
    args.work = args.out.parent / "work"
    return args


# ---------------------------------------------------------------- one part, in its own process


def run_child(args: argparse.Namespace) -> None:
    """Run part `args.child` here and write its outcome to `args.record`: a part returns its details, with
    "checks" (name -> passed) and a "headline" for the table, or {"not_run": why}; an exception is a failure."""
    part = BY_NAME[args.child]
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        details = getattr(importlib.import_module(part.module), f"check_{part.name}")(args)
        outcome = outcome_of(details)
    except Exception as exc:  # noqa: BLE001 -- any failure of a part is its record, not the end of the check
        trace = traceback.format_exc()
        outcome = {"status": "fail", "error": f"{type(exc).__name__}: {exc}", "details": {"traceback": trace}}
        print(trace, file=sys.stderr)
    args.record.write_text(json.dumps(outcome, indent=1, default=str))


def outcome_of(details: dict) -> dict:
    if "not_run" in details:
        return {"status": "not run", "reason": details["not_run"], "details": details}
    failed = [name for name, passed in details.get("checks", {}).items() if not passed]
    if failed:
        return {"status": "fail", "error": "failed: " + "; ".join(failed), "details": details}
    return {"status": "pass", "details": details}


# ---------------------------------------------------------------- the driver


def child_env() -> dict:
    """This environment without a rendezvous a calling process may have left in it (the parts launch their own)."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.setdefault("WANDB_MODE", "disabled")
    return env


def child_command(args: argparse.Namespace, part: Part, record: Path) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", part.name, "--record", str(record),
               "--out", str(args.out)]
    if args.dry_run:
        command.append("--dry-run")
    for flag, value in (("--tiny-target", args.tiny_target), ("--tiny-store", args.tiny_store)):
        if value is not None:
            command += [flag, str(Path(value).resolve())]
    return command


def run_part(args: argparse.Namespace, part: Part) -> dict:
    """One part in a new process group, killed whole (torchrun and its workers too) past its budget."""
    budget = part.dry_budget_s if args.dry_run else part.budget_s
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record, log = logs / f"{part.name}.json", logs / f"{part.name}.log"
    record.unlink(missing_ok=True)
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(child_command(args, part, record), cwd=ROOT, env=child_env(), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = None
    seconds = time.perf_counter() - started
    if code is None:
        outcome = {"status": "fail", "error": f"exceeded its budget of {budget} s and was killed"}
    elif record.is_file():
        outcome = json.loads(record.read_text())
    else:
        outcome = {"status": "fail", "error": f"its process ended with status {code} and wrote no record; "
                   f"the end of its log: {tail(log)}"}
    return {"name": part.name, "title": part.title, "seconds": round(seconds, 1), "budget_s": budget,
            "log": str(log), "reason": None, "error": None, "details": {}, **outcome}


def stop_group(proc: subprocess.Popen) -> None:
    """End a part's process group: SIGTERM first, which torchrun passes on to its workers (they run in sessions of
    their own, out of the group's reach, and would keep the GPUs), then SIGKILL whatever is left after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


def record_of(args: argparse.Namespace, parts: list[dict], seconds: float) -> dict:
    counts = {s: sum(p["status"] == s for p in parts) for s in ("pass", "fail", "not run")}
    substitutes = {p["name"]: p["details"].get("cpu_substitute") for p in parts if p["details"].get("cpu_substitute")}
    device = next((p["details"].get("device") for p in parts if p["name"] == "environment"), None)
    return {"schema": SCHEMA, "dry_run": args.dry_run, "cpu_substitutes": substitutes if args.dry_run else {},
            "tiny_target": str(args.tiny_target) if args.tiny_target is not None else None,
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]], "device": device,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds)),
            "seconds": round(seconds, 1), "budget_s": sum(p["budget_s"] for p in parts), "counts": counts,
            "parts": parts}


def markdown(record: dict) -> str:
    kind = "dry run on the CPU (tiny sizes; not a GPU result)" if record["dry_run"] else "GPU run"
    if not record["dry_run"] and record.get("tiny_target"):
        kind += f", with --tiny-target {record['tiny_target']} in the embedded target's place"
    lines = [f"# GPU check: {kind}", "",
             f"{record['device'] or 'device unknown'}; {record['seconds']:.0f} s of a {record['budget_s']} s budget; "
             f"{record['counts']['pass']} passed, {record['counts']['fail']} failed, "
             f"{record['counts']['not run']} not run", "",
             "| part | status | seconds | budget | result |", "|---|---|---|---|---|"]
    for p in record["parts"]:
        said = p["details"].get("headline") or ""
        if p["status"] == "not run":
            said = p["reason"]
        elif p["status"] == "fail":
            said = f"{p['error']}" + (f" ({said})" if said else "")
        said = said.replace("|", "/").replace("\n", " ")
        lines.append(f"| {p['title']} | {p['status']} | {p['seconds']:.0f} | {p['budget_s']} | {said} |")
    if record["cpu_substitutes"]:
        lines += ["", "CPU substitutes:"] + [f"- {name}: {what}" for name, what in record["cpu_substitutes"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    parts = []
    for name in args.parts.split(","):
        part = BY_NAME[name]
        print(f"[{time.strftime('%H:%M:%S')}] {part.name} ...", flush=True)
        parts.append(run_part(args, part))
        print(f"[{time.strftime('%H:%M:%S')}] {part.name}: {parts[-1]['status']} in {parts[-1]['seconds']:.0f} s",
              flush=True)
    record = record_of(args, parts, time.perf_counter() - started)
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    table = markdown(record)
    args.out.with_suffix(".md").write_text(table)
    print("\n" + table + f"\nrecord: {args.out}\ntable: {args.out.with_suffix('.md')}")
    return 1 if record["counts"]["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
