"""train.pad_multiple: micro-batches rounded up to a multiple of some length (on CUDA, so that torch's attention
meets few shapes), with the same loss and agreement as unrounded ones."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtptrain.config import CUDA_PAD_MULTIPLE, HEAD_CONFIGS, RecipeError, load_recipe
from mtptrain.features.store import FeatureStore, load_manifest
from mtptrain.heads import FrozenTarget
from mtptrain.heads.objective import step_weights
from mtptrain.heads.spec import HeadSpec
from mtptrain.train.data import epoch_batches, loader
from mtptrain.train.trainer import run_fingerprint


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_rounding_the_padded_length_changes_no_loss_and_no_count(kind, tiny_store, tiny_target_dir):
    recipe = load_recipe(None, [f"target.model={tiny_target_dir}", f"head.kind={kind}"])
    spec = HeadSpec.of(recipe.head, load_manifest(tiny_store))
    store = FeatureStore(tiny_store, "train", layers=spec.layers, verify="size")
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model), spec.family.draft_vocab(
        spec, (store.token_ids(i, assistant_only=True) for i in range(len(store))), 400))
    weights = step_weights("auto", spec.draft_positions)
    batches = epoch_batches(store.lengths(), 3, seed=0, epoch=0)[:4]
    unrounded, rounded = (list(loader(store, batches, 0, multiple=m)) for m in (1, 24))
    assert any(b["input_ids"].shape[1] % 24 for b in unrounded)  # some batch gets longer
    for plain, padded in zip(unrounded, rounded):
        longest = int(plain["lengths"].max())
        assert plain["input_ids"].shape[1] == longest
        assert padded["input_ids"].shape[1] == -(-longest // 24) * 24
        assert torch.equal(padded["input_ids"][:, :longest], plain["input_ids"])
        assert not padded["loss_mask"][:, longest:].any()
        results = [spec.family.objective(head, {**b, "hidden": {k: v.float() for k, v in b["hidden"].items()}}, spec,
                                         weights, 0.0, 64) for b in (plain, padded)]
        assert torch.allclose(results[0].loss, results[1].loss, rtol=1e-5, atol=1e-6), kind
        assert [p.count for p in results[0].positions] == [p.count for p in results[1].positions]
        assert [p.correct for p in results[0].positions] == [p.correct for p in results[1].positions]
        assert sum(p.count for p in results[0].positions) > 0


def test_auto_rounds_on_cuda_only_and_a_number_is_taken_as_it_is():
    auto, eight = load_recipe(None).train, load_recipe(None, ["train.pad_multiple=8"]).train
    assert auto.pad_multiple == "auto" and eight.pad_multiple == 8
    assert auto.pad_multiple_on("cuda") == CUDA_PAD_MULTIPLE == 64
    assert auto.pad_multiple_on("cpu") == 1
    assert eight.pad_multiple_on("cpu") == eight.pad_multiple_on("cuda") == 8
    for bad in ("0", "-64", "1.5", "sometimes"):
        with pytest.raises(RecipeError, match="pad_multiple"):
            load_recipe(None, [f"train.pad_multiple={bad}"])


def test_a_run_resumes_under_another_pad_multiple():
    """Padding changes no sample and no loss: a run stopped on a CPU may resume on a GPU."""
    fingerprints = {run_fingerprint(load_recipe(None, [f"train.pad_multiple={m}"]), {"plan_id": "p"}, 1)
                    for m in ("auto", "1", "64")}
    assert len(fingerprints) == 1
