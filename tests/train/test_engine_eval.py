"""Validation through the inference implementation: the head drafts in the engine while it trains, and the
exported head is the one with the best validated chain tau."""

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import train_recipe

from mtptrain.config import TargetConfig
from mtptrain.data.chat import stop_tokens
from mtptrain.errors import MtptrainError
from mtptrain.features.store import FeatureStore
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import load_head
from mtptrain.target import load_target
from mtptrain.train.drafting import drafting_metrics
from mtptrain.train.trainer import run_train


def test_the_head_drafts_while_training_and_the_best_validated_head_is_exported(tiny_target_dir, tiny_store,
                                                                                tmp_path):
    out = tmp_path / "run"
    settings = ("head.kind=eagle3", "train.max_steps=12", "train.eval_every=4", "train.engine_eval.prompts=3",
                "train.engine_eval.max_new_tokens=12", "train.engine_eval.k=2", "train.engine_eval.tree_budget=4")
    recipe = train_recipe(tiny_target_dir, tiny_store, out, *settings)
    summary = run_train(recipe, show_progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drafted = [r for r in rows if "val/tau_chain" in r]
    assert [r["step"] for r in drafted] == [4, 8, 12]
    for row in drafted:
        assert 1.0 <= row["val/tau_chain"] <= 3.0 and 1.0 <= row["val/tau_tree"] <= 3.0
        chain = [row[f"val/accept_chain_{i}"] for i in (1, 2)]
        assert all(0.0 <= a <= 1.0 for a in chain) and chain[1] <= chain[0] + 1e-9  # a later draft needs the earlier
        assert "val/acc_1" in row  # beside the teacher-forced agreement
    best_tau = max(r["val/tau_chain"] for r in drafted)
    best = next(r for r in drafted if r["val/tau_chain"] == best_tau)  # the first step that reached it
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["validation"]["step"] == best["step"] and config["validation"]["tau_chain"] == best_tau
    assert config["train"]["steps"] == best["step"]
    seen = [r["train/tokens_seen"] for r in drafted]  # the x axis of the learning curve, exact
    assert seen == sorted(seen) and seen[0] > 0 and config["train"]["tokens"] == best["train/tokens_seen"]
    assert summary["selected"] == {"step": best["step"], "tau_chain": best_tau}
    exported, kept = load_file(out / "head" / "model.safetensors"), load_file(out / "best-head" / "model.safetensors")
    assert exported.keys() == kept.keys() and all(torch.equal(exported[k], kept[k]) for k in exported)

    # The exported head, loaded as eval loads it, drafts with the tau that chose it.
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    head, spec = load_head(out / "head", FrozenTarget.of(target.model), target.identity())
    store = FeatureStore(tiny_store, "validation", verify="size")
    prompts = [store.prompt_ids(i) for i in range(3)]
    again = drafting_metrics(target.model, head, spec, prompts, recipe.train.engine_eval,
                             stop_tokens(target.tokenizer, target.model))
    assert again["val/tau_chain"] == best_tau

    # The finished run asked again with select_best switched off exports its last step and keeps its summary
    # (the training rate, the last validation); switched back on, the best step's head again.
    last = run_train(train_recipe(tiny_target_dir, tiny_store, out, *settings, "train.engine_eval.select_best=false"),
                     show_progress=False)
    assert "selected" not in last and json.loads((out / "head" / "config.json").read_text())["train"]["steps"] == 12
    assert last["tokens_per_second"] == summary["tokens_per_second"] > 0
    assert last["val/tau_chain"] == summary["val/tau_chain"]
    assert json.loads((out / "summary.json").read_text()) == last
    again = run_train(recipe, show_progress=False)
    assert again["selected"] == summary["selected"]
    exported = load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(exported[k], kept[k]) for k in exported)

    # A damaged summary is refused naming it, not trusted or crashed on.
    for damaged in ('{"steps": 12, "selected": 4}', "[1]", '{"steps": 1'):
        (out / "summary.json").write_text(damaged)
        with pytest.raises(MtptrainError, match="summary.json: not a summary written by mtptrain train"):
            run_train(recipe, show_progress=False)


def test_a_prompt_is_the_samples_tokens_before_its_first_answer_token(tiny_store):
    store = FeatureStore(tiny_store, "validation", verify="size")
    for i in range(len(store)):
        sample = store[i]
        first = int(sample["loss_mask"].nonzero()[0, 0])
        assert first > 0 and store.prompt_ids(i) == sample["input_ids"][:first].tolist()


def test_the_best_head_survives_a_restart_and_only_a_better_tau_replaces_it(tmp_path):
    from mtptrain.train.drafting import BestHead

    saved = []

    def save(directory, extra):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(extra))
        saved.append(extra["validation"]["step"])

    best = BestHead(tmp_path)
    assert best.step is None
    assert best.offer(4, {"val/tau_chain": 1.2, "val/accept_chain_1": 0.2}, save)
    assert not best.offer(8, {"val/tau_chain": 1.2}, save)  # a tie keeps the earlier step
    assert not best.offer(8, {"val/acc_1": 0.5}, save)  # no engine validation: nothing to compare
    again = BestHead(tmp_path)  # a resumed run knows the best so far
    assert (again.step, again.tau) == (4, 1.2)
    assert not again.offer(12, {"val/tau_chain": 1.1}, save)
    assert again.offer(16, {"val/tau_chain": 1.3}, save)
    chosen = json.loads((tmp_path / "best-head" / "config.json").read_text())["validation"]
    assert chosen["step"] == 16 and chosen["tau_chain"] == 1.3 and saved == [4, 16]
    assert not (tmp_path / "best-head.tmp").exists()
