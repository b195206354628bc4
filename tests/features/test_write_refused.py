"""A disk that refuses precompute's writes (full, here): a message naming the store, the complete shards kept,
and a rerun that resumes after them."""

import errno

import pytest
from conftest import tiny_recipe, write_sharegpt

import mtptrain.features.store as store
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import record_path
from mtptrain.io import WriteRefusedError


def test_a_full_disk_keeps_the_complete_shards_and_a_rerun_resumes(tiny_target_dir, tmp_path, monkeypatch):
    out = tmp_path / "features"
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 30), out, shard_mb=0.05)
    recipe.target.runtime, recipe.target.dtype = "transformers", "float32"  # no timing of this CPU's kernels
    write, calls = store.write_safetensors, []

    def disk_full_after_one_shard(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 1:
            return write(path, tensors, metadata)
        path.write_bytes(b"\0" * 1000)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_safetensors", disk_full_after_one_shard)
    with pytest.raises(WriteRefusedError) as refused:
        run_precompute(recipe, show_progress=False)
    assert str(refused.value) == (
        f"cannot write the feature store: no space left on {out}. Free space there, or set precompute.output_dir to "
        "a directory on another disk (a new directory starts afresh). Every complete shard is kept (nothing "
        "half-written is left), and rerunning the same command resumes after them.")
    first = out / calls[0].name.split(".tmp-")[0].lstrip(".")
    assert [p.name for p in out.glob("*.safetensors")] == [first.name] and record_path(first).is_file()
    assert not list(out.glob(".*tmp-*"))

    monkeypatch.undo()
    summary = run_precompute(recipe, show_progress=False)
    assert summary["complete"] and summary["shards_skipped"] == 1 and summary["shards_written"] >= 1
