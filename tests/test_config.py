import re
import resource
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from mtptrain.config import Recipe, RecipeError, _sections, dump_recipe, load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


def _leaves(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates_and_keeps_every_value_it_writes(path):
    """Validation must not coerce or drop what a recipe says (a layer list turned into a string, a float
    rounded into an int): every value written in the file is the resolved recipe's."""
    resolved = load_recipe(path).model_dump(mode="json")
    for keys, value in _leaves(yaml.safe_load(path.read_text())):
        held = resolved
        for key in keys:
            held = held[key]
        assert held == value, f"{path.name}: {'.'.join(keys)} is {value!r} in the file, {held!r} once resolved"


def test_every_recipe_the_makefile_and_readme_name_is_shipped():
    repo = Path(__file__).resolve().parents[1]
    named = set(re.findall(r"recipes/([\w.-]+\.yaml)", (repo / "Makefile").read_text() + (repo / "README.md").read_text()))
    assert {"quickstart.yaml", "reference.yaml"} <= named
    assert named <= {p.name for p in RECIPES}, named - {p.name for p in RECIPES}


def test_unknown_key_names_it_and_suggests_the_closest(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  max_lenght: 10\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "unknown key 'data.max_lenght'" in str(err.value)
    assert "did you mean 'data.max_length'" in str(err.value)


def test_unknown_section_is_an_error():
    with pytest.raises(RecipeError, match="unknown key 'precomptue'.*did you mean 'precompute'"):
        load_recipe(None, ["precomptue.dtype=float16"])


def test_overrides_are_parsed_as_yaml_and_revalidated(tmp_path):
    recipe = load_recipe(None, ["data.max_length=77", "precompute.layers=[0, 3]", "target.trust_remote_code=true"])
    assert recipe.data.max_length == 77
    assert recipe.precompute.layers == [0, 3]
    assert recipe.target.trust_remote_code is True
    with pytest.raises(RecipeError, match="data.max_length"):
        load_recipe(None, ["data.max_length=not-a-number"])
    with pytest.raises(RecipeError, match="precompute.dtype"):
        load_recipe(None, ["precompute.dtype=int8"])
    with pytest.raises(RecipeError, match="must look like"):
        load_recipe(None, ["data.max_length"])


def test_later_override_wins_over_recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  max_length: 10\n")
    assert load_recipe(path, ["data.max_length=20"]).data.max_length == 20


def test_resolved_recipe_roundtrips(tmp_path):
    recipe = load_recipe(None, ["name=x", "data.seed=5"])
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    written = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert written["precompute"]["dtype"] == "bfloat16"  # defaults are spelled out
    assert load_recipe(tmp_path / "recipe.yaml") == recipe


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_zero_stage_3_is_refused_with_the_reason():
    assert load_recipe(None, ["train.zero_stage=2"]).train.zero_stage == 2
    with pytest.raises(RecipeError, match="stage 3 partitions the parameters"):
        load_recipe(None, ["train.zero_stage=3"])


def test_an_error_in_a_set_override_is_blamed_on_the_override_not_the_recipe_file():
    quickstart = next(p for p in RECIPES if p.name == "quickstart.yaml")
    with pytest.raises(RecipeError) as err:
        load_recipe(quickstart, ["train.epoch=3"])
    message = str(err.value)
    assert "--set train.epoch=3" in message and "unknown key 'train.epoch'" in message
    assert "did you mean 'train.epochs'" in message
    assert f"{quickstart}: invalid recipe" not in message
    with pytest.raises(RecipeError) as err:
        load_recipe(quickstart, ["data.max_length=lots"])
    assert "--set data.max_length=lots" in str(err.value)


def test_an_error_in_the_recipe_file_is_still_blamed_on_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["data.max_length=20"])
    assert f"{path}: invalid recipe" in str(err.value) and "--set" not in str(err.value)


def test_eval_method_settings_are_nested_sections_set_by_their_dotted_path():
    recipe = load_recipe(None, ["eval.tree.budgets=[16,4,8,4]", "eval.tree.depth=3", "eval.tree.branch=2",
                                "eval.ngram.min=2", "eval.ngram.max=4", "eval.draft.layers=6",
                                "eval.ssd.budget=16", "eval.ssd.factor=0.5", "eval.ssd.fallback=ngram",
                                "eval.ssd.threads=2", "eval.ssd.device=cuda:1"])
    ev = recipe.eval
    assert ev.tree.budgets == [4, 8, 16]  # sorted, each budget once
    assert (ev.tree.depth, ev.tree.branch, ev.ngram.min, ev.ngram.max) == (3, 2, 2, 4)
    assert (ev.draft.model, ev.draft.layers) == (None, 6)
    assert (ev.ssd.budget, ev.ssd.factor, ev.ssd.fallback, ev.ssd.threads, ev.ssd.device) == (16, 0.5, "ngram", 2,
                                                                                              "cuda:1")
    with pytest.raises(RecipeError, match="eval.tree.budgets"):
        load_recipe(None, ["eval.tree.budgets=[0]"])


@pytest.mark.parametrize("flat, nested", [("eval.tree_budgets=[4]", "eval.tree.budgets"),
                                          ("eval.ngram_min=2", "eval.ngram.min"),
                                          ("eval.draft_layers=2", "eval.draft.layers"),
                                          ("eval.ssd_budget=4", "eval.ssd.budget")])
def test_an_old_flat_eval_key_is_refused_with_its_nested_path(flat, nested):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [flat])
    key = flat.split("=")[0]
    assert f"unknown key '{key}' (from --set {flat}) (did you mean '{nested}'?)" in str(err.value)


