"""The DeepSpeed trainer on a tiny random target: learning, frozen parts, checkpoints, resume, ranks, guards."""

import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, clean_env, train_cmd, train_recipe

from mtptrain.config import validate_recipe
from mtptrain.errors import MtptrainError
from mtptrain.features.store import FeatureStoreError
from mtptrain.heads.checkpoint import PRETRAINED_HEAD
from mtptrain.train.trainer import TrainingDiverged, run_fingerprint, run_train

VOCAB = 400


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# EAGLE-3 learns a 3-step unroll and its own LM head: it gets more steps (it reaches 0.94 / 0.91 / 0.86
# top-1 agreement at positions 1 / 2 / 3 after 8 epochs of this data).
BUDGET = {"eagle": ["train.epochs=3"], "mtp": ["train.epochs=3"], "eagle3": ["train.epochs=5", "train.lr=1e-2"]}


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_loss_falls_and_agreement_rises_far_above_chance(tiny_target_dir, tiny_store, tmp_path, kind):
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", f"head.kind={kind}", *BUDGET[kind])
    summary = run_train(recipe, show_progress=False)
    logged = [m for m in _metrics(tmp_path / "run") if "train/kl_1" in m]
    assert logged[-1]["train/kl_1"] < 0.3 * logged[0]["train/kl_1"]
    assert logged[-1]["train/acc_1"] > logged[0]["train/acc_1"] + 0.3
    assert summary["val/acc_1"] > 0.4  # chance: 1/400 (1/128 within eagle3's draft vocabulary)
    positions = {"eagle": 1, "eagle3": 3, "mtp": 2}[kind]
    assert sorted(k for k in summary if k.startswith("val/acc")) == [f"val/acc_{p}" for p in range(1, positions + 1)]


def test_frozen_target_is_untouched_and_never_saved(tiny_target_dir, tiny_store, tmp_path):
    from transformers import AutoModelForCausalLM

    import mtptrain.train.trainer as trainer_module

    seen = {}
    original_init = trainer_module.Trainer.__init__

    def keep(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["model"] = self.target.model

    trainer_module.Trainer.__init__ = keep
    try:
        run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle3",
                               "train.max_steps=8", "train.checkpoint_every=4"), show_progress=False)
    finally:
        trainer_module.Trainer.__init__ = original_init
    fresh = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).state_dict()
    # Training reads the frozen parts alone: the decoder layers were never loaded.
    loaded = {name: t for name, t in seen["model"].state_dict().items() if t.device.type != "meta"}
    assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert all(t.device.type == "meta" for t in seen["model"].model.layers.state_dict().values())
    for name, tensor in loaded.items():
        assert torch.equal(tensor, fresh[name]), name
    exported = load_file(tmp_path / "run" / "head" / "model.safetensors")
    assert exported and not any(VOCAB in t.shape and t.dim() == 2 for t in exported.values())
    for state_file in (tmp_path / "run" / "checkpoints").glob("*/mp_rank_00_model_states.pt"):
        state = torch.load(state_file, map_location="cpu", weights_only=False)["module"]  # our own file
        assert not any("embed_tokens" in k or "lm_head.weight" == k and v.shape[0] == VOCAB for k, v in state.items())
        assert not any(v.dim() == 2 and v.shape[0] == VOCAB for v in state.values())
    assert len(list((tmp_path / "run" / "checkpoints").glob("step-*"))) == 2
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-0000008"
    config = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert config["head"]["kind"] == "eagle3" and config["target"]["fingerprint"]


