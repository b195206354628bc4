"""`mtptrain self-prompts`: requests the target writes itself, kept by the filters, resumable, and a data source
that `mtptrain regenerate` answers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_after_first_group, recipe_file
from test_regenerate import settle_machine_choice

from mtptrain.config import load_recipe
from mtptrain.data.chat import render
from mtptrain.data.regenerate import run_regenerate
from mtptrain.data.resumable import RegenerateError, state_path
from mtptrain.data.self_prompts import normal_form, request_prefix, run_self_prompts
from mtptrain.target import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def overrides(target_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"target.model={target_dir}", f"self_prompts.output={out}", "self_prompts.count=24",
            "self_prompts.batch_size=2", "self_prompts.max_new_tokens=160", "self_prompts.min_chars=4", *extra]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_prefix_is_the_template_up_to_the_users_words(tiny_target_dir):
    tok = load_tokenizer(load_recipe(None, [f"target.model={tiny_target_dir}"]).target)
    prefix = tok.decode(request_prefix(tok))
    assert render(tok, [{"role": "user", "content": "hello there"}]).startswith(prefix + "hello there")
    assert prefix.endswith("user\n")


def test_sampled_requests_are_filtered_kept_once_and_answered_by_regenerate(varied_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    summary = run_self_prompts(load_recipe(None, overrides(varied_target_dir, out)), show_progress=False)
    kept = rows(out)
    assert summary["sampled"] == 24 and summary["kept"] == len(kept) > 0
    assert summary["kept"] + sum(summary["dropped"].values()) == 24
    assert set(summary["dropped"]) <= {"cut by max_new_tokens", "shorter than min_chars", "a repeat"}
    assert all(r["id"].startswith("self-") and [m["role"] for m in r["messages"]] == ["user"] for r in kept)
    texts = [normal_form(r["messages"][0]["content"]) for r in kept]
    assert len(set(texts)) == len(texts) and all(len(t) >= 4 for t in texts)
    # the file is a data source: regenerate answers every request in it
    answered = tmp_path / "answered.jsonl"
    regen = load_recipe(None, [f"target.model={varied_target_dir}", f"data.source={out}", "data.max_length=256",
                               f"data.regenerated={answered}", "regenerate.max_new_tokens=16",
                               "regenerate.batch_size=3", "regenerate.min_answer_tokens=1"])
    result = run_regenerate(regen, show_progress=False)
    assert result["conversations"] + sum(result["skipped"].values()) == len(kept)
    asked = {r["id"]: r["messages"][0]["content"] for r in kept}
    assert rows(answered) and all(asked[r["id"]] == r["messages"][0]["content"] and
                                  [m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows(answered))
    # a second run over the finished file does nothing and changes nothing
    before = out.read_bytes()
    assert run_self_prompts(load_recipe(None, overrides(varied_target_dir, out)), show_progress=False)[
        "tokens_this_run"] == 0
    assert out.read_bytes() == before


def test_a_run_with_other_settings_is_refused_and_the_file_kept(varied_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    run_self_prompts(load_recipe(None, overrides(varied_target_dir, out)), show_progress=False)
    before = out.read_bytes()
    with pytest.raises(RegenerateError, match=r"temperature: 1\.0 -> 0\.7.*self_prompts\.output"):
        run_self_prompts(load_recipe(None, overrides(varied_target_dir, out, "self_prompts.temperature=0.7")),
                         show_progress=False)
    assert out.read_bytes() == before


def test_a_file_not_written_by_self_prompts_is_refused(tiny_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    out.write_text('{"id": "mine", "messages": [{"role": "user", "content": "keep me"}]}\n')
    with pytest.raises(RegenerateError, match="has no prompts.jsonl.state.json"):
        run_self_prompts(load_recipe(None, overrides(tiny_target_dir, out)), show_progress=False)
    assert "keep me" in out.read_text()


def test_a_killed_run_resumes_to_the_same_file(varied_target_dir, tmp_path, monkeypatch):
    settle_machine_choice(varied_target_dir, monkeypatch)
    recipe_path = recipe_file(overrides(varied_target_dir, tmp_path / "clean.jsonl", "self_prompts.count=48"),
                              tmp_path / "recipe.yaml")  # 3 groups of 8 batches of 2

    def cli(out: Path) -> list[str]:
        return [sys.executable, "-m", "mtptrain.cli", "self-prompts", "--recipe", str(recipe_path), "--no-progress",
                "--set", f"self_prompts.output={out}"]

    subprocess.run(cli(tmp_path / "clean.jsonl"), cwd=REPO, check=True, capture_output=True)
    clean = (tmp_path / "clean.jsonl").read_bytes()
    killed = tmp_path / "killed.jsonl"
    state = kill_after_first_group(cli(killed), killed, REPO)
    assert not state["complete"] and 1 <= state["groups_done"] < 3
    with open(killed, "ab") as fh:  # a kill mid-append: a torn line after the recorded bytes
        fh.write(b'{"id": "torn", "mess')
    result = subprocess.run(cli(killed), cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "kept" in result.stdout and "a data.source for `mtptrain regenerate`" in result.stdout
    assert killed.read_bytes() == clean
    assert json.loads(state_path(killed).read_text())["complete"]


def test_a_hostile_or_foreign_state_is_refused_naming_the_file_and_the_fix(varied_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    recipe = load_recipe(None, overrides(varied_target_dir, out, "self_prompts.count=4"))
    run_self_prompts(recipe, show_progress=False)
    state = json.loads(state_path(out).read_text())
    for broken, message in [("[1, 2]", "is not a state mtptrain wrote"), ("{not json", "is not valid JSON"),
                            (json.dumps({**state, "groups_done": "0"}), "is not a state mtptrain wrote"),
                            (json.dumps({**state, "target": "x"}), "is not a state mtptrain wrote"),
                            (json.dumps({**state, "counts": {**state["counts"], "kept": True}}),
                             "is not a state mtptrain wrote")]:
        state_path(out).write_text(broken)
        with pytest.raises(RegenerateError, match=f"prompts.jsonl.state.json.*{message}|{message}.*delete it"):
            run_self_prompts(recipe, show_progress=False)
    # an unfinished file begun in the other dtype is refused where target.dtype pins this run to another
    other = "float32" if state["runtime"]["dtype"] == "bfloat16" else "bfloat16"
    begun = {**state["runtime"], "dtype": other}
    state_path(out).write_text(json.dumps({**state, "complete": False, "runtime": begun}))
    pinned = load_recipe(None, overrides(varied_target_dir, out, "self_prompts.count=4",
                                         f"target.dtype={state['runtime']['dtype']}"))
    with pytest.raises(RegenerateError, match=f"begun in {other}.*or set self_prompts.output to a new path"):
        run_self_prompts(pinned, show_progress=False)


def test_a_kept_request_edited_outside_mtptrain_is_refused_with_its_line(varied_target_dir, tmp_path):
    out = tmp_path / "prompts.jsonl"
    recipe = load_recipe(None, overrides(varied_target_dir, out, "self_prompts.count=40"))
    run_self_prompts(recipe, show_progress=False)
    state = json.loads(state_path(out).read_text())
    assert state["counts"]["kept"] >= 2
    lines = out.read_bytes().splitlines(keepends=True)
    edited = lines[0] + b"[" + b" " * (len(lines[1]) - 2) + b"\n" + b"".join(lines[2:])  # same length
    out.write_bytes(edited)
    state_path(out).write_text(json.dumps({**state, "complete": False}))
    with pytest.raises(RegenerateError, match="prompts.jsonl:2 is not a request self-prompts wrote"):
        run_self_prompts(recipe, show_progress=False)
