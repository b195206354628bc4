import json
import re
import resource
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from mtptrain.config import (DEFAULT_HEAD_KIND, HEAD_CONFIGS, Recipe, RecipeError, _sections, dump_recipe, flat_head,
                             load_recipe)

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


def test_a_chain_stop_is_a_probability_below_1_and_given_once():
    assert load_recipe(None, ["eval.chain.stops=[0,0.3,0.3]"]).eval.chain.stops == [0.0, 0.3]
    for stops in ("[1.0]", "[-0.1]", "[]"):
        with pytest.raises(RecipeError, match="eval.chain.stops"):
            load_recipe(None, [f"eval.chain.stops={stops}"])


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


def _takes(annotation, kind) -> bool:
    return kind in (annotation, typing.get_origin(annotation)) or any(_takes(arg, kind)
                                                                      for arg in typing.get_args(annotation))


def _fields_taking(*kinds):
    """(dotted key, whether it takes a list, the --set items that choose the section holding it: a head section's
    kind) for every field that takes one of `kinds` or a list of them."""
    for path, model in _sections(Recipe, ()):
        chosen = [f"{'.'.join(path)}.kind={model.model_fields['kind'].default}"] if "kind" in model.model_fields else []
        for name, field in model.model_fields.items():
            if any(_takes(field.annotation, kind) for kind in kinds):
                yield ".".join([*path, name]), _takes(field.annotation, list), chosen


def _number_fields():
    """(dotted key, a boolean written where the field takes a number or a list of them, the --set items that
    choose the section holding it) for every such field."""
    for key, listed, chosen in _fields_taking(int, float):
        yield key, "[true]" if listed else "true", chosen


def test_a_boolean_is_not_a_number_in_any_field(tmp_path):
    fields = list(_number_fields())
    assert {"train.micro_batch_size", "precompute.layers", "eval.k", "train.lr", "slurm.eval.nodes"} <= \
        {key for key, _, _ in fields}
    assert {"head.ttt_steps", "head.mtp_depths", "head.feature_weight"} <= {key for key, _, _ in fields}
    for key, value, chosen in fields:
        item = f"{key}={value}"
        with pytest.raises(RecipeError, match=rf"  {re.escape(key)}\b\S*: .*\(from --set {re.escape(item)}\)"):
            load_recipe(None, [*chosen, item])
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  micro_batch_size: true\n")
    with pytest.raises(RecipeError, match=rf"{re.escape(str(path))}: invalid recipe\n  train.micro_batch_size: "):
        load_recipe(path)
    path.write_text("train:\n  micro_batch_size: 8\n  lr: 3e-4\n")
    recipe = load_recipe(path, ["train.grad_accum=2", "precompute.layers=[0, 3]"])
    assert (recipe.train.micro_batch_size, recipe.train.lr, recipe.train.grad_accum) == (8, 3e-4, 2)
    assert recipe.precompute.layers == [0, 3]


def test_no_float_field_takes_infinity_or_nan():
    """YAML reads .inf and .nan as floats, and nan passes every bound check (each comparison is false): an
    eval.temperature of infinity or nan would make every distribution nan."""
    fields = list(_fields_taking(float))
    assert {"eval.temperature", "train.lr", "eval.chain.draft_temperatures", "regenerate.temperature"} <= \
        {key for key, _, _ in fields}
    for key, listed, chosen in fields:
        for value in (".inf", "-.inf", ".nan"):
            item = f"{key}=[{value}]" if listed else f"{key}={value}"
            with pytest.raises(RecipeError, match=rf"  {re.escape(key)}\b\S*: .*\(from --set {re.escape(item)}\)"):
                load_recipe(None, [*chosen, item])


# A value other than the default for every head field, so that a test sees it kept.
HEAD_VALUES = {"norms": "stripped", "feature_weight": 0.5, "feature_layers": [1, 2], "ttt_steps": 5,
               "draft_vocab_size": 100, "fc_norm": True, "norm_output": True, "mtp_depths": 3, "mtp_share": True,
               "mtp_input": "raw", "step_weights": [1.0, 0.5]}


def _own_keys(kind: str) -> list[str]:
    return [key for key in HEAD_CONFIGS[kind].model_fields if key != "kind"]


def test_every_head_field_has_a_value_in_these_tests():
    assert set(HEAD_VALUES) == {key for kind in HEAD_CONFIGS for key in _own_keys(kind)}


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_each_head_family_takes_its_own_keys(kind, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"head": {"kind": kind, **{key: HEAD_VALUES[key] for key in _own_keys(kind)}}}))
    head = load_recipe(path).head
    assert isinstance(head, HEAD_CONFIGS[kind]) and head.kind == kind
    assert {key: getattr(head, key) for key in _own_keys(kind)} == {key: HEAD_VALUES[key] for key in _own_keys(kind)}


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_a_key_of_another_head_family_is_refused_with_the_family_and_the_fix(kind, tmp_path):
    foreign = {key for other in HEAD_CONFIGS for key in _own_keys(other)} - set(_own_keys(kind))
    assert foreign
    for key in sorted(foreign):
        owners = [other for other in HEAD_CONFIGS if key in HEAD_CONFIGS[other].model_fields]
        fix = f"set head.kind={owners[0]}" if len(owners) == 1 else f"set head.kind to {' or '.join(owners)}"
        item = f"head.{key}={json.dumps(HEAD_VALUES[key])}"
        with pytest.raises(RecipeError) as err:
            load_recipe(None, [f"head.kind={kind}", item])
        assert (f"unknown key 'head.{key}' (from --set {item}): a setting of {' and '.join(owners)} heads, and "
                f"head.kind is {kind}: remove it, or {fix}") in str(err.value)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"head": {"kind": kind, **{key: HEAD_VALUES[key] for key in foreign}}}))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}: invalid recipe")
    assert str(err.value).count(f"heads, and head.kind is {kind}: remove it") == len(foreign)