def test_a_store_of_another_target_is_refused_before_training(other_target_dir, tiny_store, tmp_path):
    with pytest.raises(FeatureStoreError, match="same target.model"):
        run_train(train_recipe(other_target_dir, tiny_store, tmp_path / "run"), show_progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_head_records_the_stores_target_whether_loaded_in_part_or_whole(tiny_target_dir, tiny_store, tmp_path,
                                                                            monkeypatch):
    import mtptrain.train.trainer as trainer_module

    whole_loads = []
    load_whole = trainer_module.load_target
    monkeypatch.setattr(trainer_module, "load_target", lambda *a, **k: whole_loads.append(1) or load_whole(*a, **k))
    manifest = json.loads((tiny_store / "manifest.json").read_text())
    run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "part", "train.max_steps=2"), show_progress=False)
    assert json.loads((tmp_path / "part" / "head" / "config.json").read_text())["target"] == manifest["target"]
    assert not whole_loads
    # A store written before frozen-part fingerprints has none to check a partial load against: the whole
    # target is loaded and checked instead.
    old = tmp_path / "old-store"
    shutil.copytree(tiny_store, old)
    del manifest["target"]["frozen_fingerprint"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    run_train(train_recipe(tiny_target_dir, old, tmp_path / "whole", "train.max_steps=2"), show_progress=False)
    recorded = json.loads((tmp_path / "whole" / "head" / "config.json").read_text())["target"]
    assert recorded["fingerprint"] == manifest["target"]["fingerprint"] and whole_loads == [1]


def test_layers_the_store_lacks_are_refused_before_training(tiny_target_dir, tiny_store, tmp_path):
    with pytest.raises(FeatureStoreError, match=r"layers \[5\] were not captured"):
        run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle3",
                               "head.feature_layers=[1, 5]"), show_progress=False)


def test_divergence_stops_with_the_step_and_the_last_good_checkpoint(tiny_target_dir, tiny_store, tmp_path):
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle", "train.max_steps=40",
                          "train.lr=1e30", "train.warmup_ratio=0", "train.grad_clip=0", "train.checkpoint_every=1")
    with pytest.raises(TrainingDiverged, match=r"not finite at step \d+; last good checkpoint: .*step-\d+"):
        run_train(recipe, show_progress=False)


