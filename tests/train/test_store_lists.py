"""train.features as a list: several stores trained on as one, and the mixes that must be refused."""

import json
import random
import shutil

import pytest
from conftest import random_conversation, tiny_recipe
from train_helpers import train_recipe

import mtptrain.train.trainer as trainer_module
from mtptrain.config import RecipeError, load_recipe
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore, FeatureStoreError
from mtptrain.features.stores import open_stores
from mtptrain.train.data import epoch_batches
from mtptrain.train.trainer import run_train


def _store(target_dir, tmp_path, name: str, ids: list[str], layers: str = "[0, 1, 2]", dtype: str = "bfloat16"):
    """A store of the tiny target over conversations with these ids."""
    rng = random.Random(len(name))
    rows = [{"id": i, "conversations": random_conversation(rng, rng.randint(1, 3))} for i in ids]
    data = tmp_path / f"{name}.json"
    data.write_text(json.dumps(rows))
    run_precompute(tiny_recipe(target_dir, data, tmp_path / name, layers=layers, dtype=dtype), show_progress=False)
    return tmp_path / name


@pytest.fixture()
def second_store(tiny_target_dir, tmp_path):
    return _store(tiny_target_dir, tmp_path, "second", [f"second-{i}" for i in range(30)])


def test_two_stores_train_as_one_and_the_head_records_both(tiny_target_dir, tiny_store, second_store, tmp_path,
                                                            monkeypatch):
    seen = {}
    original_init = trainer_module.Trainer.__init__

    def keep(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["trainer"] = self

    monkeypatch.setattr(trainer_module.Trainer, "__init__", keep)
    stores = [str(tiny_store), str(second_store)]
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle3", "train.max_steps=2",
                          f"train.features={json.dumps(stores)}", "train.engine_eval.prompts=2",
                          "train.engine_eval.max_new_tokens=4", "train.eval_every=2")
    run_train(recipe, show_progress=False)
    trainer = seen["trainer"]
    each = [FeatureStore(s, "train", verify="size") for s in stores]
    assert len(trainer.train_store) == sum(map(len, each)) and trainer.train_store.keys == each[0].keys + each[1].keys
    # an epoch plans every sample of both, shuffled together: micro-batches mix the stores
    epoch = epoch_batches(trainer.train_store.lengths(), 4, 0, 0)
    assert sorted(i for batch in epoch for i in batch) == list(range(len(trainer.train_store)))
    assert any(min(batch) < len(each[0]) <= max(batch) for batch in epoch)
    # the drafting validation takes its prompts from both stores in turn
    val = [FeatureStore(s, "validation", verify="size") for s in stores]
    assert trainer.prompts[:2] == [val[0].prompt_ids(0), val[1].prompt_ids(0)]
    # a sample reads the same through the list as through its own store (the bfloat16 store's included)
    last = trainer.train_store[len(each[0]) + len(each[1]) - 1]
    alone = each[1][len(each[1]) - 1]
    assert last["key"] == alone["key"] and all((last["hidden"][k] == alone["hidden"][k]).all() for k in alone["hidden"])
    config = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert config["features"]["store"] == stores
    assert "val/acc_1" in json.loads((tmp_path / "run" / "summary.json").read_text())


def test_the_order_and_the_set_of_stores_belong_to_the_runs_fingerprint(tiny_target_dir, tiny_store, second_store,
                                                                        tmp_path):
    from mtptrain.features.stores import combined_manifest, store_dirs

    def fingerprint(features):
        recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "r", f"train.features={json.dumps(features)}")
        return trainer_module.run_fingerprint(recipe, combined_manifest(store_dirs(recipe.train.features)), 1)

    one, both = fingerprint([str(tiny_store)]), fingerprint([str(tiny_store), str(second_store)])
    # one store in a list is that store, with the fingerprint its checkpoints already recorded
    assert one == fingerprint(str(tiny_store))
    assert len({one, both, fingerprint([str(second_store), str(tiny_store)])}) == 3


def test_a_store_listed_twice_is_refused(tiny_target_dir, tiny_store, tmp_path):
    with pytest.raises(RecipeError, match="listed more than once"):
        load_recipe(None, [f"train.features={json.dumps([str(tiny_store), str(tiny_store)])}"])
    with pytest.raises(RecipeError, match="empty list"):
        load_recipe(None, ["train.features=[]"])
    copy = tmp_path / "copy"  # the same store under another name
    shutil.copytree(tiny_store, copy)
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run",
                          f"train.features={json.dumps([str(tiny_store), str(copy)])}")
    with pytest.raises(FeatureStoreError, match="copy/manifest.json: the same store as .* listed twice"):
        run_train(recipe, show_progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_stores_of_another_model_or_other_layers_are_refused(tiny_target_dir, other_target_dir, tiny_store, tmp_path):
    other = _store(other_target_dir, tmp_path, "other-model", [f"o-{i}" for i in range(12)])
    layers = _store(tiny_target_dir, tmp_path, "other-layers", [f"l-{i}" for i in range(12)], layers="[0, 2]")
    for store, message in ((other, "other-model/manifest.json: target fingerprint .* different models"),
                           (layers, r"other-layers/manifest.json: layers \[0, 2, 3\], but .* has \[0, 1, 2, 3\]")):
        recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run",
                              f"train.features={json.dumps([str(tiny_store), str(store)])}")
        with pytest.raises(FeatureStoreError, match=message):
            run_train(recipe, show_progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_stores_sharing_samples_are_refused(tiny_target_dir, tmp_path):
    first = _store(tiny_target_dir, tmp_path, "first", [f"s-{i}" for i in range(20)])
    overlapping = _store(tiny_target_dir, tmp_path, "overlap", [f"s-{i}" for i in range(15, 40)])
    with pytest.raises(FeatureStoreError, match=r"overlap/manifest.json: sample 's-1[5-9]\S*' is also in"):
        open_stores([str(first), str(overlapping)], "train", verify="size")


def test_speculators_data_takes_one_store_and_says_so(tiny_store, second_store, tmp_path):
    from typer.testing import CliRunner

    from mtptrain.cli import app

    result = CliRunner().invoke(app, ["speculators", "data", "--out", str(tmp_path / "out"), "--no-progress", "--set",
                                      f"train.features={json.dumps([str(tiny_store), str(second_store)])}"])
    assert result.exit_code == 1 and "train.features lists 2 stores" in result.output
    assert not (tmp_path / "out").exists()
