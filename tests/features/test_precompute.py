import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_recipe, write_sharegpt
from helpers import reference_hidden, store_samples
from transformers import AutoModelForCausalLM

from mtptrain.data.prepare import prepare_samples
from mtptrain.features.plan import make_batches
from mtptrain.target.layers import resolve_layers
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore, FeatureStoreError
from mtptrain.target import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_layer_resolution():
    assert resolve_layers("eagle3", 30) == [1, 14, 26, 29]
    assert resolve_layers("last", 30) == [29]
    assert resolve_layers([5, 2, 5], 8) == [2, 5, 7]
    with pytest.raises(ValueError, match="numbered 0..7"):
        resolve_layers([8], 8)


def test_batches_keep_order_and_respect_the_token_budget(tiny_target_dir, tmp_path):
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 60), tmp_path / "out")
    samples, _ = prepare_samples(recipe.data, load_tokenizer(recipe.target), show_progress=False)
    samples.sort(key=len)
    budget = 300
    assert any(len(s) > budget // 2 for s in samples)  # some batches must be cut by the budget, not the size cap
    batches = make_batches(samples, batch_tokens=budget, max_batch_size=4)
    assert [s.key for b in batches for s in b] == [s.key for s in samples]
    assert len(batches) < len(samples)
    for batch in batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or len(batch) * max(len(s) for s in batch) <= budget
    # A sample longer than the whole budget still gets a batch of its own.
    alone = make_batches(samples, batch_tokens=len(samples[-1]) - 1, max_batch_size=64)
    assert alone[-1] == [samples[-1]]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2), ("float16", 2e-3)])
