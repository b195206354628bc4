"""A rerun loads only this run's own checkpoints, as recorded when written, and never runs a pickle's code."""

import hashlib
import json
import shutil

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from train_helpers import train_recipe

from mtptrain.train.checkpoints import RECORD, CheckpointRefused, RunMismatch, WeightsOnlyLoads
from mtptrain.train.trainer import run_train

ARGS = ("head.kind=eagle", "train.max_steps=2", "train.checkpoint_every=1")
MODEL_STATES = "mp_rank_00_model_states.pt"


class Marker:
    """Unpickled, it creates the file `path`: what an attacker's pickle could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def trained(tiny_target_dir, tiny_store, tmp_path_factory):
    """One finished run of two steps, checkpointed at both; each test tampers with a copy of it."""
    run = tmp_path_factory.mktemp("checkpoints") / "run"
    run_train(train_recipe(tiny_target_dir, tiny_store, run, *ARGS), show_progress=False)
    return run


@pytest.fixture
def rerun(trained, tiny_target_dir, tiny_store, tmp_path):
    """A copy of the run, and the command that runs `mtptrain train` on it again."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run, lambda: run_train(train_recipe(tiny_target_dir, tiny_store, run, *ARGS), show_progress=False)


def _forge_record(step_dir, like):
    """Write a record for `step_dir`'s files that is true to them, with the fingerprint and the `made_with` of the
    record `like`."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.glob("*.pt")}
    known = json.loads(like.read_text())
    (step_dir / RECORD).write_text(json.dumps({"format": "mtptrain-checkpoint/1", "fingerprint": known["fingerprint"],
                                               "made_with": known["made_with"], "files": files}))


def test_a_clean_resume_loads_the_recorded_files_of_every_rank(rerun):
    run, train = rerun
    record = json.loads((run / "checkpoints" / "step-0000001" / RECORD).read_text())
    assert sorted(record["files"]) == [MODEL_STATES, "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    (run / "checkpoints" / "latest").write_text("step-0000001")
    (run / "summary.json").unlink()
    assert train()["steps"] == 2


def test_a_latest_pointing_outside_the_run_is_refused_and_its_pickle_never_runs(rerun, tmp_path):
    run, train = rerun
    marker = tmp_path / "marker"
    evil = tmp_path / "evil" / "step-x"
    evil.mkdir(parents=True)
    torch.save({"module": Marker(marker)}, evil / MODEL_STATES)
    (run / "checkpoints" / "latest").write_text("../../evil/step-x")
    with pytest.raises(CheckpointRefused, match=r"latest names '\.\./\.\./evil/step-x', not a step-NNNNNNN "
                                                r"directory.*fresh train.output_dir"):
        train()
    assert not marker.exists()


def test_a_step_directory_linked_outside_the_run_is_refused(rerun, tmp_path):
    run, train = rerun
    marker, step = tmp_path / "marker", run / "checkpoints" / "step-0000002"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"module": Marker(marker)}, elsewhere / MODEL_STATES)
    _forge_record(elsewhere, step / RECORD)  # even a record true to the planted files does not let it in
    shutil.rmtree(step)
    step.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointRefused, match="names 'step-0000002', which is outside"):
        train()
    assert not marker.exists()


def test_a_changed_checkpoint_file_is_refused(rerun):
    run, train = rerun
    states = run / "checkpoints" / "step-0000002" / MODEL_STATES
    saved = torch.load(states, weights_only=False)  # our own file, rewritten with one weight changed
    name = next(iter(saved["module"]))
    saved["module"][name] += 1
    torch.save(saved, states)
    with pytest.raises(CheckpointRefused, match=f"{states} is changed since it was written"):
        train()


def test_a_pickle_planted_beside_the_recorded_files_is_refused(rerun, tmp_path):
    run, train = rerun
    marker, step = tmp_path / "marker", run / "checkpoints" / "step-0000002"
    torch.save({"module": Marker(marker)}, step / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointRefused, match=f"holds {step / 'mp_rank_01_model_states.pt'}, which .* does "
                                                "not list"):
        train()
    assert not marker.exists()


def test_a_pickle_under_a_forged_record_is_loaded_as_weights_only_and_refused(rerun, tmp_path):
    run, train = rerun
    marker, step = tmp_path / "marker", run / "checkpoints" / "step-0000002"
    torch.save({"module": Marker(marker)}, step / MODEL_STATES)
    _forge_record(step, step / RECORD)
    with pytest.raises(CheckpointRefused, match=r"holds more than tensors .*\(it calls \w+\.open\)"):
        train()
    assert not marker.exists()


def test_a_checkpoint_without_a_record_is_refused_with_the_way_on(rerun):
    """Checkpoints written before records existed (or whose writer was killed before recording them)."""
    run, train = rerun
    (run / "checkpoints" / "step-0000002" / RECORD).unlink()
    with pytest.raises(CheckpointRefused, match=f"{RECORD} is missing.*Point .*latest at a step-NNNNNNN directory "
                                                "this run wrote.*or start the run in a fresh train.output_dir"):
        train()


def test_deepspeeds_fp16_optimizer_state_loads_as_weights_only(tmp_path):
    """fp16 does not train on a CPU: its loss scaler, which fp16 runs pickle, is checked on its own."""
    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, False)
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients}}, path)
    loaded = WeightsOnlyLoads(None).load(str(path), map_location="cpu")["optimizer_state_dict"]
    assert loaded["loss_scaler"].__dict__ == scaler.__dict__ and loaded["zero_stage"] is ZeroStageEnum.gradients


def test_a_run_that_would_continue_in_another_precision_is_refused(rerun, monkeypatch):
    """The same recipe may resolve its precision otherwise (train.precision=auto follows the machine's measured
    choice, which differs by machine and by rank count): a checkpoint trained in fp32 is not resumed in
    bf16-autocast, and the message names the setting that resumes it."""
    from mtptrain.train import trainer

    run, train = rerun
    record = json.loads((run / "checkpoints" / "step-0000002" / RECORD).read_text())
    assert record["made_with"]["precision"] == "fp32" and record["made_with"]["features"]["dtype"] == "float32"
    (run / "checkpoints" / "latest").write_text("step-0000001")
    monkeypatch.setattr(trainer, "pick_precision", lambda requested, device, config=None: "bf16-autocast")
    with pytest.raises(RunMismatch, match=r"step-0000001 was trained with precision fp32.*would continue with "
                                          r"precision bf16-autocast.*train.precision=fp32"):
        train()
    head = json.loads((run / "head" / "config.json").read_text())
    assert head["precision"] == "fp32" and head["features"]["runtime"] == record["made_with"]["features"]
