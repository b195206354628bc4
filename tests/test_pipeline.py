"""`mtptrain pipeline` runs regenerate, precompute, train and eval in order; a rerun keeps the finished data,
features and head."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import write_sharegpt

REPO = Path(__file__).resolve().parents[1]
# In-process training tests leave a loopback rendezvous in this process's environment: not for the child.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def test_pipeline_runs_every_stage_and_resumes_without_redoing_them(varied_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 24)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"the word is {w}"]}) + "\n"
                               for i, w in enumerate(["hot", "water", "time"])))
    run = tmp_path / "run"
    sets = [f"target.model={varied_target_dir}", f"data.source={source}", "data.max_length=128",
            "data.validation_fraction=0.2", f"data.regenerated={run / 'regenerated.jsonl'}",
            "regenerate.max_new_tokens=32", "regenerate.batch_size=8",
            f"precompute.output_dir={run / 'features'}", "precompute.layers=[0]", "precompute.dtype=float32",
            f"train.features={run / 'features'}", f"train.output_dir={run / 'train'}", "train.epochs=2",
            "train.micro_batch_size=4", "train.num_workers=0", "head.kind=eagle3", "head.ttt_steps=2",
            "head.draft_vocab_size=64", f"eval.prompts={prompts}", "eval.methods=[chain]", "eval.k=[2]",
            "eval.max_new_tokens=12", "eval.repeats=1", f"eval.output_dir={run / 'eval'}"]
    sets += ["tracking.wandb=offline"]
    cmd = [sys.executable, "-m", "mtptrain.cli", "pipeline", "--no-progress",
           *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("SLURM_")}
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    stages = [line for line in first.stdout.splitlines() if line.startswith("== ")]
    assert stages == ["== regenerate", "== precompute", "== train", "== eval"]
    # precompute copied every sample's states from what regenerate kept while decoding, computing none
    copied = [line for line in first.stdout.splitlines() if "copied from the states `mtptrain regenerate` kept" in line]
    computed = [line for line in first.stdout.splitlines() if line.startswith("computed ") and "tokens in" in line]
    assert copied and computed and copied[0].split()[2] == computed[0].split()[1], first.stdout
    rows = [json.loads(line) for line in (run / "regenerated.jsonl").read_text().splitlines()]
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    assert manifest["data"]["regenerated"] == str(run / "regenerated.jsonl")
    assert manifest["totals"]["train"]["samples"] + manifest["totals"]["validation"]["samples"] == len(rows)
    results = json.loads((run / "eval" / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["baseline", "chain K=2"]
    assert results["methods"][1]["exactness"]["identical"] == 3
    steps = json.loads((run / "train" / "summary.json").read_text())["steps"]
    head = (run / "train" / "head" / "model.safetensors").read_bytes()
    # W&B (offline): the three jobs of one group, each with what the run printed
    from wandb_files import read_offline_run

    logged = {r["job_type"]: r for r in map(read_offline_run, run.rglob("wandb/offline-run-*/run-*.wandb"))}
    assert sorted(logged) == ["eval", "precompute", "train"] and all(r["finished"] for r in logged.values())
    (group,) = {r["group"] for r in logged.values()}
    assert group.startswith("run-") and len(group) == len("run-20261122-000000")  # <name>-<date-time>
    tokens = logged["precompute"]["summary"]["precompute/tokens"]
    assert f"tokens {tokens:,}" in first.stdout and tokens == sum(t["tokens"] for t in manifest["totals"].values())
    assert f"trained {steps} steps" in first.stdout and logged["train"]["history"][-1]["_step"] == steps
    tau = logged["eval"]["summary"]["tau/chain K=2"]
    assert tau == results["methods"][1]["tau"] and f"{tau:.2f}" in first.stdout
    assert logged["train"]["artifacts"][0]["type"] == "model"

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run: 0 tokens" in again.stdout  # every batch was already regenerated
    assert json.loads((run / "train" / "summary.json").read_text())["steps"] == steps
    assert (run / "train" / "head" / "model.safetensors").read_bytes() == head
