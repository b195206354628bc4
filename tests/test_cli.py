import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_sharegpt
from typer.testing import CliRunner

from mtptrain.cli import app

runner = CliRunner()


def test_help_explains_each_command():
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0 and "precompute" in top.output and "recipe" in top.output
    help_text = runner.invoke(app, ["precompute", "--help"]).output
    assert "--recipe" in help_text and "--set" in help_text and "resumes" in help_text


def test_recipe_command_prints_the_resolved_recipe():
    result = runner.invoke(app, ["recipe", "-r", "recipes/quickstart.yaml", "--set", "data.max_length=64"])
    assert result.exit_code == 0
    assert "max_length: 64" in result.output and "dtype: bfloat16" in result.output


def test_bad_recipe_key_exits_2_with_a_suggestion():
    result = runner.invoke(app, ["recipe", "--set", "data.max_conversation=3"])
    assert result.exit_code == 2
    assert "did you mean 'data.max_conversations'" in result.output


def test_missing_data_exits_1_with_a_message(tmp_path, tiny_target_dir):
    result = runner.invoke(app, ["precompute", "--no-progress", "--set", f"target.model={tiny_target_dir}",
                                 "--set", f"data.source={tmp_path / 'nope.json'}",
                                 "--set", f"precompute.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 1
    assert "nope.json does not exist" in result.output


def test_independent_ranks_without_rendezvous_still_produce_one_manifest(tmp_path, tiny_target_dir):
    """The srun / job-array path: ranks from the environment, no process group, last one merges."""
    data = write_sharegpt(tmp_path / "c.json", 60)
    cmd = [sys.executable, "-m", "mtptrain.cli", "precompute", "--no-progress",
           "--set", f"target.model={tiny_target_dir}", "--set", f"data.source={data}", "--set", "data.max_length=160",
           "--set", f"precompute.output_dir={tmp_path / 'out'}", "--set", "precompute.shard_mb=0.02",
           "--set", "precompute.layers=[1]"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK")
           and not k.startswith("SLURM_")}
    procs = [subprocess.Popen(cmd, env={**env, "SLURM_PROCID": str(r), "SLURM_STEP_NUM_TASKS": "2",
                                        "SLURM_LOCALID": str(r)},
                              cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        outputs.append(out.decode())
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    records = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*-*.json")]
    assert sorted(s["file"] for s in manifest["shards"]) == sorted(r["file"] for r in records)
    # Disjoint work: rank r wrote exactly the shards r, r+2, ... of the plan's order.
    plan_order = [s["file"] for s in manifest["shards"]]
    assert len(plan_order) > 2
    assert all(s["rank"] == i % 2 for i, s in enumerate(manifest["shards"]))
    # The rank that completed the store says so; summary.json exists.
    assert sum("on disk:" in out for out in outputs) == 1
    assert (tmp_path / "out" / "summary.json").is_file()


def test_a_batch_script_itself_is_one_process_not_rank_0_of_many():
    from mtptrain.dist import DistInfo

    assert DistInfo.from_env({"SLURM_NTASKS": "16", "SLURM_PROCID": "0"}).world_size == 1
    assert DistInfo.from_env({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}) == \
        DistInfo(rank=3, world_size=4, local_rank=1)
    assert DistInfo.from_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == DistInfo(1, 2, 1)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtptrain.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, **(env or {})})


def test_every_command_shows_the_library_info_lines(tmp_path, tiny_target_dir):
    """Logging is configured once, by the CLI: a command without a set-up of its own (regenerate) shows them too."""
    data = write_sharegpt(tmp_path / "c.json", 4)
    done = _cli("regenerate", "--no-progress", "--set", f"target.model={tiny_target_dir}",
                "--set", f"data.source={data}", "--set", f"data.regenerated={tmp_path / 'r.jsonl'}",
                "--set", "regenerate.max_new_tokens=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"INFO mtptrain.target.loading: target {tiny_target_dir.name}" in done.stderr
    assert "INFO mtptrain.data.regenerate: regenerate:" in done.stderr
    assert not any(" INFO " in line for line in done.stderr.splitlines() if "httpx" in line or "urllib3" in line)


@pytest.mark.real_model
def test_the_fallback_to_the_shipped_head_is_logged(tmp_path):
    done = _cli("export", "--set", f"train.output_dir={tmp_path / 'none'}",
                "--set", f"export.output_dir={tmp_path / 'export'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "INFO" in done.stderr and "using the shipped head" in done.stderr
    assert (tmp_path / "export" / "config.json").is_file()


def test_only_the_projects_own_errors_are_printed_without_a_traceback(monkeypatch):
    """An error of the input (a project error) is a message and exit code 1; any other exception is a bug and
    keeps its traceback."""
    import mtptrain.export.run as export_run
    from mtptrain.export.sidecar import ExportError

    def failing(exc):
        def run(_recipe):
            raise exc
        return run

    monkeypatch.setattr(export_run, "run_export", failing(ExportError("the head is not there")))
    result = runner.invoke(app, ["export"])
    assert result.exit_code == 1 and "error: the head is not there" in result.output
    assert not isinstance(result.exception, ExportError)  # turned into typer's exit
    monkeypatch.setattr(export_run, "run_export", failing(ValueError("a bug")))
    result = runner.invoke(app, ["export"])
    assert isinstance(result.exception, ValueError) and "error: a bug" not in result.output


def test_the_train_summary_names_the_engine_validation_and_the_exported_step():
    from mtptrain.cli import format_train_summary

    summary = {"steps": 12, "tokens_per_second": 2456.0, "data_wait_fraction": 0.01, "head": "run/head",
               "checkpoint": "run/checkpoints/step-0000012", "val/acc_1": 0.26, "val/acc_2": 0.21,
               "val/tau_chain": 1.5, "val/accept_chain_1": 0.4, "val/accept_chain_2": 0.1,
               "selected": {"step": 8, "tau_chain": 1.6}}
    text = format_train_summary(summary)
    assert "agreement per draft position: acc_1 0.260  acc_2 0.210\n" in text
    assert "chain tau 1.500, acceptance per position 0.400 0.100" in text and "tree tau" not in text
    assert "exported the head of step 8 (best validated chain tau 1.600)" in text
