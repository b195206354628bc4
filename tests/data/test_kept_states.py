"""States kept while regenerating stand in for precompute's forward passes, and only where they fit."""

import json
import logging
import shutil

import pytest
import torch
from conftest import write_sharegpt
from safetensors import safe_open

from mtptrain.config import load_recipe
from mtptrain.data.regenerate import format_summary, kept_line, run_regenerate
from mtptrain.data.resumable import state_path
from mtptrain.features.precompute import run_precompute
from mtptrain.data.kept_states import states_dir, write_group
from mtptrain.io import sha256_file
from mtptrain.features.store import FeatureStore, TARGET_TOP, hidden_key, load_manifest

LAYERS = [0, 1]


def overrides(target_dir, source, tmp, *extra):
    return [f"target.model={target_dir}", f"data.source={source}", "data.max_length=160",
            "data.validation_fraction=0.2", f"data.regenerated={tmp / 'regen' / 'r.jsonl'}",
            "regenerate.max_new_tokens=24", "regenerate.batch_size=3", "precompute.layers=[0]",
            f"precompute.output_dir={tmp / 'store'}", "precompute.batch_tokens=256", *extra]


def shard_rows(directory):
    """Every sample's ids, top and states per layer, by key, read straight from the shards."""
    manifest = load_manifest(directory)
    rows = {}
    for shard in manifest["shards"]:
        with safe_open(str(directory / shard["file"]), framework="pt") as handle:
            keys = json.loads(handle.metadata()["keys"])
            offsets = handle.get_tensor("offsets")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for i, key in enumerate(keys):
            start, end = int(offsets[i]), int(offsets[i + 1])
            rows[key] = {name: t[start:end] for name, t in tensors.items() if name not in ("offsets",)}
    return rows


@pytest.fixture(scope="module")
def regenerated(varied_target_dir, tmp_path_factory):
    """One regeneration (multi-turn conversations, some answers cut by the budget) that kept its states."""
    tmp = tmp_path_factory.mktemp("kept")
    source = write_sharegpt(tmp / "chats.json", 24)
    recipe = load_recipe(None, overrides(varied_target_dir, source, tmp, "target.dtype=float32"))
    run_regenerate(recipe, show_progress=False)
    return tmp, source, recipe


def test_precompute_copies_the_kept_states_and_they_equal_the_computed_ones(regenerated, caplog):
    tmp, source, recipe = regenerated
    state = json.loads(state_path(tmp / "regen" / "r.jsonl").read_text())
    entry = state["states"]
    assert entry["layers"] == [0, 1] and entry["dtype"] == "bfloat16" and len(entry["groups"]) == 1
    with safe_open(str(states_dir(tmp / "regen" / "r.jsonl") / "group-00000.safetensors"), framework="pt") as handle:
        tops = handle.get_tensor(TARGET_TOP)
    # the target's choices after each generated token come from decoding; a prompt's positions are left to precompute
    # (this tiny target's answers seldom tokenize back to the ids it decoded, so most of them are taken in again)
    assert bool((tops >= 0).any()) and bool((tops == -1).any())
    with caplog.at_level(logging.INFO, logger="mtptrain"):
        copied = run_precompute(recipe, show_progress=False)
    assert copied["complete"] and copied["tokens_copied"] == copied["tokens_computed"] == copied["tokens"] > 0
    assert "samples copied from the states r.jsonl kept" in caplog.text and ", 0 computed" in caplog.text
    # the same store computed by the target, with nothing kept to copy
    computed_dir = tmp / "store-computed"
    shutil.move(str(states_dir(tmp / "regen" / "r.jsonl")), str(tmp / "aside"))
    try:
        plain = recipe.model_copy(update={"precompute": recipe.precompute.model_copy(
            update={"output_dir": str(computed_dir)})})
        summary = run_precompute(plain, show_progress=False)
    finally:
        shutil.move(str(tmp / "aside"), str(states_dir(tmp / "regen" / "r.jsonl")))
    assert summary["tokens_copied"] == 0
    kept, fresh = shard_rows(tmp / "store"), shard_rows(computed_dir)
    assert kept.keys() == fresh.keys() and len(kept) >= 10
    agree = total = 0
    for key, row in kept.items():
        other = fresh[key]
        assert torch.equal(row["input_ids"], other["input_ids"]) and torch.equal(row["loss_mask"], other["loss_mask"])
        for layer in (0, 1):
            a, b = row[hidden_key(layer)].float(), other[hidden_key(layer)].float()
            # decoded one step at a time against all at once: float32 rounding, then bfloat16's
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), (key, layer, (a - b).abs().max())
        agree += int((row[TARGET_TOP] == other[TARGET_TOP]).sum())
        total += len(row[TARGET_TOP])
    assert agree / total > 0.98
    # and the store reads as any other
    assert len(FeatureStore(tmp / "store", "train")) == sum(1 for k in kept if k in fresh) - len(
        FeatureStore(tmp / "store", "validation"))


