"""scripts/learning_curve.py: a run's validations against the tokens seen, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "learning_curve.py"


def curve(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True)


def test_the_curve_has_one_row_per_validated_step_with_its_tokens(tmp_path):
    run = tmp_path / "train"
    rows = [
        {"step": 10, "train/loss": 3.0, "train/acc_1": 0.2},
        {"step": 20, "val/acc_1": 0.25, "val/acc_2": 0.125, "val/tau_chain": 1.5, "val/accept_chain_1": 0.4,
         "val/accept_chain_2": 0.1},  # logged before train/tokens_seen: its snapshot has the tokens
        {"step": 40, "val/acc_1": 0.3, "val/acc_2": 0.2, "val/tau_chain": 1.7, "val/accept_chain_1": 0.5,
         "val/accept_chain_2": 0.2, "val/tau_tree": 1.9, "train/tokens_seen": 9000},
        {"step": 40, "val/acc_1": 0.35, "val/acc_2": 0.25, "val/tau_chain": 1.75, "val/accept_chain_1": 0.5,
         "val/accept_chain_2": 0.25, "val/tau_tree": 2.0, "train/tokens_seen": 9000},  # logged again after a resume
    ]
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    snapshot = run / "snapshots" / "step-0000020"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"train": {"steps": 20, "tokens": 4321}}))

    done = curve(run, "--plot", tmp_path / "curve.png")
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert table == ["| 20 | 4,321 | 1.50 | 0.40 / 0.10 | – | 0.250 / 0.125 |",
                     "| 40 | 9,000 | 1.75 | 0.50 / 0.25 | 2.00 | 0.350 / 0.250 |"]
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_cut_line_and_a_missing_run_are_named(tmp_path):
    done = curve(tmp_path / "nowhere")
    assert done.returncode != 0 and "metrics.jsonl not found" in done.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "val/acc_1": 0.1}\n{"step": 10, "val/a')
    done = curve(tmp_path)
    assert done.returncode != 0 and "metrics.jsonl:2 is not JSON" in done.stderr and "delete it" in done.stderr
