"""A manifest (or shard record) is data anyone can edit: every path it names must stay inside the store.

A shard path that leaves the store (absolute, '..', a symlink out of it) is refused as a corrupt or hostile
manifest, and the refusal never tells the user to delete a file outside the store; a shard of another store
is refused even when it sits inside this one.
"""

import json
import os
import shutil

import pytest
from conftest import tiny_recipe, write_sharegpt

from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore, FeatureStoreError


@pytest.fixture(scope="module")
def stores(tiny_target_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stores")
    for name, seed in (("mine", 0), ("other", 1)):
        data = write_sharegpt(tmp / f"{name}.json", 20, seed=seed)
        run_precompute(tiny_recipe(tiny_target_dir, data, tmp / name), show_progress=False)
    return tmp


@pytest.fixture()
def pair(stores, tmp_path):
    """Fresh copies of this store ('store') and of another one made from other data ('other-store'), side by side."""
    shutil.copytree(stores / "mine", tmp_path / "store")
    shutil.copytree(stores / "other", tmp_path / "other-store")
    return tmp_path / "store", tmp_path / "other-store"


def _point_first_shard_at(store, name, entry_from=None):
    """Rewrite the manifest's first train shard entry to name `name` (with another entry's counts, bytes and sha256,
    and totals that add up, as a careful forger would)."""
    manifest = json.loads((store / "manifest.json").read_text())
    index = next(i for i, s in enumerate(manifest["shards"]) if s["split"] == "train")
    manifest["shards"][index] = {**manifest["shards"][index], **(entry_from or {}), "file": name}
    manifest["totals"] = {split: {field: sum(s[field] for s in manifest["shards"] if s["split"] == split)
                                  for field in ("samples", "tokens")} for split in ("train", "validation")}
    (store / "manifest.json").write_text(json.dumps(manifest))
    return index


def _other_entry(other):
    manifest = json.loads((other / "manifest.json").read_text())
    return next(s for s in manifest["shards"] if s["split"] == "train")


def _refused(store, index, name):
    with pytest.raises(FeatureStoreError) as err:
        FeatureStore(store)
    message = str(err.value)
    assert "manifest.json" in message and f"shard {index}" in message and name in message
    assert "delete" not in message.lower()
    return message


@pytest.mark.parametrize("name", ["/etc/passwd", "../../etc/passwd", "../other-store/train-00000.safetensors"])
def test_a_shard_path_outside_the_store_is_refused_as_a_hostile_manifest(pair, name):
    store, other = pair
    index = _point_first_shard_at(store, name, _other_entry(other) if "other-store" in name else None)
    message = _refused(store, index, name)
    assert "outside" in message and "hostile" in message


def test_a_symlink_out_of_the_store_is_refused(pair):
    store, other = pair
    entry = _other_entry(other)
    link = store / "train-link.safetensors"
    os.symlink(other / entry["file"], link)
    index = _point_first_shard_at(store, link.name, entry)
    _refused(store, index, link.name)


def test_a_shard_of_another_store_copied_inside_is_refused(pair):
    store, other = pair
    entry = _other_entry(other)
    shutil.copy(other / entry["file"], store / "train-foreign.safetensors")
    index = _point_first_shard_at(store, "train-foreign.safetensors", entry)
    with pytest.raises(FeatureStoreError, match="written for another store") as err:
        FeatureStore(store)
    assert f"shard {index}" in str(err.value)


def test_train_refuses_a_hostile_manifest_with_a_message_and_exit_1(pair, tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from mtptrain.cli import app

    store, _ = pair
    _point_first_shard_at(store, "/etc/passwd")
    result = CliRunner().invoke(app, ["train", "--no-progress", "--no-wandb", "--set", f"target.model={tiny_target_dir}",
                                      "--set", f"train.features={store}", "--set", f"train.output_dir={tmp_path / 't'}",
                                      "--set", "head.kind=eagle"])
    assert result.exit_code == 1, result.output
    assert "/etc/passwd" in result.output and "hostile" in result.output and "delete" not in result.output.lower()


def test_a_precompute_rerun_never_copies_a_path_from_a_tampered_shard_record(pair, tiny_target_dir, stores, caplog):
    store, _ = pair
    record = next(store.glob("train-*.json"))
    (store / "manifest.json").unlink()
    tampered = json.loads(record.read_text())
    record.write_text(json.dumps({**tampered, "file": "/etc/passwd"}))
    recipe = tiny_recipe(tiny_target_dir, stores / "mine.json", store)
    run_precompute(recipe, show_progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    assert all(not s["file"].startswith(("/", "..")) for s in manifest["shards"])
    assert len(FeatureStore(store)) > 0


def test_a_checkpoint_index_naming_files_outside_the_model_directory_is_refused(tiny_target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from mtptrain.config import TargetConfig
    from mtptrain.target import TargetError, load_frozen_target

    model_dir = shutil.copytree(tiny_target_dir, tmp_path / "model")
    tensors = load_file(model_dir / "model.safetensors")
    save_file(tensors, tmp_path / "outside.safetensors", metadata={"format": "pt"})
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {name: "../outside.safetensors" for name in tensors}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TargetError, match="outside") as err:
        load_frozen_target(TargetConfig(model=str(model_dir)))
    assert "model.safetensors.index.json" in str(err.value)
