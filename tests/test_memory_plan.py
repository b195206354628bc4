"""The memory plan: what every GPU holds over the stages a recipe runs (mtptrain/memory_plan.py), checked for the
shipped GPU recipes against an 80 GiB H100, with the targets' published shapes (recipes/shapes/)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtptrain.config import load_recipe
from mtptrain.memory_plan import GIB, PlanError, TargetShape, check_plan, plan_loads

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"llama-3.1-8b-eagle3": "llama-3.1-8b", "llama-3.1-70b-eagle3": "llama-3.1-70b"}


def shape_config(name: str) -> LlamaConfig:
    return LlamaConfig(**json.loads((ROOT / "recipes" / "shapes" / f"{name}.json").read_text()))


def recipe(name: str, *overrides: str):
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


def test_the_weights_counted_are_the_models_own():
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shape = TargetShape.of(config)
    counted = shape.layers * shape.layer_params + 2 * shape.embedding_params + shape.hidden  # + the final norm
    assert counted == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shipped_gpu_recipe_fits_its_gpus_in_every_stage(name):
    loads = check_plan(recipe(name), shape_config(SHAPES[name]), 80)
    assert {load.stage for load in loads} == {"precompute", "train", "eval"}
    if name == "llama-3.1-70b-eagle3":  # the split: 40 layers and 70.6 GB of weights on each of a rank's 2 GPUs
        weights = [sum(size for what, size in load.terms if what.endswith("decoder layers") or what in ("embedding", "LM head"))
                   for load in loads if load.stage == "precompute"]
        assert [round(w / 1e9, 1) for w in weights] == [70.6, 70.6]


def test_the_70b_recipe_with_engine_validation_is_refused_with_the_reason_and_the_fix():
    """Training's main rank would load the whole 141 GB target on GPUs 0 and 1, where ranks 0 and 1 train."""
    plan = recipe("llama-3.1-70b-eagle3", "train.engine_eval.prompts=8")
    with pytest.raises(PlanError) as refused:
        check_plan(plan, shape_config("llama-3.1-70b"), 80)
    message = str(refused.value)
    assert "train, GPU 0" in message and "train, GPU 1" in message and "train, GPU 2" not in message
    assert "engine validation" in message and "train.engine_eval.prompts=0" in message


def test_a_micro_batch_too_large_for_the_gpu_is_refused_naming_the_batch():
    plan = recipe("llama-3.1-8b-eagle3", "train.micro_batch_size=64")
    with pytest.raises(PlanError, match="lower train.micro_batch_size"):
        check_plan(plan, shape_config("llama-3.1-8b"), 80, ("train",))
    loads = plan_loads(plan, shape_config("llama-3.1-8b"), ("train",))
    assert len(loads) == 8 and all(load.total > 80 * GIB for load in loads)


def test_the_training_plan_holds_the_micro_batch_as_the_gpu_rounds_it():
    """train.pad_multiple auto rounds a micro-batch up to a multiple of 64 on a GPU: 2,000 tokens are run as 2,048."""
    def activations(*overrides):
        [load] = [load for load in plan_loads(recipe("llama-3.1-8b-eagle3", *overrides), shape_config("llama-3.1-8b"),
                                              ("train",)) if load.gpu == 0]
        return dict(load.terms)["activations (7 TTT steps)"]

    assert activations("data.max_length=2000") == activations("data.max_length=2048")
    assert activations("data.max_length=2000", "train.pad_multiple=1") == pytest.approx(
        activations("data.max_length=2048") * 2000 / 2048)


def test_mtptrain_slurm_refuses_the_plan_before_writing_a_script(tmp_path):
    from typer.testing import CliRunner

    from mtptrain.cli import app

    target = tmp_path / "llama-3.1-70b"
    target.mkdir()
    (target / "config.json").write_text((ROOT / "recipes" / "shapes" / "llama-3.1-70b.json").read_text())
    common = ["slurm", "pipeline", "--dry-run", "--recipe", str(ROOT / "recipes" / "llama-3.1-70b-eagle3.yaml"),
              "--set", f"target.model={target}", "--set", f"slurm.output_dir={tmp_path / 'slurm'}"]
    refused = CliRunner().invoke(app, [*common, "--set", "train.engine_eval.prompts=8"])
    assert refused.exit_code == 1 and "train.engine_eval.prompts=0" in refused.output
    assert "sbatch" not in refused.output
    shipped = CliRunner().invoke(app, common)
    assert shipped.exit_code == 0, shipped.output
    assert "memory plan, train: fullest GPU" in shipped.output and "#!/usr/bin/env bash" in shipped.output


def test_training_on_cuda_checks_the_plan_of_the_ranks_torchrun_started(tmp_path, monkeypatch):
    """`torchrun mtptrain train` outside Slurm: the ranks on this node are LOCAL_WORLD_SIZE, the GPU's memory
    is read from the device."""
    import mtptrain.train.trainer as trainer
    from mtptrain.dist import DistInfo

    target = tmp_path / "llama-3.1-70b"
    target.mkdir()
    (target / "config.json").write_text((ROOT / "recipes" / "shapes" / "llama-3.1-70b.json").read_text())
    monkeypatch.setattr(trainer, "gpu_memory_gib", lambda device: 80.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = shape_config("llama-3.1-70b")
    shipped = recipe("llama-3.1-70b-eagle3", f"target.model={target}")
    trainer._check_memory(shipped, config, DistInfo(0, 8, 0), torch.device("cuda", 0))
    with pytest.raises(PlanError, match="train.engine_eval.prompts=0"):
        trainer._check_memory(recipe("llama-3.1-70b-eagle3", f"target.model={target}", "train.engine_eval.prompts=4"),
                              config, DistInfo(0, 8, 0), torch.device("cuda", 0))
