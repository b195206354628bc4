"""scripts/gpu_check.py, the GPU acceptance check (`make gpu-check`): its dry run on the CPU, every part at a tiny
size on the suite's tiny target and store, as a user runs it; a failing part recorded while the others run; on a
machine without CUDA, its GPU parts recorded as not run. The tests marked gpu run the real parts on CUDA and are
skipped, with the reason, everywhere else: a part that did not run is never reported as passed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
PARTS = ["environment", "runtime_vs_transformers", "split_target", "torchrun_train", "eagle3_real_shapes",
         "decode_8b"]
NO_CUDA = "no CUDA: run make gpu-check on a GPU machine"
# In-process training tests leave a loopback rendezvous in this process's environment: not for the child.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def gpu_check(out: Path, *args, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    """scripts/gpu_check.py run from the repository's root with --out `out`: what it printed, and its record."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert out.is_file(), f"no record written:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, json.loads(out.read_text())


def parts_of(record: dict) -> dict:
    return {p["name"]: p for p in record["parts"]}


@pytest.fixture(scope="module")
def dry_run(tiny_target_dir, tiny_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    done, record = gpu_check(out, "--dry-run", "--tiny-target", tiny_target_dir, "--tiny-store", tiny_store)
    return done, record, out


@pytest.mark.multiprocess
def test_the_dry_run_runs_every_part_or_says_why_not(dry_run):
    done, record, out = dry_run
    parts = parts_of(record)
    assert done.returncode == 0, {n: (p["status"], p["error"]) for n, p in parts.items()}
    assert record["schema"] == 1 and record["dry_run"] is True and list(parts) == PARTS
    assert record["counts"] == {"pass": 5, "fail": 0, "not run": 1}
    for name, part in parts.items():
        assert part["seconds"] >= 0 and part["budget_s"] > 0 and Path(part["log"]).is_file(), name
        assert part["status"] == "pass" or part["reason"], name
    assert parts["split_target"]["status"] == "not run" and "two GPUs" in parts["split_target"]["reason"]
    # every part that ran in place of a GPU run says what it ran instead
    assert set(record["cpu_substitutes"]) == set(PARTS) - {"split_target"}
    assert record["budget_s"] == sum(p["budget_s"] for p in parts.values())


@pytest.mark.multiprocess
def test_the_dry_runs_table_is_printed_and_written_beside_its_record(dry_run):
    done, record, out = dry_run
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# GPU check: dry run on the CPU") and table.strip() in done.stdout
    for part in record["parts"]:
        assert f"| {part['title']} | {part['status']} |" in table
    assert "CPU substitutes:" in table


@pytest.mark.multiprocess
def test_the_dry_runs_parts_record_what_they_measured(dry_run):
    parts = parts_of(dry_run[1])
    environment = parts["environment"]["details"]
    assert environment["torch"] == torch.__version__ and environment["deepspeed"]["version"]
    assert environment["deepspeed"]["compatible"] and environment["nvcc"].keys() >= {"path", "CUDA_HOME"}
    runs = parts["runtime_vs_transformers"]["details"]["runs"]
    assert list(runs) == ["native T=0", "native T=1", "transformers T=0", "transformers T=1"]
    for label, run in runs.items():
        assert run["runtime"].startswith("mtptrain runtime" if label.startswith("native") else "transformers")
        assert [m["label"] for m in run["methods"]] == ["baseline", "chain K=2", "tree N=4"]
        assert all(m["tau"] >= 1 and m["tokens_per_second"] > 0 for m in run["methods"])
    train = parts["torchrun_train"]["details"]
    assert (train["processes"], train["backend"]) == (2, "gloo") and set(train["optimizers"]) == {"adamw", "muon"}
    for found in train["optimizers"].values():
        assert found["max_abs_diff"] <= 1e-6 and 3 < found["stopped_at"] < 8 and found["tokens_per_second"] > 0
    shapes = parts["eagle3_real_shapes"]["details"]["targets"]
    assert set(shapes) == {"8b", "70b"} and all(s["ttt_steps"] == 7 and s["head_parameters"] > 0 for s in
                                                shapes.values())
    assert (shapes["8b"]["micro_batch"], shapes["70b"]["micro_batch"]) == (4, 2)  # the recipes'
    decode = parts["decode_8b"]["details"]
    assert decode["new_tokens"] == 8 and decode["runtime"].startswith("mtptrain runtime")
    assert decode["issue_ms"] > 0 and decode["synced_wall_ms"] > 0 and decode["host_cpu_ms"] > 0


def test_a_failing_part_is_recorded_and_the_next_part_still_runs(tmp_path):
    done, record = gpu_check(tmp_path / "gpu_check.json", "--dry-run", "--parts",
                             "runtime_vs_transformers,split_target", "--tiny-target", tmp_path / "no-such-model",
                             timeout=300)
    parts = parts_of(record)
    assert done.returncode == 1 and record["counts"] == {"pass": 0, "fail": 1, "not run": 1}
    assert parts["runtime_vs_transformers"]["status"] == "fail" and "no-such-model" in parts["runtime_vs_transformers"][
        "error"]
    assert "Traceback" in parts["runtime_vs_transformers"]["details"]["traceback"]
    assert parts["split_target"]["status"] == "not run"


def test_a_gpu_run_given_a_tiny_target_evaluates_and_trains_that_target_in_bfloat16(tiny_target_dir, tiny_store,
                                                                                      tmp_path, monkeypatch):
    """On a GPU machine the embedded target's wheel cannot reach, --tiny-target takes its place: the eval parts get
    that target, a random head of it, four prompts and bfloat16, and the training part its store; the table says
    so. (The parts themselves need CUDA; their settings are decided the same on any machine.)"""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check
    import gpu_check_engine
    import gpu_check_train

    args = argparse.Namespace(dry_run=False, tiny_target=tiny_target_dir, tiny_store=tiny_store, work=tmp_path / "work")
    args.work.mkdir()
    settings = gpu_check_engine.eval_settings(args)
    assert "target.dtype=bfloat16" in settings and "eval.max_new_tokens=64" in settings
    assert f"target.model={tiny_target_dir}" in settings and not any("PRETRAINED" in s for s in settings)
    recipe = gpu_check_engine.load(settings + gpu_check_engine.RUNS["T=0"] + [f"eval.output_dir={tmp_path / 'e'}"])
    assert recipe.eval.head.startswith(str(tmp_path)) and len(open(recipe.eval.prompts).readlines()) == 4
    _, train_settings = gpu_check_train.store_recipe(args)
    assert f"train.features={tiny_store}" in train_settings and f"target.model={tiny_target_dir}" in train_settings
    record = {"dry_run": False, "tiny_target": str(tiny_target_dir), "device": "1 x GPU", "seconds": 1,
              "budget_s": 1, "counts": {"pass": 0, "fail": 0, "not run": 0}, "parts": [], "cpu_substitutes": {}}
    assert gpu_check.markdown(record).startswith(f"# GPU check: GPU run, with --tiny-target {tiny_target_dir} in")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU parts run there")
def test_without_cuda_the_gpu_parts_are_not_run_and_say_so(tmp_path):
    done, record = gpu_check(tmp_path / "gpu_check.json", "--parts", "environment,decode_8b,eagle3_real_shapes",
                             timeout=300)
    parts = parts_of(record)
    assert done.returncode == 0 and record["dry_run"] is False and record["cpu_substitutes"] == {}
    assert parts["environment"]["status"] == "pass" and parts["environment"]["details"]["gpus"] == []
    for name in ("decode_8b", "eagle3_real_shapes"):
        assert parts[name]["status"] == "not run" and parts[name]["reason"].startswith("no CUDA device"), name


# ---------------------------------------------------------------- the real parts, on CUDA


@pytest.fixture(scope="module")
def gpu_record(tmp_path_factory) -> dict:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    out = tmp_path_factory.mktemp("gpu-check-cuda") / "gpu_check.json"
    return gpu_check(out, timeout=1800)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("name", PARTS)
def test_a_gpu_part_passes_on_cuda(gpu_record, name):
    part = parts_of(gpu_record)[name]
    if part["status"] == "not run":  # one GPU: the split; reported as skipped, with its reason, never as passed
        pytest.skip(f"{name} not run: {part['reason']}")
    assert part["status"] == "pass", f"{part['error']} (log: {part['log']})"
