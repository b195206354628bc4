"""The head shipped in pretrained/: produced by recipes/reference.yaml, small enough for the repository, and used
by `mtptrain eval` on the embedded default when nothing has been trained."""

import json

import pytest
from safetensors import safe_open

from mtptrain.eval.run import run_eval
from mtptrain.heads.checkpoint import PRETRAINED_HEAD, head_directory
from mtptrain.config import load_recipe

REFERENCE = "recipes/reference.yaml"
# Sections of the recipe that decide the head's weights (output paths and export settings aside).
TRAINING_SECTIONS = ("target", "data", "regenerate", "precompute", "head")
# Recipe fields added after the shipped head was trained, none of which changes its weights.
# Keys added since the head was trained, or (regenerate.cpu_matmul) whose default changed since: a choice of
# product that changes float rounding, not the method.
ADDED_SINCE = {"head": {"mtp_input", "fc_norm", "norm_output"}, "target": {"gpus_per_rank", "runtime"}, "regenerate": {"cpu_matmul"}}
# engine_eval came after the shipped head: validation through the engine, which with select_best chooses the
# step exported but leaves the training itself alone.
TRAIN_KEYS_IGNORED = {"features", "output_dir", "head_dtype", "head_snapshots", "log_every", "eval_every",
                      "checkpoint_every", "target_check", "engine_eval", "online"}
# (online came after it too: where the features are computed, not what they are; tests/train/test_online.py)
# Train keys added since, with the value that means how the head was trained (forward KL, AdamW on every
# trained parameter, the draft LM head trained).
TRAIN_ADDED_SINCE = {"loss": "kl", "loss_eta": 3.0, "optimizer": "adamw", "muon_weight_decay": 0.1,
                     "draft_lm_head": "trained"}


def shipped_config() -> dict:
    return json.loads((PRETRAINED_HEAD / "config.json").read_text())


def test_shipped_head_was_trained_by_the_reference_recipe():
    recorded = shipped_config()["train"]["recipe"]
    reference = load_recipe(REFERENCE).model_dump(mode="json")
    for section in TRAINING_SECTIONS:
        skipped = ADDED_SINCE.get(section, ())
        expected = {k: v for k, v in reference[section].items() if k not in skipped}
        assert {k: v for k, v in recorded[section].items() if k not in skipped} == expected, \
            f"{section}: the shipped head was trained with other settings"
    train = {k: v for k, v in reference["train"].items() if k not in TRAIN_KEYS_IGNORED}
    for key, then in TRAIN_ADDED_SINCE.items():  # the reference still trains as the head was trained
        assert train.pop(key) == then, key
    assert {k: recorded["train"][k] for k in train} == train


def test_shipped_head_is_small_and_bfloat16():
    weights = PRETRAINED_HEAD / "model.safetensors"
    assert weights.stat().st_size < 25 * 2**20
    with safe_open(str(weights), "pt") as f:
        dtypes = {str(f.get_slice(name).get_dtype()) for name in f.keys()}
    assert "BF16" in dtypes and not dtypes & {"F32", "F64"}, dtypes


def test_eval_falls_back_to_the_shipped_head_only_on_the_embedded_default(tmp_path):
    untrained = [f"train.output_dir={tmp_path / 'none'}"]
    assert head_directory(load_recipe(None, untrained)) == PRETRAINED_HEAD
    other = load_recipe(None, untrained + [f"target.model={tmp_path / 'model'}"])
    assert head_directory(other) == tmp_path / "none" / "head"
    explicit = load_recipe(None, untrained + [f"eval.head={tmp_path / 'h'}"])
    assert head_directory(explicit) == tmp_path / "h"


@pytest.mark.real_model
def test_eval_on_the_embedded_default_measures_the_shipped_head(tmp_path):
    recipe = load_recipe(None, [f"train.output_dir={tmp_path / 'none'}", "eval.methods=[chain]", "eval.k=[3]",
                                "eval.max_prompts=3", "eval.max_turns=1", "eval.max_new_tokens=48", "eval.repeats=1",
                                f"eval.output_dir={tmp_path / 'eval'}", "tracking.wandb=disabled"])
    results = run_eval(recipe, show_progress=False)
    assert results["head"]["path"] == str(PRETRAINED_HEAD)
    chain = next(m for m in results["methods"] if m["method"] == "chain")
    exactness = chain["exactness"]  # bfloat16 where this machine runs it faster: near-ties are reported
    assert exactness["checked"] == 3 and not exactness["failures"]
    assert exactness["identical"] + len(exactness["near_ties"]) == 3
    # The shipped head reached tau 1.28 here; the reference run's first snapshot, after 93k tokens, 1.12 on 10
    # questions (docs/reference-run.md). A head that stopped accepting would fall to 1.0.
    assert chain["tau"] > 1.15, chain