def _store(recipe, directory, **precompute):
    return recipe.model_copy(update={"precompute": recipe.precompute.model_copy(
        update={"output_dir": str(directory), **precompute})})


def test_a_store_of_fewer_layers_copies_them_and_another_precision_computes(regenerated, caplog):
    tmp, _, recipe = regenerated
    last = run_precompute(_store(recipe, tmp / "store-last", layers="last"), show_progress=False)
    assert last["tokens_copied"] == last["tokens"] > 0
    with caplog.at_level(logging.INFO, logger="mtptrain"):
        wide = run_precompute(_store(recipe, tmp / "store-fp32", dtype="float32"), show_progress=False)
    assert wide["complete"] and wide["tokens_copied"] == 0
    assert "they are in bfloat16, this store is in float32" in caplog.text


def test_a_tampered_kept_file_or_a_path_out_of_its_directory_is_computed_instead(regenerated, tmp_path, caplog):
    tmp, _, recipe = regenerated
    regen = tmp_path / "regen"
    shutil.copytree(tmp / "regen", regen)
    output = regen / "r.jsonl"
    group = states_dir(output) / "group-00000.safetensors"
    raw = bytearray(group.read_bytes())
    raw[-3] ^= 0xFF  # a state's byte: the header still parses
    group.write_bytes(bytes(raw))
    moved = recipe.model_copy(update={"data": recipe.data.model_copy(update={"regenerated": str(output)})})
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        summary = run_precompute(_store(moved, tmp_path / "store"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    assert f"{group}: it does not match the sha256 the regeneration recorded" in caplog.text
    # a state naming a file outside the directory: never opened
    state = json.loads(state_path(output).read_text())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tmp / "regen" / "r.jsonl.states" / "group-00000.safetensors", outside)
    entry = state["states"]["groups"]["0"]
    state["states"]["groups"]["0"] = {**entry, "file": "../../outside.safetensors"}
    state_path(output).write_text(json.dumps(state))
    summary = run_precompute(_store(moved, tmp_path / "store-2"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    # a file with its recorded sha256 whose states are not the target's width: refused before any copy
    with safe_open(str(outside), framework="pt") as handle:
        keys = json.loads(handle.metadata()["keys"])
        ids, offsets = handle.get_tensor("input_ids"), handle.get_tensor("offsets")
    narrow = write_group(states_dir(output), 0, keys, [ids[offsets[i]:offsets[i + 1]].numpy() for i in range(len(keys))],
                         [torch.zeros(int(offsets[i + 1] - offsets[i]), 2, 32, dtype=torch.bfloat16)
                          for i in range(len(keys))],
                         [torch.full((int(offsets[i + 1] - offsets[i]),), -1, dtype=torch.int32)
                          for i in range(len(keys))], [0, 1])
    state["states"]["groups"]["0"] = narrow
    state_path(output).write_text(json.dumps(state))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        summary = run_precompute(_store(moved, tmp_path / "store-3"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    assert "its layer 0 is BF16 [" in caplog.text and ", 32], not BF16 [" in caplog.text
    # a file of the right shapes whose target choices are not token ids of the target
    with safe_open(str(outside), framework="pt") as handle:
        states = [torch.stack([handle.get_tensor(hidden_key(layer))[offsets[i]:offsets[i + 1]] for layer in (0, 1)], 1)
                  for i in range(len(keys))]
    state["states"]["groups"]["0"] = write_group(
        states_dir(output), 0, keys, [ids[offsets[i]:offsets[i + 1]].numpy() for i in range(len(keys))], states,
        [torch.full((len(x),), 10**6, dtype=torch.int32) for x in states], [0, 1])
    state_path(output).write_text(json.dumps(state))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        summary = run_precompute(_store(moved, tmp_path / "store-4"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    assert "its target_top is not one token id (or -1) of the target's 400 per position" in caplog.text
    # a file whose header is not safetensors', recorded with its own sha256 (a hostile state): computed, no crash
    garbage = states_dir(output) / "group-00000.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    state["states"]["groups"]["0"] = {**state["states"]["groups"]["0"], "sha256": sha256_file(garbage), "bytes": 64}
    state_path(output).write_text(json.dumps(state))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        summary = run_precompute(_store(moved, tmp_path / "store-5"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    assert f"{garbage} cannot be read" in caplog.text


def test_a_rerun_reports_the_kept_states_still_on_disk_not_those_deleted(regenerated, tmp_path):
    tmp, _, recipe = regenerated
    shutil.copytree(tmp / "regen", tmp_path / "regen")
    output = tmp_path / "regen" / "r.jsonl"
    moved = recipe.model_copy(update={"data": recipe.data.model_copy(update={"regenerated": str(output)})})
    kept = run_regenerate(moved, show_progress=False)["kept_states"]
    assert kept["conversations"] > 0 and kept["bytes"] > 0 and kept["missing_files"] == 0
    assert "(delete it once the store is complete)" in kept_line(kept)
    shutil.rmtree(states_dir(output))  # as docs/data.md says, once the store is built
    summary = run_regenerate(moved, show_progress=False)
    assert summary["kept_states"] == {"directory": str(states_dir(output)), "conversations": 0, "tokens": 0,
                                      "bytes": 0, "missing_files": 1}
    assert (f"no longer in {states_dir(output)} (1 file gone): a store not yet built from this output computes "
            "them") in format_summary(summary)


@pytest.mark.parametrize("entry", ["not a record", {"version": 1, "layers": [0, 1], "dtype": "bfloat16", "runtime": {},
                                                    "groups": {"0": {"file": "group-00000.safetensors"}}}])
def test_a_hostile_record_of_kept_states_is_dropped_not_followed(regenerated, tmp_path, caplog, entry):
    tmp, _, recipe = regenerated
    regen = tmp_path / "regen"
    shutil.copytree(tmp / "regen", regen)
    output = regen / "r.jsonl"
    state = json.loads(state_path(output).read_text())
    state["states"] = entry
    state_path(output).write_text(json.dumps(state))
    moved = recipe.model_copy(update={"data": recipe.data.model_copy(update={"regenerated": str(output)})})
    with caplog.at_level(logging.WARNING, logger="mtptrain"):
        summary = run_precompute(_store(moved, tmp_path / "store"), show_progress=False)
    assert summary["complete"] and summary["tokens_copied"] == 0
    assert "its \"states\" entry is not one mtptrain wrote; computing every sample" in caplog.text
    run_regenerate(moved, show_progress=False)  # the finished file stands; the record is dropped
    assert "dropped (precompute computes those conversations)" in caplog.text
    assert json.loads(state_path(output).read_text()).get("states", {}).get("groups", {}) == {}
