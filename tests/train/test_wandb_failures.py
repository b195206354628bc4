"""W&B that cannot start: `wandb: auto` falls back to an offline run with one warning within a bounded wait; an
explicit `online` stops with an error naming the setting to change. Real wandb, against a loopback port nothing
listens on, so no test reaches a W&B server."""

import json
import logging
import socket
import subprocess
import time

import pytest
from train_helpers import REPO, clean_env, train_cmd, train_recipe

import mtptrain.tracking as tracking
from mtptrain.config import load_recipe
from mtptrain.tracking import init_run

# Well-formed (40 hex characters), so wandb takes it to the server; distinctive, so a copy on disk is found.
KEY = "5eed" * 10
FALLBACK = "W&B online init failed"


@pytest.fixture()
def wandb_env(tmp_path, monkeypatch):
    """Credentials from the environment only, wandb's directories and HOME (so ~/.netrc) under tmp_path, a short
    init wait, and a server URL on a closed loopback port."""
    import wandb

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    for var in ("WANDB_MODE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)  # conftest's WANDB_MODE=disabled; a proxy would answer for loopback
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    with socket.socket() as sock:  # a port that was free a moment ago: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    # wandb keeps the settings it read from the environment for the whole process: start from none.
    wandb.teardown()
    yield tmp_path
    wandb.teardown()


def _recipe(tmp_path, *overrides):
    return load_recipe(None, [f"train.output_dir={tmp_path / 'run'}", "name=wbfail", *overrides])


def _warnings(caplog):
    """Warnings for the console. The "wandb" logger writes to the run's debug.log only (it does not propagate),
    although pytest's capture still sees its records."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.split(".")[0] != "wandb"]


def _files_holding(root, secret: str) -> list:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and secret.encode() in p.read_bytes()]


def test_a_malformed_key_under_auto_logs_offline_after_one_warning(wandb_env, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", "not-a-key")
    recipe = _recipe(wandb_env)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        run = init_run(recipe, "train", "auto", wandb_env / "run")
    elapsed = time.monotonic() - started
    try:
        assert run.offline
        assert elapsed < 30, elapsed
        (warning,) = _warnings(caplog)
        message = warning.getMessage()
        assert message.startswith(FALLBACK) and "AuthenticationError" in message and "\n" not in message
        assert "tracking.wandb=offline" in message and "wandb sync" in message
        assert list((wandb_env / "run" / "wandb").glob("offline-run-*"))
    finally:
        run.finish()


@pytest.mark.parametrize("resume_id", [None, "resumedrun1"])
def test_an_unreachable_server_under_auto_logs_offline_within_the_wait(wandb_env, caplog, resume_id):
    """A resumed train run keeps its W&B id: the offline run must get it although the failed online run took it."""
    recipe = _recipe(wandb_env)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        run = init_run(recipe, "eval", "auto", wandb_env / "run", resume_id)
    elapsed = time.monotonic() - started
    try:
        assert run.offline
        assert elapsed < 15, elapsed  # WANDB_INIT_TIMEOUT=3, and the offline start
        (warning,) = _warnings(caplog)
        assert warning.getMessage().startswith(FALLBACK) and "tracking.wandb=offline" in warning.getMessage()
        (offline,) = (wandb_env / "run" / "wandb").glob("offline-run-*")
        if resume_id:
            assert offline.name.endswith(resume_id) and run.id == resume_id
    finally:
        run.finish()
    assert _files_holding(wandb_env, KEY) == []


def test_explicit_online_with_an_unreachable_server_names_the_setting(wandb_env):
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError) as caught:
        init_run(_recipe(wandb_env), "precompute", "online", wandb_env / "run")
    assert time.monotonic() - started < 15
    message = str(caught.value)
    assert "CommError" in message and "tracking.wandb=offline" in message and "WANDB_INIT_TIMEOUT" in message
    assert KEY not in message


def test_wandb_mode_online_in_the_environment_is_explicit_too(wandb_env, monkeypatch):
    """auto defers to WANDB_MODE; WANDB_MODE=online is the user asking for online, so it is not quietly dropped."""
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(tracking.TrackingError, match="WANDB_MODE"):
        init_run(_recipe(wandb_env), "train", "auto", wandb_env / "run")


def test_the_init_wait_defaults_to_20_seconds_and_wandb_init_timeout_sets_it(wandb_env, monkeypatch):
    monkeypatch.delenv("WANDB_INIT_TIMEOUT")
    run = init_run(_recipe(wandb_env), "train", "offline", wandb_env / "a")
    run.finish()
    assert run.settings.init_timeout == 20
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "7.5")
    run = init_run(_recipe(wandb_env), "train", "offline", wandb_env / "b")
    run.finish()
    assert run.settings.init_timeout == 7.5


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_wait_that_is_not_a_positive_number_is_an_error_naming_it(wandb_env, monkeypatch, value):
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", value)
    with pytest.raises(tracking.TrackingError, match=f"WANDB_INIT_TIMEOUT={value}"):
        init_run(_recipe(wandb_env), "train", "offline", wandb_env / "run")


def test_train_with_explicit_online_and_no_server_exits_1_without_a_traceback(wandb_env, tiny_target_dir,
                                                                             tiny_store):
    recipe = train_recipe(tiny_target_dir, tiny_store, wandb_env / "run", "train.max_steps=2")
    started = time.monotonic()
    done = subprocess.run(train_cmd(recipe, wandb_env / "r.yaml", "tracking.wandb=online"), cwd=REPO,
                          capture_output=True, text=True, env=clean_env(), timeout=300)
    print(f"train with online W&B failed after {time.monotonic() - started:.1f}s")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert FALLBACK in error and "tracking.wandb=offline" in error and "CommError" in error
    assert _files_holding(wandb_env, KEY) == []


def test_train_under_auto_with_no_server_trains_offline_and_writes_no_key(wandb_env, tiny_target_dir, tiny_store):
    from conftest import read_offline_wandb_run

    recipe = train_recipe(tiny_target_dir, tiny_store, wandb_env / "run", "train.max_steps=2", "train.log_every=1")
    started = time.monotonic()
    done = subprocess.run(train_cmd(recipe, wandb_env / "r.yaml", "tracking.wandb=auto"), cwd=REPO,
                          capture_output=True, text=True, env=clean_env(), timeout=300)
    print(f"train with auto W&B took {time.monotonic() - started:.1f}s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert sum(FALLBACK in line for line in done.stderr.splitlines()) == 1, done.stderr[-3000:]
    (run_file,) = (wandb_env / "run").glob("wandb/offline-run-*/run-*.wandb")
    logged = read_offline_wandb_run(run_file)
    steps = sorted({json.loads(line)["step"] for line in (wandb_env / "run" / "metrics.jsonl").read_text().splitlines()})
    assert logged["job_type"] == "train" and [row["_step"] for row in logged["history"]] == steps and steps
    # Neither the run directory nor wandb's own directories, HOME (~/.netrc) included, hold the key.
    assert _files_holding(wandb_env, KEY) == []