def test_ngram_min_above_max_is_refused_when_the_recipe_is_validated():
    assert load_recipe(None, ["eval.ngram.min=3", "eval.ngram.max=3"]).eval.ngram.min == 3
    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["eval.ngram.min=4", "eval.ngram.max=3"])
    assert "eval.ngram:" in str(err.value) and "min (4) is above max (3)" in str(err.value)


def test_one_tracking_section_holds_the_wandb_settings_of_every_stage():
    recipe = load_recipe(None, ["tracking.wandb=offline", "tracking.project=p", "tracking.group=g"])
    assert (recipe.tracking.wandb, recipe.tracking.project, recipe.tracking.group) == ("offline", "p", "g")
    for stage in ("precompute", "train", "eval"):
        with pytest.raises(RecipeError, match=rf"unknown key '{stage}.wandb'.*did you mean 'tracking.wandb'"):
            load_recipe(None, [f"{stage}.wandb=offline"])
        with pytest.raises(RecipeError, match=rf"unknown key '{stage}.wandb_project'.*did you mean 'tracking.project'"):
            load_recipe(None, [f"{stage}.wandb_project=p"])
    with pytest.raises(RecipeError, match=r"unknown key 'wandb_group'.*did you mean 'tracking.group'"):
        load_recipe(None, ["wandb_group=g"])


# Billion laughs: nine lines of nested aliases stand for 9^9 (387 million) strings.
ALIAS_BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    """Run in a process of its own, bounded in memory and time: expanding the aliases took 9 GB."""
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB + "data:\n  source: *i\n")
    result = subprocess.run([sys.executable, "-m", "mtptrain.cli", "recipe", "-r", str(path)], capture_output=True,
                            text=True, timeout=30, preexec_fn=_limit_memory)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"error: recipe {path}, line 2: YAML aliases"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_an_alias_in_a_set_value_is_refused():
    with pytest.raises(RecipeError, match=r"override 'data.source=\[&a \[1, 2\], \*a\]': YAML aliases"):
        load_recipe(None, ["data.source=[&a [1, 2], *a]"])


def _number_fields():
    """(dotted key, a boolean written where the field takes a number or a list of them) for every such field."""
    def takes(annotation, kind) -> bool:
        return kind in (annotation, typing.get_origin(annotation)) or any(takes(arg, kind)
                                                                          for arg in typing.get_args(annotation))

    for path, model in _sections(Recipe, ()):
        for name, field in model.model_fields.items():
            if takes(field.annotation, int) or takes(field.annotation, float):
                listed = takes(field.annotation, list)
                yield ".".join([*path, name]), "[true]" if listed else "true"


def test_a_boolean_is_not_a_number_in_any_field(tmp_path):
    fields = dict(_number_fields())
    assert {"train.micro_batch_size", "precompute.layers", "eval.k", "train.lr", "slurm.eval.nodes"} <= set(fields)
    for key, value in fields.items():
        item = f"{key}={value}"
        with pytest.raises(RecipeError, match=rf"  {re.escape(key)}\b\S*: .*\(from --set {re.escape(item)}\)"):
            load_recipe(None, [item])
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  micro_batch_size: true\n")
    with pytest.raises(RecipeError, match=rf"{re.escape(str(path))}: invalid recipe\n  train.micro_batch_size: "):
        load_recipe(path)
    path.write_text("train:\n  micro_batch_size: 8\n  lr: 3e-4\n")
    recipe = load_recipe(path, ["train.grad_accum=2", "precompute.layers=[0, 3]"])
    assert (recipe.train.micro_batch_size, recipe.train.lr, recipe.train.grad_accum) == (8, 3e-4, 2)
    assert recipe.precompute.layers == [0, 3]
