"""train checks the whole identity its store records before it trains, and the head records what was checked."""

import json
import logging
import shutil

import pytest
from train_helpers import train_recipe

from mtptrain.features.store import FeatureStoreError
from mtptrain.train.trainer import run_train


@pytest.fixture()
def tampered_store(tiny_store, tmp_path):
    store = shutil.copytree(tiny_store, tmp_path / "store")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["target"]["fingerprint"] = "0" * 32
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store


def test_a_tampered_target_fingerprint_is_refused_before_training(tiny_target_dir, tampered_store, tmp_path):
    with pytest.raises(FeatureStoreError, match="fingerprint") as err:
        run_train(train_recipe(tiny_target_dir, tampered_store, tmp_path / "run", "train.max_steps=1"),
                  show_progress=False)
    assert "0" * 32 in str(err.value)
    assert not (tmp_path / "run" / "head").exists()


def test_a_tampered_architecture_field_is_refused(tiny_target_dir, tiny_store, tmp_path):
    store = shutil.copytree(tiny_store, tmp_path / "store")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["target"]["num_layers"] = 80
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match="num_layers 80"):
        run_train(train_recipe(tiny_target_dir, store, tmp_path / "run", "train.max_steps=1"), show_progress=False)


def test_the_head_records_which_target_fields_were_checked(tiny_target_dir, tiny_store, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mtptrain")
    run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "train.max_steps=1"), show_progress=False)
    config = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert "fingerprint" in config["target_checked"] and "tokenizer_fingerprint" in config["target_checked"]
    assert any("target identity checked" in r.getMessage() and "fingerprint (every weight)" in r.getMessage()
               for r in caplog.records)


def test_with_only_the_frozen_parts_checked_the_log_and_the_head_say_so(tiny_target_dir, tampered_store, tmp_path,
                                                                        caplog):
    caplog.set_level(logging.INFO, logger="mtptrain")
    run_train(train_recipe(tiny_target_dir, tampered_store, tmp_path / "run", "train.max_steps=1",
                           "train.target_check=frozen"), show_progress=False)
    config = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert "fingerprint" not in config["target_checked"] and "frozen_fingerprint" in config["target_checked"]
    message = next(r.getMessage() for r in caplog.records if "target identity checked" in r.getMessage())
    assert "not checked: fingerprint" in message and "train.target_check=frozen" in message
