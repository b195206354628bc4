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


def _rank(rank: int, port: int, target_dir: str, main_whole: bool, results) -> None:
    """One of two gloo ranks: the identity train checks, counting the checkpoint reads this rank made."""
    import os

    import torch
    import torch.distributed as torch_dist

    import mtptrain.train.trainer as trainer
    from mtptrain.config import Recipe, TargetConfig
    from mtptrain.dist import DistInfo
    from mtptrain.target import load_frozen_target, load_target

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    reads = []
    original = trainer.checkpoint_fingerprint
    trainer.checkpoint_fingerprint = lambda cfg: reads.append(1) or original(cfg)
    cfg = TargetConfig(model=target_dir, device="cpu", dtype="float32")
    dist = DistInfo(rank, 2, rank)
    target = load_target(cfg, dist) if rank == 0 and main_whole else load_frozen_target(cfg, dist)
    identity = trainer._identity_to_check(Recipe(target=cfg), target, dist, torch.device("cpu"))
    results.put((rank, identity["fingerprint"], len(reads)))
    torch_dist.destroy_process_group()


@pytest.mark.parametrize("main_whole", [False, True], ids=["all in part", "main rank whole"])
def test_only_the_main_rank_reads_the_whole_checkpoint_for_its_fingerprint(tiny_target_dir, main_whole):
    """train.target_check full: the fingerprint of every weight, read once by rank 0 and handed to the others (a
    70B target's 141 GB once per node instead of once per rank). With train.engine_eval the main rank has loaded
    the whole target and knows its fingerprint already; the others still wait for it (a rank that skipped the
    hand-over would leave them waiting for ever)."""
    import socket

    import torch.multiprocessing as mp

    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")  # a forked child of a process with OpenMP threads can hang
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, port, str(tiny_target_dir), main_whole, results)) for r in range(2)]
    for process in ranks:
        process.start()
    found = sorted(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    whole = load_target(TargetConfig(model=str(tiny_target_dir), device="cpu", dtype="float32")).fingerprint
    assert found == [(0, whole, 0 if main_whole else 1), (1, whole, 0)]
