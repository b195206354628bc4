"""The store records the target's greedy next token at every position, and the eagle3 objective reads it
instead of multiplying by the full LM head, with the same loss and agreement."""

import torch
from transformers import AutoModelForCausalLM

from mtptrain.config import load_recipe
from mtptrain.features.store import FeatureStore, load_manifest
from mtptrain.heads import FrozenTarget
from mtptrain.heads.objective import step_weights
from mtptrain.heads.spec import HeadSpec
from mtptrain.train.data import collate


def test_the_store_holds_the_targets_greedy_choice_at_every_position(tiny_store, tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    for split in ("train", "validation"):
        store = FeatureStore(tiny_store, split, verify="size")
        assert store.has_target_top and len(store) > 0
        for i in range(0, len(store), 7):
            sample = store[i]
            with torch.no_grad():
                expected = model(sample["input_ids"].long()[None]).logits[0].argmax(-1)
            assert sample["target_top"].dtype == torch.int32
            assert torch.equal(sample["target_top"].long(), expected)


def test_the_eagle3_objective_scores_the_same_from_stored_choices(tiny_store, tiny_target_dir):
    recipe = load_recipe(None, [f"target.model={tiny_target_dir}", "head.kind=eagle3", "head.draft_vocab_size=128",
                                "head.ttt_steps=3"])
    spec = HeadSpec.of(recipe.head, load_manifest(tiny_store))
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    store = FeatureStore(tiny_store, "train", layers=spec.layers, verify="size")
    torch.manual_seed(0)
    streams = (store.token_ids(i, assistant_only=True) for i in range(len(store)))
    head = spec.family.build(spec, FrozenTarget.of(model), spec.family.draft_vocab(spec, streams, 400))
    batch = collate([store[i] for i in range(6)])
    batch["hidden"] = {k: v.float() for k, v in batch["hidden"].items()}
    assert "target_top" in batch
    without = {k: v for k, v in batch.items() if k != "target_top"}
    weights = step_weights("auto", spec.draft_positions)
    stored = spec.family.objective(head, batch, spec, weights, 0.0, 64)
    computed = spec.family.objective(head, without, spec, weights, 0.0, 64)
    assert torch.allclose(stored.loss, computed.loss, rtol=1e-5, atol=1e-6)
    assert [p.correct for p in stored.positions] == [p.correct for p in computed.positions]
    assert [p.count for p in stored.positions] == [p.count for p in computed.positions]
    assert sum(p.count for p in stored.positions) > 0
