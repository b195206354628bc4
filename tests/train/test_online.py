"""Online training (train.online): the target computes the features in the trainer, with the batches and loss of
offline training on a store."""

import json
import subprocess

import pytest
import torch
from conftest import write_sharegpt
from safetensors.torch import load_file
from train_helpers import REPO, clean_env, train_cmd, train_recipe

from mtptrain.features.precompute import run_precompute
from mtptrain.train.trainer import run_train


def _recipe(target_dir, tmp_path, *overrides, dtype="bfloat16"):
    data = write_sharegpt(tmp_path / "chats.json", 48, seed=11)
    # precompute computes each sample alone (max_batch_size=1), as online micro-batches of one sample do: the
    # states of each sample then come from the same forward pass either way
    return train_recipe(target_dir, tmp_path / "features", tmp_path / "run", f"data.source={data}",
                        "data.max_length=160", "data.validation_fraction=0.1",
                        f"precompute.output_dir={tmp_path / 'features'}", "precompute.layers=[0, 1, 2]",
                        f"precompute.dtype={dtype}", "precompute.max_batch_size=1", "head.kind=eagle3",
                        "train.micro_batch_size=1", "train.max_steps=30", *overrides)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_online_and_offline_training_give_the_same_weights_on_the_same_data(tiny_target_dir, tmp_path, dtype):
    recipe = _recipe(tiny_target_dir, tmp_path, "train.eval_every=15", dtype=dtype)
    run_precompute(recipe, show_progress=False)
    offline = run_train(recipe.model_copy(deep=True), show_progress=False)
    online_dir = tmp_path / "online"
    online = run_train(recipe.model_copy(update={"train": recipe.train.model_copy(
        update={"online": True, "output_dir": str(online_dir), "features": str(tmp_path / "absent")})}),
        show_progress=False)
    a, b = (load_file(d / "head" / "model.safetensors") for d in (tmp_path / "run", online_dir))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for key in ("val/loss", "val/acc_1", "val/acc_3"):  # validation reads the held-out split the same way
        assert offline[key] == online[key], key
    assert not (tmp_path / "absent").exists()  # nothing was written as a store
    config = json.loads((online_dir / "head" / "config.json").read_text())
    assert config["features"]["store"] == "online"
    assert config["train"]["tokens"] == json.loads((tmp_path / "run" / "head" / "config.json").read_text())[
        "train"]["tokens"]


def test_the_pipeline_trains_online_without_a_store(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "tell me more")))
    recipe = _recipe(tiny_target_dir, tmp_path, "train.online=true", "train.micro_batch_size=4",
                     "train.max_steps=8", f"eval.prompts={prompts}", "eval.methods=[chain]", "eval.k=[2]",
                     "eval.max_new_tokens=8", "eval.repeats=1", f"eval.output_dir={tmp_path / 'eval'}")
    done = subprocess.run(train_cmd(recipe, tmp_path / "recipe.yaml")[:3] + ["pipeline", "--no-progress",
                                                                             "-r", str(tmp_path / "recipe.yaml")],
                          cwd=REPO, capture_output=True, text=True, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    stages = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert stages == ["== train", "== eval"]
    assert "online features:" in done.stderr and not (tmp_path / "features").exists()
    assert "trained 8 steps" in done.stdout and (tmp_path / "run" / "head" / "model.safetensors").is_file()
