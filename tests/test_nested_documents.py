"""A file nested past the parser's depth ("[[[[..." thousands deep, a few kilobytes) is a hostile file like any other:
each reader turns it into its own error naming the file and the fix, or, for a file it can do without, a warning,
never a RecursionError traceback."""

import json
import shutil
import logging

import pytest

from mtptrain.config import RecipeError, load_recipe
from mtptrain.data.resumable import RegenerateError, load_state, state_path
from mtptrain.eval.prompts import PromptSetError, load_prompts
from mtptrain.export.sidecar import ExportError
from mtptrain.export.stitch import stitch_mtp
from mtptrain.features.store import FeatureStoreError, load_manifest, read_complete_record, record_path
from mtptrain.peers.speculators import PeerError, import_checkpoint
from mtptrain.target.parts import read_weight_map
from mtptrain.target.source import TargetError
from mtptrain.train.checkpoints import CheckpointRefused, _read_record
from mtptrain.train.drafting import BestHead
from mtptrain.train.metrics import MetricsLog

DEEP = "[" * 100_000 + "]" * 100_000


def test_load_json_fails_as_broken_json_does():
    from mtptrain.io import load_json
    with pytest.raises(ValueError, match="nested past the JSON parser's depth"):
        load_json(DEEP)
    with pytest.raises(ValueError, match="nested past"):
        load_json(('{"a": ' * 50_000 + "1" + "}" * 50_000).encode())
    assert load_json('{"a": [[1]]}') == {"a": [[1]]}


def test_read_json_object_names_the_file_for_each_way_it_fails(tmp_path):
    from mtptrain.io import read_json_object
    path = tmp_path / "x.json"
    for text, words in ((DEEP, "nested past"), ("[1, 2]", "a JSON list, not an object"), ("{", "does not read"),
                        (b"\xff\xfe\x00{", "does not read")):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(TargetError, match="the fix") as caught:
            read_json_object(path, TargetError, "the fix")
        assert str(path) in str(caught.value) and words in str(caught.value), caught.value
    with pytest.raises(TargetError, match="does not read"):
        read_json_object(tmp_path / "missing.json", TargetError, "the fix")


def test_the_readers_of_users_files_refuse_it_naming_the_file(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    with pytest.raises(PromptSetError, match=r"deep\.json:1: not valid JSON \(nested past"):
        load_prompts(str(deep))
    (tmp_path / "recipe.yaml").write_text("name: " + DEEP + "\n")
    with pytest.raises(RecipeError, match=r"recipe .*recipe\.yaml is not valid YAML: line 1: nested more than 64"):
        load_recipe(tmp_path / "recipe.yaml")
    assert load_recipe(None, [f"name={DEEP[:5000]}{DEEP[-5000:]}"]).name.startswith("[[[")  # an override's text
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(DEEP)
    with pytest.raises(TargetError, match=r"index\.json does not read as JSON \(nested past.*download or save"):
        read_weight_map(index)
    index.write_text('{"weight_map": [1]}')
    with pytest.raises(TargetError, match='no "weight_map" object'):
        read_weight_map(index)
    checkpoint = tmp_path / "speculators-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(DEEP)
    with pytest.raises(PeerError, match=r"config\.json does not read as JSON \(nested past"):
        import_checkpoint(checkpoint, load_recipe(None).target, tmp_path / "imported")
    export, target = tmp_path / "export", tmp_path / "target"
    export.mkdir(), target.mkdir()
    (export / "config.json").write_text("{}")
    (export / "mtptrain.json").write_text('{"format": "mtptrain-export/1", "export_format": "deepseek-mtp"}')
    (target / "config.json").write_text(DEEP)
    with pytest.raises(ExportError, match=r"target/config\.json does not read as JSON \(nested past"):
        stitch_mtp(export, target, tmp_path / "stitched")


def test_the_readers_of_our_own_files_refuse_or_redo_it(tmp_path, caplog):
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(DEEP)
    with pytest.raises(FeatureStoreError, match=r"manifest\.json is not valid JSON \(nested past"):
        load_manifest(store)
    shard = store / "shard-00000.safetensors"
    record_path(shard).write_text(DEEP)
    assert read_complete_record(shard, "plan") is None  # the shard is computed again
    out = tmp_path / "regenerated.jsonl"
    state_path(out).write_text(DEEP)
    with pytest.raises(RegenerateError, match=r"state\.json is not valid JSON \(nested past"):
        load_state(out, {"groups_done": 0}, "data.regenerated", "regenerate")
    (tmp_path / "record.json").write_text(DEEP)
    with pytest.raises(CheckpointRefused, match=r"record\.json is not JSON \(nested past"):
        _read_record(tmp_path / "record.json", "the fix")
    best = tmp_path / "run" / "best-head"
    best.mkdir(parents=True)
    (best / "config.json").write_text(DEEP)
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        kept = BestHead(tmp_path / "run")
    assert (kept.tau, kept.step) == (-1.0, None) and "does not record the validation" in caplog.text
    (best / "config.json").write_text('{"validation": {"tau_chain": 2.5, "step": 400}}')
    assert (BestHead(tmp_path / "run").tau, BestHead(tmp_path / "run").step) == (2.5, 400)


def test_a_resumed_runs_metrics_drop_a_torn_last_row(tmp_path, caplog):
    metrics = MetricsLog(tmp_path, enabled=True, recipe=load_recipe(None, ["tracking.wandb=disabled"]), mode="disabled")
    for step in (10, 20, 30):
        metrics.log(step, {"train/loss": 1.0 / step})
    with open(metrics.path, "a") as fh:
        fh.write('{"step": 40, "train/lo')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        metrics.forget_after(20)
    assert [json.loads(line)["step"] for line in metrics.path.read_text().splitlines()] == [10, 20]
    assert "1 line(s) that are not metrics rows dropped" in caplog.text


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json", "generation_config.json"])
def test_a_target_directory_with_such_a_file_is_refused_naming_it(tiny_target_dir, tmp_path, name):
    from mtptrain.data.engines import generation_stops
    from mtptrain.target import load_config, load_tokenizer

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    (target / name).write_text(DEEP)
    cfg = load_recipe(None, [f"target.model={target}"]).target
    with pytest.raises(TargetError) as caught:
        load_config(cfg)
        load_tokenizer(cfg)
        generation_stops(cfg)
    assert "nested past the JSON parser's depth" in str(caught.value)
