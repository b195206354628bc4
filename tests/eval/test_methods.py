"""Eval's methods: one registered object per name a recipe accepts, the refusal of an unknown name, the
configurations a recipe's methods build, and the settings each method refuses."""

import copy
import re
from typing import get_args

import pytest
import torch

from mtptrain.config import EvalConfig, EvalMethodName, RecipeError, TargetConfig, load_recipe
from mtptrain.eval.methods import METHODS, EvalError, build_configs, method_of, ssd_device
from mtptrain.engine.verify import Sampling
from mtptrain.target import load_target


def test_every_method_a_recipe_names_is_registered_and_no_method_is_out_of_reach():
    assert set(get_args(EvalMethodName)) == set(METHODS)
    assert EvalConfig.model_fields["methods"].annotation == list[EvalMethodName]
    assert all(method.name == name for name, method in METHODS.items())


def test_an_unknown_method_is_refused_with_the_known_ones():
    known = "ngram, suffix, chain, tree, draft, ssd, ssd-draft"
    with pytest.raises(EvalError, match=f"unknown eval method 'medusa': the known methods are {known}"):
        method_of("medusa")
    with pytest.raises(RecipeError, match=r"eval\.methods\.0"):
        load_recipe(None, ["eval.methods=[medusa]"])


def recipe(target_dir, *overrides):
    return load_recipe(None, [f"target.model={target_dir}", "eval.k=[1,3]", *overrides])


def test_each_method_builds_a_configuration_per_k_after_the_baseline(tiny_target_dir):
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    configs, head_info, notes, modules = build_configs(
        recipe(tiny_target_dir, "eval.methods=[ngram,suffix,draft]", "eval.draft.layers=2"), target, Sampling())
    assert [c.label for c in configs] == ["baseline", "ngram K=1", "ngram K=3", "suffix K=1", "suffix K=3",
                                          "draft K=1", "draft K=3"]
    assert [c.method for c in configs] == ["baseline"] + [m for m in ("ngram", "suffix", "draft") for _ in range(2)]
    # the draft model runs on the runtime's decoder (built once for its proposers): no linear layer to swap
    assert head_info is None and notes == [] and modules == []
    assert not any(c.uses_head or c.keeps_proposer for c in configs)
    assert configs[0].make is None
    assert [type(c.make()).__name__ for c in configs[1:]] == [
        "NgramProposer", "NgramProposer", "SuffixIndexProposer", "SuffixIndexProposer", "DraftModelProposer",
        "DraftModelProposer"]


def test_methods_refuse_what_they_cannot_draft_with(tiny_target_dir, tmp_path):
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    missing = recipe(tiny_target_dir, "eval.methods=[ngram,tree]", f"eval.head={tmp_path / 'nowhere'}")
    with pytest.raises(EvalError, match=re.escape(
            f"no trained head at {tmp_path / 'nowhere'} (eval.methods has chain, tree, ssd, which draft with a head): "
            "run `mtptrain train` with this recipe first, point eval.head at a head directory, or drop chain/tree/ssd "
            "from mtptrain.eval.methods")):
        build_configs(missing, target, Sampling())
    for method in ("draft", "ssd-draft"):
        with pytest.raises(EvalError, match="set exactly one of eval.draft.model .* or eval.draft.layers"):
            build_configs(recipe(tiny_target_dir, f"eval.methods=[{method}]"), target, Sampling())


def test_the_ssd_drafter_goes_to_a_second_gpu_only_when_there_is_one():
    assert ssd_device("auto", torch.device("cpu")) == "cpu"
    assert ssd_device("cuda:3", torch.device("cpu")) == "cuda:3"
    expected = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    assert ssd_device("auto", torch.device("cuda:0")) == expected