def test_stored_states_equal_a_fresh_forward(tiny_target_dir, tmp_path, dtype, tolerance):
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", dtype=dtype)
    summary = run_precompute(recipe, show_progress=False)
    assert summary["complete"] and summary["rows"]["kept"] >= 25
    assert summary["samples"]["train"] + summary["samples"]["validation"] == summary["rows"]["kept"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    for split in ("train", "validation"):
        store = FeatureStore(tmp_path / "out", split)
        assert store.layers == [0, 2, 3]
        for i in range(len(store)):
            sample = store[i]
            assert sample["hidden"][3].dtype == getattr(torch, dtype)
            ref = reference_hidden(model, sample["input_ids"], store.layers)
            for layer in store.layers:
                got = sample["hidden"][layer].float()
                scale = ref[layer].abs().max()
                assert torch.allclose(got, ref[layer], atol=tolerance * scale, rtol=tolerance), (split, i, layer)


def test_manifest_describes_the_store(tiny_target_dir, tmp_path):
    from mtptrain.features.store import load_manifest
    from mtptrain.io import sha256_file
    from mtptrain.target import load_target

    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", shard_mb=0.05)
    run_precompute(recipe, show_progress=False)
    manifest = load_manifest(tmp_path / "out")
    target = load_target(recipe.target)
    assert manifest["target"] == target.identity()
    assert manifest["layers"] == [0, 2, 3] and manifest["dtype"] == "bfloat16" and manifest["max_length"] == 160
    assert len(manifest["shards"]) > 2
    for shard in manifest["shards"]:
        assert sha256_file(tmp_path / "out" / shard["file"]) == shard["sha256"]
    assert sum(s["tokens"] for s in manifest["shards"]) == sum(t["tokens"] for t in manifest["totals"].values())
    assert (tmp_path / "out" / "recipe.yaml").is_file() and (tmp_path / "out" / "summary.json").is_file()
    # The reader gives back exactly the tokenized samples.
    samples, _ = prepare_samples(recipe.data, target.tokenizer, show_progress=False)
    by_key = {s.key: s for s in samples}
    store = FeatureStore(tmp_path / "out", "train", target=target, layers=[2])
    for i in range(len(store)):
        item = store[i]
        assert np.array_equal(item["input_ids"].numpy(), by_key[item["key"]].input_ids)
        assert np.array_equal(item["loss_mask"].numpy(), by_key[item["key"]].loss_mask)
    assert store.lengths() == [len(store[i]["input_ids"]) for i in range(len(store))]


def test_rerun_skips_complete_shards_and_keeps_them(tiny_target_dir, tmp_path):
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", shard_mb=0.05)
    first = run_precompute(recipe, show_progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.safetensors")}
    (tmp_path / "out" / "manifest.json").unlink()  # as if killed just before the manifest
    second = run_precompute(recipe, show_progress=False)
    assert second["shards_written"] == 0 and second["shards_skipped"] == first["shards_written"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.safetensors")} == stamps
    assert second["complete"]


def test_a_rerun_removes_the_temporaries_a_killed_run_left(tiny_target_dir, tmp_path):
    """A kill between writing a shard's (or its record's) temporary file and renaming it leaves the file; the
    rerun that redoes the shard removes both kinds."""
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", shard_mb=0.05)
    run_precompute(recipe, show_progress=False)
    out = tmp_path / "out"
    (out / "manifest.json").unlink()
    (out / "train-00000.json").unlink()  # the record's rename never happened
    left = [out / ".train-00000.json.tmp-host-123-abcd", out / ".train-00000.safetensors.tmp-host-123-abcd"]
    for path in left:
        path.write_text("partial")
    again = run_precompute(recipe, show_progress=False)
    assert again["shards_written"] == 1 and again["complete"]
    assert not list(out.glob(".*.tmp-*"))


def test_another_recipe_into_the_same_directory_is_refused(tiny_target_dir, tmp_path):
    data = write_sharegpt(tmp_path / "c.json", 20)
    run_precompute(tiny_recipe(tiny_target_dir, data, tmp_path / "out"), show_progress=False)
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    recipe_text = (tmp_path / "out" / "recipe.yaml").read_text()
    other = tiny_recipe(tiny_target_dir, data, tmp_path / "out", layers="[1]")
    with pytest.raises(FeatureStoreError, match="another recipe"):
        run_precompute(other, show_progress=False)
    (tmp_path / "out" / "manifest.json").unlink()
    with pytest.raises(FeatureStoreError, match="another recipe"):
        run_precompute(other, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(set(before) - {"manifest.json"})
    assert (tmp_path / "out" / "recipe.yaml").read_text() == recipe_text


def test_a_deleted_shard_or_a_broken_manifest_is_rebuilt_by_a_rerun(tiny_target_dir, tmp_path):
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", shard_mb=0.05)
    run_precompute(recipe, show_progress=False)
    out = tmp_path / "out"
    manifest = (out / "manifest.json").read_text()
    victim = out / json.loads(manifest)["shards"][1]["file"]
    original = victim.read_bytes()
    victim.unlink()
    victim.with_suffix(".json").unlink()  # what the reader's error message tells the user to do
    again = run_precompute(recipe, show_progress=False)
    assert again["complete"] and again["shards_written"] == 1 and victim.read_bytes() == original
    (out / "manifest.json").write_text("{ truncated")
    again = run_precompute(recipe, show_progress=False)
    assert again["complete"] and again["shards_written"] == 0
    assert len(FeatureStore(out)) > 0


@pytest.mark.parametrize("with_manifest", [True, False], ids=["store complete", "killed before the manifest"])
def test_a_rerun_verifies_what_it_skips_and_recomputes_a_corrupted_shard(tiny_target_dir, tmp_path, caplog,
                                                                         with_manifest):
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), tmp_path / "out", shard_mb=0.05)
    first = run_precompute(recipe, show_progress=False)
    out = tmp_path / "out"
    victim = out / json.loads((out / "manifest.json").read_text())["shards"][1]["file"]
    original = victim.read_bytes()
    damaged = bytearray(original)
    damaged[-50] ^= 0xFF  # same size: only the sha256 sees it
    victim.write_bytes(bytes(damaged))
    if not with_manifest:
        (out / "manifest.json").unlink()
    again = run_precompute(recipe, show_progress=False)
    assert again["complete"] and again["shards_written"] == 1
    assert again["shards_skipped"] == first["shards_written"] - 1
    assert victim.read_bytes() == original
    assert any(victim.name in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING")
    assert len(FeatureStore(out)) > 0  # verified with sha256 against the rewritten manifest


def _precompute_cmd(recipe_path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mtptrain.cli", "precompute", "--no-progress", "-r", str(recipe_path),
            *[a for o in overrides for a in ("--set", o)]]


def _write_recipe(tmp_path: Path, recipe) -> Path:
    from mtptrain.config import dump_recipe

    dump_recipe(recipe, tmp_path / "recipe.yaml")
    return tmp_path / "recipe.yaml"


@pytest.mark.parametrize("kill_after", ["first shard", "half the shards"])
def test_kill_9_then_resume_gives_the_store_of_an_uninterrupted_run(tiny_target_dir, tmp_path, kill_after):
    data = write_sharegpt(tmp_path / "c.json", 400)
    recipe_path = _write_recipe(tmp_path, tiny_recipe(tiny_target_dir, data, tmp_path / "x", shard_mb=0.02,
                                                      dtype="float32"))
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    subprocess.run(_precompute_cmd(recipe_path, f"precompute.output_dir={clean_dir}"), cwd=REPO, check=True,
                   capture_output=True)
    clean = json.loads((clean_dir / "manifest.json").read_text())
    wait_for = 1 if kill_after == "first shard" else len(clean["shards"]) // 2
    proc = subprocess.Popen(_precompute_cmd(recipe_path, f"precompute.output_dir={killed_dir}"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(killed_dir.glob("*-*.json"))) < wait_for and time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    # What the kill left behind: no manifest, so no reader accepts it; each finished shard is whole.
    with pytest.raises(FeatureStoreError, match="has not finished"):
        FeatureStore(killed_dir)
    done = list(killed_dir.glob("*-*.json"))
    assert wait_for <= len(done) < len(clean["shards"])
    for record in done:
        assert (killed_dir / json.loads(record.read_text())["file"]).stat().st_size == json.loads(record.read_text())["bytes"]
    resumed = subprocess.run(_precompute_cmd(recipe_path, f"precompute.output_dir={killed_dir}"), cwd=REPO,
                             check=True, capture_output=True, text=True)
    assert f"skipped (already complete) {len(done)}" in resumed.stdout
    killed = json.loads((killed_dir / "manifest.json").read_text())
    assert killed["shards"] == clean["shards"]
    killed.pop("created"), clean.pop("created")
    assert killed == clean
    for shard in clean["shards"]:
        assert (killed_dir / shard["file"]).read_bytes() == (clean_dir / shard["file"]).read_bytes()
    assert not list(killed_dir.glob(".*.tmp-*"))  # the resumed run cleared what the kill left


@pytest.mark.multiprocess
def test_two_processes_store_the_same_samples_as_one(tiny_target_dir, tmp_path):
    recipe_path = _write_recipe(tmp_path, tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 60),
                                                      tmp_path / "x", shard_mb=0.02, dtype="float32"))
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_precompute_cmd(recipe_path, f"precompute.output_dir={one}"), cwd=REPO, check=True,
                   capture_output=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    run = subprocess.run(launcher + _precompute_cmd(recipe_path, f"precompute.output_dir={two}")[1:], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0 of 2" in run.stdout
    manifest = json.loads((two / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2
    assert all(s["rank"] == i % 2 for i, s in enumerate(manifest["shards"]))  # disjoint: rank r took r, r+2, ...
    for split in ("train", "validation"):
        a, b = store_samples(one, split), store_samples(two, split)
        assert sorted(a) == sorted(b) and a
        for key in a:
            assert torch.equal(a[key]["input_ids"], b[key]["input_ids"])
            assert torch.equal(a[key]["loss_mask"], b[key]["loss_mask"])
            for layer in a[key]["hidden"]:
                assert torch.allclose(a[key]["hidden"][layer], b[key]["hidden"][layer], atol=1e-5, rtol=1e-4)


def test_a_float8_store_keeps_each_row_within_its_scale_at_half_the_size(tiny_target_dir, tmp_path):
    """float8_e4m3fn with a scale per row: every value within 1/16 of its row's largest magnitude of the bfloat16
    value it was made from (3 mantissa bits, plus reading back in bfloat16), in about half the bytes."""
    data = write_sharegpt(tmp_path / "c.json", 30)
    summaries = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        summaries[dtype] = run_precompute(tiny_recipe(tiny_target_dir, data, tmp_path / dtype, dtype=dtype),
                                          show_progress=False)
    assert summaries["float8_e4m3fn"]["bytes_on_disk"] < 0.65 * summaries["bfloat16"]["bytes_on_disk"]
    for split in ("train", "validation"):
        wide, narrow = (FeatureStore(tmp_path / dtype, split) for dtype in ("bfloat16", "float8_e4m3fn"))
        assert narrow.keys == wide.keys and (len(narrow) > 0 or split == "validation")
        for i in range(len(narrow)):
            a, b = wide[i], narrow[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["target_top"], b["target_top"])
            for layer in narrow.layers:
                got, ref = b["hidden"][layer], a["hidden"][layer].float()
                assert got.dtype == torch.bfloat16
                bound = ref.abs().amax(dim=-1, keepdim=True) * (1 / 16 + 1 / 128)
                assert ((got.float() - ref).abs() <= bound).all(), (split, i, layer)


def test_a_store_records_what_computed_it_and_refuses_a_run_in_another_precision(tiny_target_dir, tmp_path):
    """Shards of one store come from one compute dtype: a rerun (or another rank) whose target would compute in
    another refuses before it writes a shard, naming the record and the setting that finishes the store."""
    data = write_sharegpt(tmp_path / "c.json", 12)
    out = tmp_path / "store"
    run_precompute(tiny_recipe(tiny_target_dir, data, out), show_progress=False)  # target.dtype=float32
    manifest = json.loads((out / "manifest.json").read_text())
    record = json.loads((out / "runtime.json").read_text())
    assert manifest["runtime"] == record and record["dtype"] == "float32" and record["runtime"] == "native"
    assert set(record) >= {"product_batch", "attention_batch"}

    other = tmp_path / "other"
    other.mkdir()
    (other / "runtime.json").write_text(json.dumps({**record, "dtype": "bfloat16"}))  # a killed run in bfloat16
    with pytest.raises(FeatureStoreError, match=r"runtime\.json.*bfloat16.*float32.*target\.dtype=bfloat16"):
        run_precompute(tiny_recipe(tiny_target_dir, data, other), show_progress=False)
    assert not list(other.glob("*.safetensors")) and not (other / "manifest.json").exists()