def test_a_misspelt_head_key_gets_a_did_you_mean(tmp_path):
    with pytest.raises(RecipeError, match=re.escape("unknown key 'head.ttt_step' (from --set head.ttt_step=2) "
                                                    "(did you mean 'head.ttt_steps'?)")):
        load_recipe(None, ["head.ttt_step=2"])
    with pytest.raises(RecipeError, match=re.escape("(did you mean 'head.mtp_depths'?)")):
        load_recipe(None, ["head.kind=mtp", "head.mtp_depth=2"])
    path = tmp_path / "r.yaml"
    path.write_text("head:\n  kind: eagle\n  feature_wieght: 0.2\n")
    with pytest.raises(RecipeError, match=re.escape("unknown key 'head.feature_wieght' (did you mean "
                                                    "'head.feature_weight'?)")):
        load_recipe(path)
    with pytest.raises(RecipeError, match=re.escape("unknown key 'head.mtp_depth' (from --set head.mtp_depth=2) (did "
                                                    "you mean 'head.mtp_depths'? a setting of mtp heads, and "
                                                    "head.kind is eagle3)")):
        load_recipe(None, ["head.mtp_depth=2"])
    with pytest.raises(RecipeError, match=re.escape("unknown key 'ttt_steps' (from --set ttt_steps=2) (did you mean "
                                                    "'head.ttt_steps'?)")):
        load_recipe(None, ["ttt_steps=2"])


def test_set_overrides_switch_the_head_kind(tmp_path):
    assert type(load_recipe(None).head) is HEAD_CONFIGS[DEFAULT_HEAD_KIND]
    for items in (["head.kind=mtp", "head.mtp_depths=3"], ["head.mtp_depths=3", "head.kind=mtp"]):
        head = load_recipe(None, items).head
        assert (head.kind, head.mtp_depths, head.norms) == ("mtp", 3, "restored")
    shared = tmp_path / "shared.yaml"
    shared.write_text("head:\n  kind: eagle3\n  step_weights: [1, 1]\n")
    head = load_recipe(shared, ["head.kind=mtp"]).head
    assert (head.kind, head.step_weights, head.mtp_depths) == ("mtp", [1.0, 1.0], 2)
    assert load_recipe(shared, ["head.kind=eagle", "head.feature_weight=0.3"]).head.feature_weight == 0.3
    quickstart = next(p for p in RECIPES if p.name == "quickstart.yaml")
    with pytest.raises(RecipeError) as err:
        load_recipe(quickstart, ["head.kind=mtp"])
    assert (f"{quickstart}: invalid recipe\n  unknown key 'head.ttt_steps': a setting of eagle3 heads, and "
            "head.kind is mtp (from --set head.kind=mtp): remove it, or set head.kind=eagle3; --set 'head={kind: "
            "mtp}' replaces the recipe's head section") in str(err.value)
    head = load_recipe(quickstart, ["head={kind: mtp}", "head.mtp_depths=3"]).head
    assert (head.kind, head.mtp_depths) == ("mtp", 3)
    with pytest.raises(RecipeError, match=re.escape("head.kind: Input should be 'eagle', 'eagle3' or 'mtp' (got "
                                                    "'dflash') (from --set head.kind=dflash)")):
        load_recipe(None, ["head.kind=dflash"])


# A resolved recipe's head section as written before each family had a section of its own: every field of every
# family, the other families' at their defaults.
FLAT_HEAD = {"kind": "eagle3", "norms": "restored", "feature_layers": "auto", "ttt_steps": 3,
             "draft_vocab_size": 8192, "fc_norm": False, "norm_output": False, "mtp_depths": 2, "mtp_share": False,
             "mtp_input": "normed", "step_weights": "auto", "feature_weight": 0.1}


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_a_resolved_recipe_with_a_flat_head_section_reads_back(kind, tmp_path):
    own = {key: HEAD_VALUES[key] for key in _own_keys(kind)}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"name": "old", "head": {**FLAT_HEAD, "kind": kind, **own}}, sort_keys=False))
    head = load_recipe(path).head
    assert type(head) is HEAD_CONFIGS[kind] and head.model_dump(mode="json") == {"kind": kind, **own}
    assert flat_head(head) == {**FLAT_HEAD, "kind": kind, **own}
    other = next(key for key in FLAT_HEAD if key not in own and key != "kind")
    path.write_text(yaml.safe_dump({"head": {**FLAT_HEAD, "kind": kind, **own, other: HEAD_VALUES[other]}}))
    with pytest.raises(RecipeError, match=rf"unknown key 'head.{other}': a setting of "):
        load_recipe(path)  # a value the flat layout never wrote for another family
