import pytest

from mtptrain.eval.prompts import PromptSetError, load_prompts


def test_mtbench_has_80_two_turn_questions_in_8_categories():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    assert all(len(p.turns) == 2 for p in prompts)
    assert len({p.category for p in prompts}) == 8
    assert prompts[0].id == "81" and prompts[0].category == "writing"
    assert len(load_prompts("mtbench", limit=5)) == 5


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