def test_kill_and_resume_gives_the_weights_of_an_uninterrupted_run(tiny_target_dir, tiny_store, tmp_path):
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "x", "head.kind=mtp", "train.max_steps=24",
                          "train.checkpoint_every=6", "train.grad_accum=2")
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    subprocess.run(train_cmd(recipe, tmp_path / "r.yaml", f"train.output_dir={clean}"), cwd=REPO, check=True,
                   capture_output=True, env=clean_env())
    proc = subprocess.Popen(train_cmd(recipe, tmp_path / "r.yaml", f"train.output_dir={killed}"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env())
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 180
    while not latest.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    stopped_at = latest.read_text().strip()
    assert stopped_at != "step-0000024" and not (killed / "head").exists()
    resumed = subprocess.run(train_cmd(recipe, tmp_path / "r.yaml", f"train.output_dir={killed}"), cwd=REPO,
                             capture_output=True, text=True, env=clean_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_step = int(stopped_at.removeprefix("step-"))
    assert f"resumed from {killed / 'checkpoints' / stopped_at} at step {resumed_step}" in resumed.stderr
    a, b = (load_file(d / "head" / "model.safetensors") for d in (clean, killed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name
    # The metrics after the resume continue the same curve.
    steps = [m["step"] for m in _metrics(killed) if "train/loss" in m]
    assert steps == sorted(set(steps)) and steps[-1] == 24  # rows past the checkpoint were not kept twice


def test_a_changed_recipe_does_not_resume_another_runs_checkpoint(tiny_target_dir, tiny_store, tmp_path):
    from mtptrain.train.trainer import RunMismatch

    run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle", "train.max_steps=2"),
              show_progress=False)
    with pytest.raises(RunMismatch, match="another run"):
        run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle",
                               "train.max_steps=2", "train.lr=1e-4"), show_progress=False)


@pytest.mark.multiprocess
def test_two_process_zero2_matches_one_process_with_the_same_global_batch(tiny_target_dir, tiny_store, tmp_path):
    """torchrun, the deepspeed launcher and bare srun-style tasks (ranks and rendezvous from Slurm's variables)."""
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "x", "head.kind=eagle", "train.max_steps=10",
                          "train.zero_stage=2", "train.checkpoint_every=1000")
    cmd = train_cmd(recipe, tmp_path / "r.yaml")
    python, module_args = cmd[0], cmd[1:]
    runs = {"one": None, "torchrun": [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
            "deepspeed": [python, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port",
                          "29561", "--no_local_rank"]}
    for name, launcher in runs.items():
        out = [f"train.output_dir={tmp_path / name}", f"train.grad_accum={2 if launcher is None else 1}"]
        args = module_args + [a for o in out for a in ("--set", o)]
        full = [python, *args] if launcher is None else launcher + (["--module"] + args[1:] if name == "deepspeed"
                                                                     else args)
        run = subprocess.run(full, cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
        assert run.returncode == 0, (name, run.stderr[-3000:])
        # DeepSpeed's shared-memory all-reduce serves its inference only: training neither builds nor loads it
        assert "shm_comm" not in run.stdout + run.stderr, (name, run.stdout[-2000:])
    srun_args = module_args + ["--set", f"train.output_dir={tmp_path / 'srun'}", "--set", "train.grad_accum=1"]
    tasks = [subprocess.Popen([python, *srun_args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**clean_env(), "SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "2",
                                   "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                                   "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}) for r in range(2)]
    for task in tasks:
        _, err = task.communicate(timeout=600)
        assert task.returncode == 0, err.decode()[-3000:]
    reference = load_file(tmp_path / "one" / "head" / "model.safetensors")
    for name in ("torchrun", "deepspeed", "srun"):
        weights = load_file(tmp_path / name / "head" / "model.safetensors")
        for key in reference:
            assert torch.allclose(reference[key], weights[key], atol=2e-5, rtol=1e-4), (name, key)
        a, b = ([m for m in _metrics(tmp_path / d) if "train/loss" in m][-1] for d in ("one", name))
        assert a["step"] == b["step"] == 10 and abs(a["train/loss"] - b["train/loss"]) < 1e-4


def test_slurm_rendezvous_from_the_step_variables():
    from mtptrain.dist import slurm_rendezvous

    env = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    assert slurm_rendezvous(env) == ("10.0.0.7", str(15000 + 123456 % 20000))
    assert slurm_rendezvous({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "16"}) is None  # a batch script, not a step


def test_the_offline_wandb_run_holds_the_logged_metrics(tiny_target_dir, tiny_store, tmp_path):
    from conftest import read_offline_wandb_run

    run_dir = tmp_path / "run"
    recipe = train_recipe(tiny_target_dir, tiny_store, run_dir, "head.kind=eagle3", "train.max_steps=10",
                          "train.log_every=2", "train.eval_every=5", "tracking.wandb=offline", "name=wb",
                          "tracking.group=wb-1", "export.format=speculators")
    summary = run_train(recipe, show_progress=False)
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = read_offline_wandb_run(run_file)
    history = run["history"]
    assert (run["group"], run["job_type"]) == ("wb-1", "train")
    config = {k: v for k, v in run["config"].items() if k != "_wandb"}  # W&B's own bookkeeping key
    assert config == recipe.model_dump(mode="json")  # the resolved recipe, nothing else
    assert run["summary"]["val/acc_1"] == pytest.approx(summary["val/acc_1"])
    (artifact,) = run["artifacts"]
    assert (artifact["name"], artifact["type"]) == ("wb-head", "model")
    assert {"head/model.safetensors", "head/config.json", "export-speculators/model.safetensors",
            "export-speculators/config.json", "export-speculators/README.md"} <= set(artifact["files"])
    by_step: dict = {}  # W&B merges what is logged at one step into one row
    for line in _metrics(run_dir):
        by_step.setdefault(line.pop("step"), {}).update(line)
    assert [row["_step"] for row in history] == sorted(by_step) and len(by_step) >= 5
    for row in history:
        for key, value in by_step[row["_step"]].items():
            assert row[key] == pytest.approx(value), key
    assert {"train/loss", "train/acc_1", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(history[0])
    assert any("val/acc_1" in row for row in history)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_bf16_target_trains_an_fp32_head(tiny_target_dir, tiny_store, tmp_path, kind):
    """The mix a GPU run has by default (target bf16, head weights fp32 here), reproduced on the CPU."""
    summary = run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", f"head.kind={kind}",
                                     "target.dtype=bfloat16", "train.precision=fp32", "train.max_steps=3"),
                        show_progress=False)
    assert summary["steps"] == 3
    exported = load_file(tmp_path / "run" / "head" / "model.safetensors")
    assert {t.dtype for t in exported.values() if t.is_floating_point()} == {torch.float32}


def test_head_snapshots_record_their_tokens_and_load_like_the_final_head(tiny_target_dir, tiny_store, tmp_path):
    from mtptrain.features.store import FeatureStore
    from mtptrain.heads.checkpoint import load_head
    from mtptrain.heads.common import FrozenTarget
    from mtptrain.target import load_target
    from mtptrain.train.data import BatchPlan

    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle3", "train.max_steps=6",
                          "train.checkpoint_every=3", "train.head_snapshots=true", "train.head_dtype=bfloat16")
    run_train(recipe, show_progress=False)
    snapshots = sorted((tmp_path / "run" / "snapshots").glob("step-*"))
    assert [s.name for s in snapshots] == ["step-0000003", "step-0000006"]
    lengths = FeatureStore(tiny_store).lengths()
    plan = BatchPlan(lengths, 4, 0, world_size=1, rank=0, steps=6, grad_accum=1).global_sequence()
    expected = [sum(lengths[i] for batch in plan[:n] for i in batch) for n in (3, 6)]
    assert [json.loads((s / "config.json").read_text())["train"]["tokens"] for s in snapshots] == expected
    final = load_file(tmp_path / "run" / "head" / "model.safetensors")
    assert {t.dtype for t in final.values() if t.is_floating_point()} == {torch.bfloat16}
    assert final["draft_to_target"].dtype == torch.long
    last = load_file(snapshots[-1] / "model.safetensors")  # snapshots keep the training dtype
    assert all(torch.equal(last[k].to(torch.bfloat16), v) if v.is_floating_point() else torch.equal(last[k], v)
               for k, v in final.items())
    target = load_target(recipe.target)
    head, spec = load_head(tmp_path / "run" / "head", FrozenTarget.of(target.model), target.identity())
    assert spec.kind == "eagle3" and next(head.parameters()).dtype == torch.float32


