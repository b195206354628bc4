"""`regenerate.engine: vllm`: the same output file, resume, masks and truncation rules as the runtime's, decoded by
vLLM's continuous batching (its CPU build, from scripts/setup_vllm.sh, which the fixture runs). A tiny random
Llama, saved as a local model directory, is the target (tests/conftest.py's served_target_dir): vLLM loads it as
it would any checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtptrain.config import load_recipe
from mtptrain.data.engines import pick_engine
from mtptrain.data.regenerate import run_regenerate
from mtptrain.data.resumable import RegenerateError, state_path

from conftest import environment, kill_after_first_group, recipe_file, write_sharegpt

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vllm_env() -> None:
    environment("scripts/setup_vllm.sh")


def overrides(target_dir: Path, source: Path, out: Path, *extra: str) -> list[str]:
    # float32 on both sides: the runtime's and vLLM's greedy answers then agree but for float near-ties
    return [f"target.model={target_dir}", "target.dtype=float32", "vllm.dtype=float32", f"data.source={source}",
            "data.max_length=128", "data.validation_fraction=0.2", f"data.regenerated={out}",
            "regenerate.max_new_tokens=24", "regenerate.batch_size=3", *extra]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_vllm_regenerates_the_file_the_runtime_writes(vllm_env, served_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 12)
    ours = run_regenerate(load_recipe(None, overrides(served_target_dir, source, tmp_path / "runtime.jsonl",
                                                      "regenerate.engine=runtime")), show_progress=False)
    recipe = load_recipe(None, overrides(served_target_dir, source, tmp_path / "vllm.jsonl", "regenerate.engine=vllm"))
    theirs = run_regenerate(recipe, show_progress=False)
    a, b = rows(tmp_path / "runtime.jsonl"), rows(tmp_path / "vllm.jsonl")
    assert [r["id"] for r in a] == [r["id"] for r in b] and theirs["conversations"] == ours["conversations"] > 0
    for x, y in zip(a, b):  # the questions, system prompts and turn order are the conversation's, whoever answers
        assert [m for m in x["messages"] if m["role"] != "assistant"] == [m for m in y["messages"]
                                                                           if m["role"] != "assistant"]
    same = sum(x == y for x, y in zip(a, b))
    assert same >= 0.8 * len(a), f"{same}/{len(a)} conversations identical"
    for r in b:  # the truncation rules: no answer over its budget; an answer cut short ends its conversation
        new, finished = r["meta"]["new_tokens"], r["meta"]["finished"]
        assert all(n <= 24 for n in new) and len(new) == len(finished)
        assert all(done for done in finished[:-1])
    state = json.loads(state_path(tmp_path / "vllm.jsonl").read_text())
    assert state["complete"] and state["settings"]["engine"] == "vllm"
    assert (tmp_path / "vllm.jsonl.vllm-0.log").is_file()
    # the runtime's file is not continued by vLLM (other kernels, other sampling streams)
    mixed = load_recipe(None, overrides(served_target_dir, source, tmp_path / "runtime.jsonl", "regenerate.engine=vllm",
                                        "regenerate.max_new_tokens=20"))
    with pytest.raises(RegenerateError, match="engine"):
        run_regenerate(mixed, show_progress=False)


def test_auto_picks_the_runtime_on_a_cpu_and_vllm_on_a_gpu_where_it_is_installed(tmp_path, monkeypatch):
    from mtptrain.data import engines

    monkeypatch.setattr(engines, "on_gpu", lambda: False)
    assert pick_engine(load_recipe(None, ["regenerate.engine=auto"])) == "runtime"
    assert pick_engine(load_recipe(None, ["regenerate.engine=vllm"])) == "vllm"
    monkeypatch.setattr(engines, "on_gpu", lambda: True)
    missing = load_recipe(None, ["regenerate.engine=auto", f"vllm.python={tmp_path / 'none'}"])
    assert pick_engine(missing) == "runtime"
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert pick_engine(load_recipe(None, ["regenerate.engine=auto", f"vllm.python={python}"])) == "vllm"


def test_a_killed_vllm_regeneration_resumes_to_the_same_file(vllm_env, served_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 48)  # 2 groups of 8 batches of 3
    recipe_path = recipe_file(overrides(served_target_dir, source, tmp_path / "clean.jsonl", "regenerate.engine=vllm",
                                        "regenerate.temperature=1.0"), tmp_path / "recipe.yaml")

    def cli(out: Path) -> list[str]:
        return [sys.executable, "-m", "mtptrain.cli", "regenerate", "--recipe", str(recipe_path), "--no-progress",
                "--set", f"data.regenerated={out}"]

    subprocess.run(cli(tmp_path / "clean.jsonl"), cwd=ROOT, check=True, capture_output=True)
    killed = tmp_path / "killed.jsonl"
    state = kill_after_first_group(cli(killed), killed, ROOT, timeout=300)
    assert not state["complete"] and state["groups_done"] == 1
    result = subprocess.run(cli(killed), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert killed.read_bytes() == (tmp_path / "clean.jsonl").read_bytes()