def test_chains_take_every_stop_at_each_k_and_k1_once_without_one(tiny_target_dir, tmp_path):
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec

    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    save_head(tmp_path / "head", spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    for stops, labels in (("[0,0.3]", ["chain K=1", "chain K=3", "chain K=3 stop 0.3"]),
                          ("[0.3]", ["chain K=1", "chain K=3 stop 0.3"])):
        configs = build_configs(recipe(tiny_target_dir, "eval.methods=[chain]", f"eval.head={tmp_path / 'head'}",
                                       f"eval.chain.stops={stops}"), target, Sampling())[0]
        assert [c.label for c in configs[1:]] == labels
        assert [c.make().stop for c in configs[1:]] == [c.stop for c in configs[1:]] == [
            0.3 if "stop" in label else 0.0 for label in labels]


def test_chains_draft_at_each_draft_temperature_only_when_the_eval_samples(tiny_target_dir, tmp_path):
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec

    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    save_head(tmp_path / "head", spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    settings = ("eval.methods=[chain]", f"eval.head={tmp_path / 'head'}", "eval.chain.stops=[0,0.3]",
                "eval.chain.draft_temperatures=[0.5,1.5]")
    sampled = build_configs(recipe(tiny_target_dir, *settings), target, Sampling(1.0, 0, 0.9))[0][1:]
    assert [c.label for c in sampled] == [
        "chain K=1 draft T 0.5", "chain K=1 draft T 1.5", "chain K=3 draft T 0.5", "chain K=3 draft T 1.5",
        "chain K=3 stop 0.3 draft T 0.5", "chain K=3 stop 0.3 draft T 1.5"]
    # the head draws at its own temperature; the eval's top-k and top-p shape its distribution as before
    assert [c.make().sampling for c in sampled] == [Sampling(t, 0, 0.9) for t in (0.5, 1.5) * 3]
    assert [c.draft_temperature for c in sampled] == [0.5, 1.5] * 3
    # greedy: drafts are the argmax whatever the setting, one configuration per K and stop
    greedy = build_configs(recipe(tiny_target_dir, *settings), target, Sampling())[0][1:]
    assert [c.label for c in greedy] == ["chain K=1", "chain K=3", "chain K=3 stop 0.3"]
    assert all(c.draft_temperature is None and c.make().sampling == Sampling() for c in greedy)
    # none makes a distribution to draw from; nan and infinity are refused as in every float setting
    for bad, why in (("0", "a draft temperature is above 0"), ("-0.5", "a draft temperature is above 0"),
                     (".nan", "Input should be a finite number"), (".inf", "Input should be a finite number")):
        with pytest.raises(RecipeError, match=why):
            recipe(tiny_target_dir, f"eval.chain.draft_temperatures=[{bad}]")


def test_trees_take_each_way_of_choosing_children_and_draft_temperature_only_when_the_eval_samples(
        tiny_target_dir, tmp_path):
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec

    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    save_head(tmp_path / "head", spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    settings = ("eval.methods=[tree]", f"eval.head={tmp_path / 'head'}", "eval.tree.budgets=[4,8]",
                "eval.tree.children=[sampled,top,sampled]", "eval.tree.draft_temperatures=[0.85]")
    sampled = build_configs(recipe(tiny_target_dir, *settings), target, Sampling(1.0))[0][1:]
    assert [c.label for c in sampled] == ["tree N=4 draft T 0.85", "tree N=4 top draft T 0.85",
                                          "tree N=8 draft T 0.85", "tree N=8 top draft T 0.85"]
    proposers = [c.make() for c in sampled]
    assert [p.sampled for p in proposers] == [True, False] * 2
    assert all(p.sampling == Sampling(0.85) for p in proposers)
    assert [c.children for c in sampled] == ["sampled", "top"] * 2
    # greedy: the head's best tokens, one configuration per budget, whatever the settings
    greedy = build_configs(recipe(tiny_target_dir, *settings), target, Sampling())[0][1:]
    assert [c.label for c in greedy] == ["tree N=4", "tree N=8"]
    assert all(not c.make().sampled and c.children is None and c.draft_temperature is None for c in greedy)
    with pytest.raises(RecipeError, match="eval.tree.children"):
        recipe(tiny_target_dir, "eval.tree.children=[best]")
    with pytest.raises(RecipeError, match="a draft temperature is above 0"):
        recipe(tiny_target_dir, "eval.tree.draft_temperatures=[0]")


def test_a_chain_drafting_at_its_own_temperature_hands_verification_that_distribution(tiny_target_dir, tmp_path):
    """Exactness at temperature > 0 rests on verification reading the distribution each draft was drawn from."""
    from mtptrain.engine.verify import distribution
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.spec import HeadSpec

    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    head = spec.family.build(spec, FrozenTarget.of(target.model))
    proposer = spec.family.chain(head, spec, Sampling(0.5), seed=1)
    proposer.reset([1, 2, 3])
    proposer.last_feature, proposer.last_logits = None, torch.linspace(-2, 2, 64)
    draft, probs = proposer.propose([1, 2, 3], 1)
    assert len(draft) == 1
    assert torch.equal(probs.rows[0], distribution(torch.linspace(-2, 2, 64), Sampling(0.5)))
    assert not torch.equal(probs.rows[0], distribution(torch.linspace(-2, 2, 64), Sampling(1.0)))


def test_int8_drafting_weights_are_skipped_off_the_cpu_and_noted_where_torch_would_multiply_them(
        tiny_target_dir, tmp_path):
    from mtptrain.eval.methods import Drafting, draft_weights
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.runtime.native_kernels import int8_linear_kernel

    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    save_head(tmp_path / "head", spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    rec = recipe(tiny_target_dir, "eval.methods=[chain]", f"eval.head={tmp_path / 'head'}", "eval.k=[3]",
                 "eval.draft_weights=[head,int8]")
    configs, head_info, notes, modules = build_configs(rec, target, Sampling())
    assert [c.label for c in configs] == ["baseline", "chain K=3", "chain K=3 int8"]
    assert notes == ([] if int8_linear_kernel() is not None else [
        "eval.draft_weights int8: no native int8 product here for the head's torch.float32: it drafts through torch "
        "on dequantized weights (the same drafts), so its speed is not the kernel's"])
    # a head on an accelerator: the CPU kernel is not there, and a dequantizing fallback would be timed instead
    drafting = Drafting(rec, target, Sampling(), 0, head=copy.deepcopy(modules[0]).to("meta"), head_info=head_info)
    assert draft_weights(drafting) == draft_weights(drafting) == [False]
    assert drafting.notes == [
        "eval.draft_weights int8: the head runs on meta, and the int8 product is a CPU kernel (on meta its fallback "
        "would dequantize every weight at every step); skipped"]  # once, however many methods ask
    # a float64 head on the CPU drafts through the fallback: measured, with a note saying so
    drafting = Drafting(rec, target, Sampling(), 0, head=modules[0].to("cpu", torch.float64), head_info=head_info)
    assert draft_weights(drafting) == [False, True]
    assert drafting.notes == [
        "eval.draft_weights int8: no native int8 product here for the head's torch.float64: it drafts through torch "
        "on dequantized weights (the same drafts), so its speed is not the kernel's"]
