"""A store that is not what the caller expects is refused with a message that names the file and the fix."""

import json
import shutil

import pytest
from conftest import tiny_recipe, write_sharegpt

from mtptrain.config import TargetConfig
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore, FeatureStoreError
from mtptrain.target import load_target


@pytest.fixture(scope="module")
def store_dir(tiny_target_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    run_precompute(tiny_recipe(tiny_target_dir, write_sharegpt(tmp / "c.json", 20), tmp / "out"), show_progress=False)
    return tmp / "out"


@pytest.fixture()
def store_copy(store_dir, tmp_path):
    return shutil.copytree(store_dir, tmp_path / "copy")


def test_the_right_target_is_accepted(store_dir, tiny_target_dir):
    store = FeatureStore(store_dir, target=load_target(TargetConfig(model=str(tiny_target_dir))))
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert len(store) == manifest["totals"]["train"]["samples"] > 0
    assert sum(store.lengths()) == manifest["totals"]["train"]["tokens"]


def test_another_target_is_refused(store_dir, other_target_dir):
    other = load_target(TargetConfig(model=str(other_target_dir)))
    with pytest.raises(FeatureStoreError) as err:
        FeatureStore(store_dir, target=other)
    message = str(err.value)
    assert "manifest.json" in message and "fingerprint" in message and "same target.model" in message


def test_missing_layers_are_refused(store_dir):
    with pytest.raises(FeatureStoreError, match=r"layers \[1\] were not captured"):
        FeatureStore(store_dir, layers=[1, 2])


def test_corrupted_shard_is_refused(store_copy):
    shard = next(store_copy.glob("train-*.safetensors"))
    tokens = next(s["tokens"] for s in json.loads((store_copy / "manifest.json").read_text())["shards"]
                  if s["file"] == shard.name)
    data = bytearray(shard.read_bytes())
    data[-4 * tokens - 100] ^= 0xFF  # in the last hidden states (target_top [tokens] int32 is stored after them)
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureStoreError, match=f"{shard.name}: sha256 does not match") as err:
        FeatureStore(store_copy)
    assert "recompute" in str(err.value) and "delete" not in str(err.value)
    FeatureStore(store_copy, verify="size")  # the cheap check cannot see a flipped hidden state; sha256 is the default
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(FeatureStoreError, match="bytes, manifest says") as err:
        FeatureStore(store_copy, verify="size")
    assert "delete" not in str(err.value)
    shard.unlink()
    with pytest.raises(FeatureStoreError, match="listed in the manifest but missing") as err:
        FeatureStore(store_copy)
    assert "delete" not in str(err.value)


def test_bad_manifests_are_refused(store_copy):
    manifest_path = store_copy / "manifest.json"
    good = json.loads(manifest_path.read_text())
    manifest_path.write_text("{ not json")
    with pytest.raises(FeatureStoreError, match="manifest.json is not valid JSON"):
        FeatureStore(store_copy)
    manifest_path.write_text(json.dumps({k: v for k, v in good.items() if k != "layers"}))
    with pytest.raises(FeatureStoreError, match=r"lacks \['layers'\]"):
        FeatureStore(store_copy)
    manifest_path.write_text(json.dumps({**good, "schema_version": 99}))
    with pytest.raises(FeatureStoreError, match="schema version 99"):
        FeatureStore(store_copy)
    manifest_path.write_text(json.dumps({**good, "shards": [{**good["shards"][0], "samples": 100}]}))
    with pytest.raises(FeatureStoreError, match=r"totals\.train\.samples is \d+, but the train shards add up to 100;"):
        FeatureStore(store_copy, verify="size")
    manifest_path.unlink()
    with pytest.raises(FeatureStoreError, match="has not finished"):
        FeatureStore(store_copy)


def test_store_pickles_without_open_handles(store_dir):
    import pickle

    store = FeatureStore(store_dir)
    first = store[0]
    clone = pickle.loads(pickle.dumps(store))
    assert clone._handles == {} and clone[0]["key"] == first["key"]


def test_reader_arguments_are_checked_and_layers_select_what_is_read(store_dir):
    with pytest.raises(ValueError, match="split must be one of"):
        FeatureStore(store_dir, "valid")
    with pytest.raises(ValueError, match="verify must be"):
        FeatureStore(store_dir, verify="md5")
    assert list(FeatureStore(store_dir, layers=[3])[0]["hidden"]) == [3]