def test_the_step_count_for_a_token_budget_is_the_nearest_in_the_trainers_order():
    from mtptrain.train.data import BatchPlan, steps_for_tokens

    lengths = [random.Random(i).randint(20, 300) for i in range(50)]
    plan = BatchPlan(lengths, 4, 7, world_size=1, rank=0, steps=40, grad_accum=1).global_sequence()
    seen = [0]
    for batch in plan:
        seen.append(seen[-1] + sum(lengths[i] for i in batch))
    for tokens in (1, seen[3], seen[3] + 1, (seen[10] + seen[11]) // 2, seen[30] - 1, seen[39]):  # 30: a 3rd epoch
        steps = steps_for_tokens(lengths, 4, 7, tokens)
        assert steps >= 1 and abs(seen[steps] - tokens) == min(abs(t - tokens) for t in seen[1:]), tokens
    with pytest.raises(ValueError):
        steps_for_tokens([], 4, 7, 100)


def test_rerunning_a_finished_run_keeps_its_summary_and_export_settings_do_not_split_runs(tiny_target_dir, tiny_store,
                                                                                           tmp_path):
    args = (tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle", "train.max_steps=4")
    first = run_train(train_recipe(*args), show_progress=False)
    head = (tmp_path / "run" / "head" / "model.safetensors").read_bytes()
    again = run_train(train_recipe(*args, "train.head_snapshots=true", "train.head_dtype=bfloat16"),
                      show_progress=False)  # same run: export settings are not part of its identity
    assert again == first and "val/acc_1" in again
    assert (tmp_path / "run" / "head" / "model.safetensors").read_bytes() == head
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == first


def test_a_stop_file_checkpoints_and_stops_and_the_rerun_ends_as_an_uninterrupted_run(tiny_target_dir, tiny_store,
                                                                                      tmp_path):
    """What the Slurm train job does on its warning signal: STOP in the run directory, then a requeue."""
    args = (tiny_target_dir, tiny_store, "head.kind=eagle", "train.max_steps=6", "train.checkpoint_every=100")
    run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "clean", *args[2:]), show_progress=False)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "STOP").touch()
    first = run_train(train_recipe(tiny_target_dir, tiny_store, stopped, *args[2:]), show_progress=False)
    assert first["stopped"] and first["steps"] == 1 and not (stopped / "head").exists()
    assert not (stopped / "STOP").exists()
    assert json.loads((stopped / "REQUEUE").read_text()) == {"step": 1, "checkpoint": str(stopped / "checkpoints" /
                                                                                         "step-0000001")}
    again = run_train(train_recipe(tiny_target_dir, tiny_store, stopped, *args[2:]), show_progress=False)
    assert again["steps"] == 6 and not again.get("stopped") and not (stopped / "REQUEUE").exists()
    a, b = (load_file(d / "head" / "model.safetensors") for d in (tmp_path / "clean", stopped))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name


