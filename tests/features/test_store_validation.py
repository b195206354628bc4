"""Every shard and every manifest is checked before training reads a sample, naming the file and the field.

The tampered stores here are what a careless tool would leave: a valid safetensors file whose manifest entry
(bytes, sha256) and totals were brought in line, so that the hash cannot see the change and the checks of the
content must.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from mtptrain.config import load_recipe
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore, FeatureStoreError, write_safetensors
from mtptrain.io import sha256_file


@pytest.fixture()
def store(tiny_store, tmp_path):
    return shutil.copytree(tiny_store, tmp_path / "store")


def _manifest(store):
    return json.loads((store / "manifest.json").read_text())


def _write_manifest(store, manifest, totals=True):
    """Write `manifest`, its totals recomputed from its shard entries unless `totals` is False."""
    if totals:
        manifest["totals"] = {split: {field: sum(s[field] for s in manifest["shards"] if s["split"] == split)
                                      for field in ("samples", "tokens")} for split in ("train", "validation")}
    (store / "manifest.json").write_text(json.dumps(manifest))


def _rewrite_shard(store, change, metadata_change=None):
    """Apply `change(tensors)` to the first train shard, write it as a valid safetensors file and bring the
    manifest's bytes and sha256 in line; returns the shard's file name."""
    manifest = _manifest(store)
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    path = store / entry["file"]
    with safe_open(str(path), framework="pt") as fh:
        tensors = {name: fh.get_tensor(name).clone() for name in fh.keys()}  # the file is rewritten below
        metadata = fh.metadata()
    change(tensors)
    (metadata_change or (lambda m: None))(metadata)
    entry.update(write_safetensors(path, tensors, metadata))
    _write_manifest(store, manifest)
    return entry["file"]


def _refused(store, *words, verify="sha256"):
    with pytest.raises(FeatureStoreError) as err:
        FeatureStore(store, verify=verify)
    message = str(err.value)
    assert all(word in message for word in words), message
    assert "delete" not in message.lower()
    return message


def _swap_offsets(t):
    t["offsets"][[1, 2]] = t["offsets"][[2, 1]]


def _offsets_past_the_end(t):
    t["offsets"][-1] += 1000


def _id(t, name, value):
    t[name][5] = value


@pytest.mark.parametrize(("change", "field"), [
    (_swap_offsets, "offsets"),
    (_offsets_past_the_end, "offsets"),
    (lambda t: t.update({"hidden.1": t["hidden.1"][:, :-1].contiguous()}), "hidden.1"),
    (lambda t: t.update({"hidden.2": t["hidden.2"][:-1].contiguous()}), "hidden.2"),
    (lambda t: t.update({"hidden.2": t["hidden.2"].to(torch.bfloat16)}), "hidden.2"),
    (lambda t: t.update({"input_ids": t["input_ids"].long()}), "input_ids"),
    (lambda t: _id(t, "input_ids", 10**6), "input_ids"),
    (lambda t: _id(t, "input_ids", -3), "input_ids"),
    (lambda t: _id(t, "target_top", 10**6), "target_top"),
    (lambda t: _id(t, "loss_mask", 2), "loss_mask"),
    (lambda t: t.pop("loss_mask"), "loss_mask"),
    (lambda t: t.update({"hidden.9": t["hidden.0"]}), "hidden.9"),
], ids=["offsets out of order", "offsets past the end", "hidden size", "hidden rows", "bf16 layer in f32 store",
        "int64 ids", "id past the vocabulary", "negative id", "target_top past the vocabulary", "loss mask of 2",
        "no loss mask", "unknown tensor"])
def test_a_shard_that_does_not_match_its_manifest_is_refused(store, change, field):
    name = _rewrite_shard(store, change)
    _refused(store, name, field, "precompute")
    _refused(store, name, field, verify="size")  # the content is checked whatever the hash mode


def test_a_shard_listing_another_split_is_refused(store):
    name = _rewrite_shard(store, lambda t: None, lambda m: m.update({"split": "validation"}))
    _refused(store, name, "split")


def test_a_safetensors_header_claiming_a_huge_length_is_refused_with_how_to_recompute(store):
    manifest = _manifest(store)
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    path = store / entry["file"]
    data = bytearray(path.read_bytes())
    data[:8] = (2**60).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    entry["sha256"] = sha256_file(path)
    _write_manifest(store, manifest)
    _refused(store, entry["file"], "header", "precompute")


def _duplicate_first_train_shard(store, file=None, times=2):
    manifest = _manifest(store)
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    manifest["shards"] += [{**entry, "file": file or entry["file"]}] * times
    _write_manifest(store, manifest)
    return entry["file"]


@pytest.mark.parametrize("file", [None, "./{}"], ids=["same name", "same file, another spelling"])
def test_a_shard_listed_twice_is_refused(store, file):
    name = _duplicate_first_train_shard(store)
    if file:
        manifest = _manifest(store)
        manifest["shards"][-1]["file"] = file.format(name)
        _write_manifest(store, manifest)
    _refused(store, "manifest.json", name, "twice")


def test_a_copy_of_a_shard_under_another_name_is_refused(store):
    name = _duplicate_first_train_shard(store, "train-copy.safetensors", times=1)
    shutil.copy(store / name, store / "train-copy.safetensors")
    _refused(store, "train-copy.safetensors", name, "twice")


def test_totals_that_do_not_add_up_are_refused(store):
    manifest = _manifest(store)
    manifest["totals"]["train"]["samples"] += 1
    _write_manifest(store, manifest, totals=False)
    _refused(store, "manifest.json", "totals", "train", "samples")


@pytest.mark.parametrize(("field", "value"), [("tokens", -5), ("samples", -1), ("tokens", 10**12),
                                              ("samples", "12"), ("tokens", 1.5)])
def test_negative_or_absurd_counts_are_refused(store, field, value):
    manifest = _manifest(store)
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    entry[field] = value
    _write_manifest(store, manifest, totals=isinstance(value, int))
    _refused(store, entry["file"], field)


def test_a_rerun_of_precompute_repairs_what_the_messages_point_at(store, tiny_store):
    """The advice of the refusals holds: the same recipe into the same directory rewrites a tampered manifest
    and recomputes a shard that no longer matches its record."""
    _duplicate_first_train_shard(store)
    _refused(store, "twice")
    recipe = load_recipe(store / "recipe.yaml", [f"precompute.output_dir={store}"])
    run_precompute(recipe, show_progress=False)
    assert len(FeatureStore(store)) == len(FeatureStore(tiny_store))
    name = _rewrite_shard(store, _swap_offsets)
    _refused(store, name, "offsets")
    assert run_precompute(recipe, show_progress=False)["shards_written"] == 1
    assert (store / name).read_bytes() == (tiny_store / name).read_bytes()
    assert len(FeatureStore(store)) == len(FeatureStore(tiny_store))


def test_train_refuses_a_tampered_shard_before_training_with_exit_1(store, tiny_target_dir, tmp_path):
    from typer.testing import CliRunner

    from mtptrain.cli import app

    name = _rewrite_shard(store, _offsets_past_the_end)
    result = CliRunner().invoke(app, ["train", "--no-progress", "--no-wandb", "--set", f"target.model={tiny_target_dir}",
                                      "--set", f"train.features={store}", "--set", f"train.output_dir={tmp_path / 't'}",
                                      "--set", "head.kind=eagle"])
    assert result.exit_code == 1, result.output
    assert f"error: {store / name}" in result.output and "offsets" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "t" / "checkpoints").exists()


@pytest.mark.parametrize(("field", "value"), [("layers", 5), ("layers", []), ("layers", [0, "1"]), ("layers", [0, 0]),
                                              ("layers", [-1, 2]), ("plan_id", 7)])
def test_a_manifest_whose_layers_or_plan_are_not_what_precompute_writes_is_refused(store, field, value):
    manifest = _manifest(store)
    manifest[field] = value
    _write_manifest(store, manifest)
    _refused(store, "manifest.json", field)
