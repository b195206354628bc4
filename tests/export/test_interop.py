"""Our exports in other projects' own model classes: vLLM's `speculators` package (0.9.0, in its own
environment), SpecForge's LlamaForCausalLMEagle3 (0.2.0) and the official EAGLE-1/2 Model (eagle-llm 1.2.1),
both imported from their unpacked wheels, load them and compute what our head computes.
scripts/setup_interop.sh provides all three; the fixture runs it (about 1.5 minutes the first time, seconds
after)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mtptrain.config import ExportConfig
from mtptrain.export.run import export_head
from mtptrain.heads import FrozenTarget
from mtptrain.export.source import load_head_directory
from mtptrain.heads.spec import HeadSpec
from mtptrain.runtime.capture import LayerCapture

from conftest import environment
from export_helpers import identity, save_trained_like_head, target_dir, target_model  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).with_name("interop")
pytestmark = pytest.mark.interop
HEAD = HeadSpec("eagle3", last_layer=5, feature_layers=[1, 2, 4], ttt_steps=3, draft_vocab_size=64)
HEAD_31 = HeadSpec("eagle3", last_layer=5, feature_layers=[1, 2, 4], ttt_steps=3, draft_vocab_size=64,
                   fc_norm=True, norm_output=True)  # EAGLE-3.1 norms
LENGTH = 128  # speculators' default flex attention takes whole 128-token blocks on CPU


@pytest.fixture(scope="session")
def interop() -> dict:
    environment("scripts/setup_interop.sh")
    return {"python": ROOT / ".venv-speculators" / "bin" / "python",
            "specforge": ROOT / "build" / "interop" / "specforge-0.2.0",
            "eagle": ROOT / "build" / "interop" / "eagle-llm-1.2.1"}


def run(cmd: list, **env) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env={**clean, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", **env})
    assert done.returncode == 0, done.stderr[-4000:]


@torch.no_grad()
def our_side(model, head, spec: HeadSpec, steps: int, seed: int = 0):
    """The inputs both sides read, and our head's output state and logits at every training-time-test step."""
    ids = torch.randint(1, model.config.vocab_size, (1, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    capture = LayerCapture(model.model.layers, spec.feature_layers)
    model(ids)
    states = capture.take()
    capture.close()
    layers = [states[j].float() for j in spec.feature_layers]
    outputs = head.unroll(head.fuse(layers), ids, steps)
    inputs = {"hidden_states": torch.cat(layers, -1)[:, :LENGTH].contiguous(),
              "input_ids": ids[:, 1 : LENGTH + 1].contiguous()}
    return inputs, [o[0] for o in outputs], [head.logits(o)[0] for o in outputs]


def assert_same_drafts(ours: torch.Tensor, theirs: torch.Tensor, atol: float) -> None:
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < atol
    top2 = ours.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol  # positions that are not float near-ties
    assert clear.float().mean() > 0.9
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.parametrize("spec", [HEAD, HEAD_31], ids=["eagle3", "eagle3.1-norms"])
def test_speculators_loads_our_export_and_computes_our_logits_at_every_ttt_step(interop, target_dir, tmp_path, spec):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", spec)
    export_head(head_dir, tmp_path / "export", ExportConfig(format="speculators", verifier=str(target_dir)))
    model = target_model(target_dir)
    head, spec = load_head_directory(head_dir, FrozenTarget.of(model), identity(target_dir))
    inputs, _, logits = our_side(model, head, spec, steps=3)
    save_file(inputs, tmp_path / "inputs.safetensors")
    run([interop["python"], SCRIPTS / "speculators_forward.py", tmp_path / "export", tmp_path / "inputs.safetensors",
         tmp_path / "out.safetensors", 3])
    theirs = load_file(tmp_path / "out.safetensors")
    assert bytes(theirs["attention"].tolist()).decode() == "simple_flex_attention"  # its default attention
    assert torch.equal(theirs["d2t"], load_file(tmp_path / "export" / "model.safetensors")["d2t"])
    for step in range(3):  # step k covers the positions whose token k ahead is known
        valid = LENGTH - step
        assert_same_drafts(logits[step], theirs[f"logits.{step}"][:valid], atol=1e-4)
        assert torch.equal(theirs[f"draft.{step}"][:valid], logits[step].argmax(-1))


def test_specforge_loads_our_sglang_export_and_computes_our_first_step(interop, target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", HEAD)
    export_head(head_dir, tmp_path / "export", ExportConfig(format="eagle3"))
    model = target_model(target_dir)
    head, spec = load_head_directory(head_dir, FrozenTarget.of(model), identity(target_dir))
    inputs, states, logits = our_side(model, head, spec, steps=1, seed=1)
    save_file(inputs, tmp_path / "inputs.safetensors")
    run([sys.executable, SCRIPTS / "specforge_forward.py", interop["specforge"], tmp_path / "export", target_dir,
         tmp_path / "inputs.safetensors", tmp_path / "out.safetensors"], TORCHDYNAMO_DISABLE="1")
    theirs = load_file(tmp_path / "out.safetensors")
    assert (states[0] - theirs["hidden"]).abs().max().item() < 1e-4
    assert_same_drafts(logits[0], theirs["logits"], atol=1e-4)


def test_the_official_eagle_model_loads_our_eagle_export_and_computes_our_states(interop, target_dir, tmp_path):
    spec = HeadSpec("eagle", norms="stripped", last_layer=5)
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", spec)
    export_head(head_dir, tmp_path / "export", ExportConfig(format="eagle"))
    model = target_model(target_dir)
    head, _ = load_head_directory(head_dir, FrozenTarget.of(model), identity(target_dir))
    ids = torch.randint(1, model.config.vocab_size, (1, 41), generator=torch.Generator().manual_seed(2))
    capture = LayerCapture(model.model.layers, [5])
    with torch.no_grad():
        model(ids)
        features = head.features(capture.take()[5][:, :40])  # EAGLE-1 reads the target's final-normed states
        ours = head(features, ids[:, 1:41])[0]
    capture.close()
    save_file({"hidden_states": features.contiguous(), "input_ids": ids[:, 1:41].contiguous()},
              tmp_path / "inputs.safetensors")
    run([sys.executable, SCRIPTS / "eagle_forward.py", interop["eagle"], tmp_path / "export", target_dir,
         tmp_path / "inputs.safetensors", tmp_path / "out.safetensors"])
    theirs = load_file(tmp_path / "out.safetensors")["hidden"]
    assert (ours - theirs).abs().max().item() < 1e-5
    assert torch.equal(head.logits(ours).argmax(-1), head.logits(theirs).argmax(-1))


@pytest.mark.real_model
def test_speculators_runs_the_shipped_head_on_smollm2_as_we_do(interop, tmp_path):
    """The reference head (bf16) exported against the real target: the same drafts in speculators and in ours.
    The logits differ by up to 0.004 here (about 1e-3 of their range; position 0 by 1e-5), so the bound is 1e-2."""
    from mtptrain.heads.checkpoint import PRETRAINED_HEAD
    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target, resolve_local_dir

    # bfloat16, not the machine's measured choice: the export's embeddings are the verifier's in bfloat16, which a
    # float32 target (what a measurement taken under load may pick) holds unrounded, 0.015 apart in the logits
    cfg = TargetConfig(dtype="bfloat16")
    verifier, _ = resolve_local_dir(cfg)
    export_head(PRETRAINED_HEAD, tmp_path / "export", ExportConfig(format="speculators", verifier=verifier))
    target = load_target(cfg)
    head, spec = load_head_directory(tmp_path / "export", FrozenTarget.of(target.model), target.identity())
    head.float()
    inputs, _, logits = our_side(target.model, head, spec, steps=2)
    save_file(inputs, tmp_path / "inputs.safetensors")
    run([interop["python"], SCRIPTS / "speculators_forward.py", tmp_path / "export", tmp_path / "inputs.safetensors",
         tmp_path / "out.safetensors", 2])
    theirs = load_file(tmp_path / "out.safetensors")
    for step in range(2):
        assert_same_drafts(logits[step], theirs[f"logits.{step}"][: LENGTH - step], atol=1e-2)


def test_speculators_trains_on_our_store_and_its_checkpoint_drafts_in_our_engine(interop, target_dir, tmp_path):
    """The peer trainer side by side: our store in speculators' offline format, its trainer (on a CPU, through
    scripts/speculators_train_cpu.py), and its checkpoint imported as our head, which computes the logits its own
    model class computes at every TTT step."""
    from conftest import tiny_recipe, write_sharegpt

    from mtptrain.config import TargetConfig
    from mtptrain.features.precompute import run_precompute
    from mtptrain.peers.speculators import PeerError, import_checkpoint, write_offline_data

    recipe = tiny_recipe(target_dir, write_sharegpt(tmp_path / "c.json", 60, seed=2), tmp_path / "features",
                         layers="[1, 2, 4]", dtype="bfloat16")
    run_precompute(recipe, show_progress=False)
    data = write_offline_data(tmp_path / "features", tmp_path / "data", [1, 2, 4], 64, show_progress=False)
    assert data["target_layer_ids"] == [2, 3, 5] and data["rows"] == data["train"] + data["validation"] == 60
    sample = load_file(tmp_path / "data" / "hidden_states" / "hs_0.safetensors")
    assert sample["hidden_states"].shape == (len(sample["token_ids"]), 4, 64)
    with pytest.raises(PeerError, match="another store or other layers"):  # its files would be mixed in
        write_offline_data(tmp_path / "features", tmp_path / "data", [4, 2, 1], 64, show_progress=False)
    run([interop["python"], ROOT / "scripts" / "speculators_train_cpu.py", "--verifier-name-or-path", target_dir,
         "--data-path", tmp_path / "data", "--save-path", tmp_path / "ckpt", "--epochs", 1, "--lr", "3e-3",
         "--total-seq-len", 512, "--ttt-steps", 3, "--draft-vocab-size", 64, "--target-layer-ids", 2, 3, 5,
         "--no-norm-before-residual", "--no-norm-before-fc", "--fc-norm", "--norm-output", "--draft-attn-impl",
         "sdpa", "--loss-implementation", "eager", "--on-missing", "raise", "--num-workers", 0,
         "--train-data-ratio", data["train_data_ratio"], "--optimizer", "adamw", "--seed", 0])
    checkpoint = tmp_path / "ckpt" / "checkpoint_best"
    config = import_checkpoint(checkpoint, TargetConfig(model=str(target_dir)), tmp_path / "head")
    assert config["head"]["feature_layers"] == [1, 2, 4] and config["head"]["fc_norm"] and config["imported"]
    model = target_model(target_dir)
    head, spec = load_head_directory(tmp_path / "head", FrozenTarget.of(model), identity(target_dir))
    # both heads predict over the draft vocabulary the store's training split gives ours
    assert torch.equal(head.draft_to_target - torch.arange(64), torch.from_numpy(np.load(tmp_path / "data" / "d2t-64.npy")))
    head.float()
    inputs, _, logits = our_side(model, head, spec, steps=3)
    save_file(inputs, tmp_path / "inputs.safetensors")
    run([interop["python"], SCRIPTS / "speculators_forward.py", checkpoint, tmp_path / "inputs.safetensors",
         tmp_path / "out.safetensors", 3])
    theirs = load_file(tmp_path / "out.safetensors")
    for step in range(3):  # its weights are bf16, both sides compute in float32: 5e-4 apart at most here
        assert_same_drafts(logits[step], theirs[f"logits.{step}"][: LENGTH - step], atol=2e-3)


def test_a_speculators_checkpoint_with_a_norm_placement_we_lack_is_refused_with_the_flags(tmp_path):
    from mtptrain.config import TargetConfig
    from mtptrain.peers.speculators import PeerError, import_checkpoint

    (tmp_path / "config.json").write_text('{"speculators_model_type": "eagle3", "norm_before_residual": true}')
    with pytest.raises(PeerError, match="--no-norm-before-residual --no-norm-before-fc"):
        import_checkpoint(tmp_path, TargetConfig(model=str(tmp_path)), tmp_path / "head")