def test_auto_precision_on_a_cpu_follows_what_the_machine_multiplies_fastest(monkeypatch, tiny_target_dir):
    from transformers import AutoConfig

    import mtptrain.train.optimization as optimization
    from mtptrain.runtime.choice import Choice
    from mtptrain.train.optimization import autocast, pick_precision

    config = AutoConfig.from_pretrained(tiny_target_dir)
    cpu = torch.device("cpu")
    for measured, expected in ((torch.bfloat16, "bf16-autocast"), (torch.float32, "fp32")):
        monkeypatch.setattr(optimization, "choose", lambda c, d, m=measured: Choice(m, "linear", "sdpa", "sdpa",
                                                                                      "measured"))
        assert pick_precision("auto", cpu, config) == expected
        assert pick_precision("fp32", cpu, config) == "fp32"  # a set precision is kept
    assert pick_precision("auto", torch.device("cuda")) == "bf16"
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with autocast("bf16-autocast", cpu):
        out = x @ w
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32  # products in bf16, weights kept in fp32
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32
    with autocast("fp32", cpu):
        assert (x @ w).dtype == torch.float32


def test_an_acceptance_loss_trains_and_every_run_logs_alpha(tiny_target_dir, tiny_store, tmp_path):
    """train.loss=lk-hybrid: the KL falls and the logged expected acceptance (alpha) per position rises. (The tiny
    random target spreads its mass widely, so alpha starts high: about 0.9.)"""
    recipe = train_recipe(tiny_target_dir, tiny_store, tmp_path / "run", "head.kind=eagle3", "train.loss=lk-hybrid",
                          *BUDGET["eagle3"])
    summary = run_train(recipe, show_progress=False)
    logged = [m for m in _metrics(tmp_path / "run") if "train/alpha_1" in m]
    assert {"train/loss_1", "train/kl_3", "train/alpha_3"} <= logged[0].keys()
    assert logged[-1]["train/kl_1"] < 0.5 * logged[0]["train/kl_1"]
    for p in (1, 2, 3):
        assert logged[-1][f"train/alpha_{p}"] > logged[0][f"train/alpha_{p}"]
    assert summary["val/alpha_1"] > 0.4 and summary["val/acc_1"] > 0.4


def _first_update(tiny_target_dir, tiny_store, tmp_path, *overrides) -> dict[str, torch.Tensor]:
    """Each trained tensor's first moving optimizer step at unit learning rate: the difference of two two-step
    runs from the same initialisation at lr 1e-3 and 2e-3, divided by 1e-3 (no warmup or weight decay; the
    default gradient clipping, which Muon's updates must escape). DeepSpeed's schedule gives the first step a
    rate of 0, so the second is the first that moves."""
    heads = []
    for lr in ("1e-3", "2e-3"):
        run = tmp_path / f"lr{lr}"
        run_train(train_recipe(tiny_target_dir, tiny_store, run, "head.kind=eagle3", "train.max_steps=2",
                               f"train.lr={lr}", "train.warmup_ratio=0", "train.grad_clip=1.0",
                               "train.muon_weight_decay=0", "train.head_dtype=float32", *overrides),
                  show_progress=False)
        heads.append(load_file(run / "head" / "model.safetensors"))
    return {k: (heads[1][k].double() - heads[0][k].double()) / 1e-3 for k in heads[0]
            if heads[0][k].is_floating_point()}


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


