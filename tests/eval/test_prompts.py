import json
import re
from types import SimpleNamespace

import pytest
from conftest import WORDS, make_tokenizer
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.config import RecipeError
from mtptrain.eval.prompts import PromptSetError, check_lengths, load_prompts, token_limit


def test_mtbench_has_80_two_turn_questions_in_8_categories():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    assert all(len(p.turns) == 2 for p in prompts)
    assert len({p.category for p in prompts}) == 8
    assert prompts[0].id == "81" and prompts[0].category == "writing"
    assert len(load_prompts("mtbench", limit=5)) == 5


def test_the_unseen_prompt_set_mirrors_mtbench_categories_without_its_questions():
    """benchmarks/prompts/unseen-40.jsonl, the check that a head's MT-bench tau is no artefact of those 80
    questions: two turns each, five per MT-bench category, and not one turn that MT-bench asks."""
    from collections import Counter
    from pathlib import Path

    unseen = load_prompts(str(Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "unseen-40.jsonl"))
    mtbench = load_prompts("mtbench")
    assert len(unseen) == 40 and all(len(p.turns) == 2 for p in unseen)
    assert Counter(p.category for p in unseen) == {c: 5 for c in {p.category for p in mtbench}}
    asked = {" ".join(t.lower().split()) for p in mtbench for t in p.turns}
    assert not [t for p in unseen for t in p.turns if " ".join(t.lower().split()) in asked]


def test_jsonl_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"id": "x", "turns": ["a", "b"]}\n')
    prompts = load_prompts(str(path))
    assert [(p.id, p.turns) for p in prompts] == [("1", ["hello"]), ("x", ["a", "b"])]
    path.write_text('{"prompt": "hello"}\n{"turns": []}\n')
    with pytest.raises(PromptSetError, match="p.jsonl:2"):
        load_prompts(str(path))
    with pytest.raises(PromptSetError, match="does not exist"):
        load_prompts(str(tmp_path / "none.jsonl"))


def test_two_prompts_with_one_id_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(PromptSetError, match=r"p.jsonl:3: id 'a' already used on line 1"):
        load_prompts(str(path))


def test_an_empty_prompt_file_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    for text in ("", "\n  \n\n"):
        path.write_text(text)
        with pytest.raises(PromptSetError, match=rf"prompt file {re.escape(str(path))} holds no prompts"):
            load_prompts(str(path))


def test_an_empty_prompt_file_stops_eval_with_an_error_not_a_table_of_zeros(tiny_target_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("")
    result = run_eval_command(tiny_target_dir, path, tmp_path / "eval")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: prompt file {path} holds no prompts" in result.output and "best per method" not in result.output


def test_a_prompt_file_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "hello"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptSetError, match=rf"{re.escape(str(path))}:2: not UTF-8 \(byte 16 of the line"):
        load_prompts(str(path))


def words(count: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(count))


def run_eval_command(target_dir, prompts, out):
    """Nothing this machine would measure first (dtype, runtime kernels, products): under load it is not cached."""
    settings = [f"target.model={target_dir}", "target.dtype=float32", "target.runtime=transformers",
                "eval.cpu_matmul=stock", f"eval.prompts={prompts}", f"eval.output_dir={out}", "eval.methods=[ngram]",
                "eval.k=[2]", "eval.max_new_tokens=4", "eval.repeats=1"]
    args = [a for s in settings for a in ("--set", s)]
    return CliRunner().invoke(app, ["eval", "--no-progress", "--no-wandb", *args])


def test_a_prompt_longer_than_the_targets_context_is_refused_before_anything_is_measured(tiny_target_dir, tmp_path,
                                                                                        longest_text):
    """The tiny target holds 1024 positions, 4 of them kept for the answer; the prompt on line 2 alone is
    over, and it is cut before it is tokenized."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"id": "long", "prompt": words(8000)}) + "\n")
    result = run_eval_command(tiny_target_dir, path, tmp_path / "eval")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: {path}:2: prompt 'long', turn 1: more than 1020 tokens" in result.output
    assert not (tmp_path / "eval" / "results.json").exists()
    assert longest_text() < 0.6 * len(words(8000))


def test_a_later_turn_that_overflows_with_the_answers_before_it_is_refused(tiny_target_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "q", "turns": [words(300), words(300)]}) + "\n")
    result = run_eval_command(tiny_target_dir, path, tmp_path / "eval")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: {path}:1: prompt 'q', turn 2: more than 1020 tokens" in result.output


def test_a_5mb_prompt_is_refused_without_tokenizing_it(tmp_path, longest_text):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "huge", "prompt": "x" * 5_000_000}) + "\n")
    with pytest.raises(PromptSetError, match=rf"{re.escape(str(path))}:1: prompt 'huge', turn 1: more than 100 "):
        check_lengths(load_prompts(str(path)), make_tokenizer(), 100)
    assert longest_text() < 20_000


def test_answers_longer_than_the_targets_context_are_refused():
    with pytest.raises(RecipeError, match="eval.max_new_tokens 1024 leaves no room for a prompt in the target's "
                                          "context of 1024 tokens"):
        token_limit(SimpleNamespace(max_position_embeddings=1024), 1024, default=2048)
    assert token_limit(SimpleNamespace(max_position_embeddings=1024), 4, default=2048) == 1020
    assert token_limit(SimpleNamespace(), 4, default=2048) == 2044