def _flatness(t: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(t)
    return float(singular[: len(singular) // 2].min() / singular[0])


def test_muon_gives_the_matrices_orthogonalised_updates_of_adamws_size(tiny_target_dir, tiny_store, tmp_path):
    """AdamW's early steps move every weight by up to lr (its update is m / sqrt(v), close to the gradient's sign).
    Under Muon each matrix's update is its orthogonalised momentum scaled to 0.2 lr RMS where the gradient has
    full rank (torch's match_rms_adamw rule), so its singular values are alike; norms and biases keep AdamW's step."""
    adamw = _first_update(tiny_target_dir, tiny_store, tmp_path / "adamw")
    muon = _first_update(tiny_target_dir, tiny_store, tmp_path / "muon", "train.optimizer=muon")
    matrices = [k for k, t in muon.items() if t.dim() == 2 and min(t.shape) > 1 and "lm_head" not in k]
    assert "fc.weight" in matrices and any("o_proj" in k for k in matrices) and any("down_proj" in k for k in matrices)
    for name in matrices:
        assert 0.5 < _rms(adamw[name]) < 1.01, name
        assert 0.05 < _rms(muon[name]) < 0.25, name  # 0.2 where the gradient has full rank
        # how flat the update's singular values are (the smallest of the top half against the largest): a
        # sign matrix spreads them widely, an orthogonalised one lifts them towards one another
        assert _flatness(muon[name]) > 3 * _flatness(adamw[name]), name
    # fc's gradient has full rank: 0.2 lr RMS (without the per-matrix rate it would be lr / sqrt(its 3H inputs))
    assert 0.12 < _rms(muon["fc.weight"]) < 0.25
    for name in (k for k, t in muon.items() if t.dim() == 1 and _rms(t) > 0):
        assert 0.5 < _rms(muon[name]) < 1.01, name  # norms: AdamW's step
    assert _rms(muon["lm_head.weight"]) > 0.5  # the LM head is AdamW's too


def test_a_frozen_draft_lm_head_keeps_the_targets_rows(tiny_target_dir, tiny_store, tmp_path):
    from transformers import AutoModelForCausalLM

    rows = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).lm_head.weight
    for mode in ("frozen", "trained"):
        run = tmp_path / mode
        run_train(train_recipe(tiny_target_dir, tiny_store, run, "head.kind=eagle3", "train.max_steps=3",
                               "train.head_dtype=float32", f"train.draft_lm_head={mode}"), show_progress=False)
        head = load_file(run / "head" / "model.safetensors")
        kept = torch.equal(head["lm_head.weight"], rows[head["draft_to_target"]])
        assert kept == (mode == "frozen"), mode


def test_a_recipe_keeps_the_run_fingerprint_its_checkpoints_recorded():
    """A checkpoint is resumed only under its run's fingerprint, which holds the head section in the flat layout
    (every family's fields): the reference run's recipe, as its shipped head records it, has the one it was
    trained under."""
    recorded = json.loads((PRETRAINED_HEAD / "config.json").read_text())["train"]["recipe"]
    assert run_fingerprint(validate_recipe(recorded), {"plan_id": "p"}, 1) == "22b51b0114e4eadb"


def _checkpointed(run_dir, step):
    """The live weights and the weight average a checkpoint of `run_dir` holds at `step`."""
    from mtptrain.train.checkpoints import WeightsOnlyLoads

    states = WeightsOnlyLoads(None).load(str(run_dir / "checkpoints" / f"step-{step:07d}" /
                                             "mp_rank_00_model_states.pt"))
    return states["module"], states["ema"]


def test_the_weight_average_is_exported_and_a_resumed_run_averages_on(tiny_target_dir, tiny_store, tmp_path):
    """train.ema_decay: each step's average is the last one moved toward that step's live weights by the ramped
    decay (read back from a checkpoint a step); the export is the last average, not the live weights; a run
    resumed from its third step exports the same average."""
    from mtptrain.train.averaging import ramped

    args = ("head.kind=eagle", "train.max_steps=6", "train.checkpoint_every=1", "train.ema_decay=0.7")
    clean = tmp_path / "clean"
    run_train(train_recipe(tiny_target_dir, tiny_store, clean, *args), show_progress=False)
    for step in range(2, 7):
        _, before = _checkpointed(clean, step - 1)
        live, after = _checkpointed(clean, step)
        d = ramped(0.7, step)
        assert d == (0.7 if step >= 15 else (1 + step) / (10 + step))
        for name, average in after.items():
            assert torch.allclose(average, d * before[name] + (1 - d) * live[name].float(), atol=1e-6), (step, name)
    live, average = _checkpointed(clean, 6)
    exported = load_file(clean / "head" / "model.safetensors")
    assert average.keys() <= exported.keys()
    assert all(torch.equal(exported[name], average[name]) for name in average)
    assert any(not torch.allclose(exported[name], live[name], atol=1e-4) for name in average)
    resumed = tmp_path / "resumed"  # the clean run as if killed after step 3
    shutil.copytree(clean / "checkpoints", resumed / "checkpoints",
                    ignore=lambda _, names: [n for n in names if n.startswith("step-") and n > "step-0000003"])
    (resumed / "checkpoints" / "latest").write_text("step-0000003")
    run_train(train_recipe(tiny_target_dir, tiny_store, resumed, *args), show_progress=False)
    again = load_file(resumed / "head" / "model.safetensors")
    for name in average:
        assert torch.allclose(again[name], exported[name], atol=1e-6, rtol=1e-5), name


def test_a_weight_average_is_swapped_in_and_the_live_weights_come_back_bit_for_bit():
    from mtptrain.train.averaging import WeightAverage

    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    head[1].weight.requires_grad_(False)  # a frozen parameter is not averaged
    average = WeightAverage(head, 0.5)
    first = {n: p.detach().clone() for n, p in head.named_parameters()}
    with torch.no_grad():
        for p in head.parameters():
            p.add_(1.0)
    average.update(1)  # ramped: min(0.5, 2 / 11)
    live = {n: p.detach().clone() for n, p in head.named_parameters()}
    assert "1.weight" not in average.average
    with pytest.raises(RuntimeError, match="inside"):
        with average.applied():
            for name, p in head.named_parameters():
                if name in average.average:
                    expected = (2 / 11 * first[name].float() + 9 / 11 * live[name].float()).to(torch.bfloat16)
                    assert torch.equal(p, expected), name
                else:
                    assert torch.equal(p, live[name])
            raise RuntimeError("inside")
    assert all(torch.equal(p, live[n]) for n, p in head.named_parameters())
    with pytest.raises(MtptrainError, match="somewhere holds no weight average .* fresh train.output_dir"):
        average.load_state_dict({"0.weight": torch.zeros(3, 4)}, "somewhere")
    state = average.state_dict()
    with pytest.raises(MtptrainError, match="no weight average"):
        average.load_state_dict({**state, "0.bias": state["0.bias"].long()}, "somewhere")
    average.load_state_dict(state, "somewhere")  # its own state loads back


def test_the_top_k_term_reaches_the_trained_loss_and_makes_another_run(tiny_target_dir, tiny_store, tmp_path):
    """train.topk_loss: the first step's loss (the same initial weights and batch) is the plain run's plus the
    top-K cross-entropy, which is positive; the recipe with it does not resume the plain run's checkpoints."""
    from mtptrain.train.trainer import RunMismatch

    first = {}
    for name, extra in (("plain", []), ("topk", ["train.topk_loss=5"])):
        run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / name, "head.kind=eagle3", "train.max_steps=1",
                               *extra), show_progress=False)
        first[name] = _metrics(tmp_path / name)[0]
    assert first["topk"]["train/kl_1"] == pytest.approx(first["plain"]["train/kl_1"], rel=1e-6)
    assert first["topk"]["train/loss_1"] > first["plain"]["train/loss_1"] + 0.1
    with pytest.raises(RunMismatch, match="another run"):
        run_train(train_recipe(tiny_target_dir, tiny_store, tmp_path / "plain", "head.kind=eagle3",
                               "train.max_steps=1", "train.topk_loss=5"), show_progress=False)
