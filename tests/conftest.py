"""Shared fixtures: a tiny tokenizer and a tiny random Llama saved as a local model directory."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

# Stages left at wandb: auto log nothing in the tests; the tests of W&B logging ask for offline runs.
os.environ.setdefault("WANDB_MODE", "disabled")
# The suite's own cache (converted targets, compiled kernels, this machine's measured runtime choices), kept
# between runs of one checkout: the tests never write into the user's ~/.cache/mtptrain, nor inherit a choice
# some other program measured there. Tests that compare runs pin what they compare (target.dtype, precision).
os.environ["MTPTRAIN_CACHE"] = str(Path(__file__).resolve().parent.parent / "build" / "test-cache")

ROOT = Path(__file__).resolve().parent.parent
# Other projects' environments, built by their scripts the first time in a checkout (downloads: minutes on a fresh
# clone, seconds after): the tests marked with the key need the script. Once collection has picked the tests to
# run, the script of each environment they need starts in the background, so its download overlaps the tests that
# run before its own; their fixtures wait for it through `environment`.
ENVIRONMENTS = {"vllm": "scripts/setup_vllm.sh", "interop": "scripts/setup_interop.sh"}
_building: dict[str, subprocess.Popen] = {}
_built: dict[str, str] = {}  # script -> "" once it succeeded, else what it printed last


def _log(script: str) -> Path:
    log = ROOT / "build" / "test-setup" / f"{Path(script).stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return log


# The disk a run writes, measured on a fresh clone (docs/benchmarks.md, "The test suite's disk"): under the temporary
# folder, the tests' own folders and the caches of the programs they start; in the checkout, each environment its
# tests need that is not built yet. A run that finds less free stops before its first test instead of failing
# half-way with "No space left on device" in whatever test comes next.
# 2026-11-29: pytest's folder 2.2 GiB, torch's compile cache 0.15 GiB, vLLM's environment 3.4, the interop one 1.5.
SUITE_TMP_GIB = 3.0
ENVIRONMENT_DIRS = {"vllm": (".venv-vllm", 3.6), "interop": (".venv-speculators", 1.7)}


def disk_shortfalls(markers: set[str], tmp: Path, checkout: Path) -> list[str]:
    """What the selected tests will write where there is not room for it, one line a filesystem."""
    wants: dict[int, tuple[Path, float, list[str]]] = {}

    def want(path: Path, gib: float, what: str) -> None:
        device = path.stat().st_dev
        where, total, whats = wants.get(device, (path, 0.0, []))
        wants[device] = (where, total + gib, [*whats, what])

    want(tmp, SUITE_TMP_GIB, f"the tests' temporary folders under {tmp}")
    for marker, (venv, gib) in ENVIRONMENT_DIRS.items():
        if marker in markers and not (checkout / venv / "bin" / "python").exists():
            want(checkout, gib, f"{checkout / venv} ({ENVIRONMENTS[marker]})")
    lines = []
    for where, gib, whats in wants.values():
        free = shutil.disk_usage(where).free / 2**30
        if free < gib:
            lines.append(f"{where}'s filesystem has {free:.1f} GiB free; this run writes about {gib:.1f} GiB there: "
                         + ", ".join(whats))
    return lines


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    markers = {marker for marker in ENVIRONMENTS if any(item.get_closest_marker(marker) for item in session.items)}
    short = disk_shortfalls(markers, Path(tempfile.gettempdir()), ROOT)
    if short:
        pytest.exit("not enough disk for the tests: " + "; ".join(short) + ". Free some (old clones' "
                    "environments, pytest's earlier folders under the temporary folder) and run again.", returncode=4)
    for marker in markers:
        script = ENVIRONMENTS[marker]
        with open(_log(script), "w") as sink:
            _building[script] = subprocess.Popen(["bash", script], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL)


def pytest_sessionfinish(session):
    for process in _building.values():  # never leave an install half done in a venv the next run reuses
        process.wait()


def environment(script: str) -> None:
    """Wait for `script` (started in the background for the selected tests, else run here, once per session) and
    fail with the end of its output unless it succeeded."""
    if script not in _built:
        process = _building.pop(script, None)
        if process is None:
            with open(_log(script), "w") as sink:
                process = subprocess.Popen(["bash", script], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
        code = process.wait()
        _built[script] = "" if code == 0 else f"exit status {code}:\n{_log(script).read_text()[-4000:]}"
    assert not _built[script], f"{script} failed, {_built[script]}"


CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 layout: BOS in the template, role headers, <|eot_id|> ends a turn, no trailing newline.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from "
         "or had by hot word but what some we can out other were all there when up use your how said an "
         "each she which do their time if will way about many then them write would like so these her long "
         "make thing see him two has look more day could go come did number sound no most people my over "
         "know water than call first who may down side been now find any new work part take get place made "
         "live where after back little only round man year came show every good me give our under name").split()


def make_tokenizer(template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) + " 0123456789 .,!?" for _ in range(300)]
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                                  pad_token="<pad>", additional_special_tokens=SPECIALS[2:])
    tok.chat_template = template
    return tok


def make_tiny_llama(vocab_size: int, seed: int = 0, layers: int = 4, initializer_range: float = 0.02,
                    hidden_size: int = 64, heads: int = 4):
    """initializer_range 0.02 decodes to one repeated token; 0.2 gives varied text (decoding tests need that)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=3, pad_token_id=0,
                         initializer_range=initializer_range)
    return LlamaForCausalLM(config).eval()


@pytest.fixture()
def longest_text(monkeypatch):
    """Longest text any tokenizer rendered or tokenized during the test, in characters."""
    seen = [0]
    cls = type(make_tokenizer())
    call, template = cls.__call__, cls.apply_chat_template

    def measured_call(self, text, *args, **kwargs):
        seen[0] = max(seen[0], len(text))
        return call(self, text, *args, **kwargs)

    def measured_template(self, *args, **kwargs):
        out = template(self, *args, **kwargs)
        seen[0] = max(seen[0], len(out) if isinstance(out, str) else 0)
        return out

    monkeypatch.setattr(cls, "__call__", measured_call)
    monkeypatch.setattr(cls, "apply_chat_template", measured_template)

    def reset() -> int:
        longest, seen[0] = seen[0], 0
        return longest

    return reset


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer()
    make_tiny_llama(len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def varied_target_dir(tmp_path_factory) -> Path:
    """A tiny target whose greedy answers vary from prompt to prompt (larger initial weights)."""
    out = tmp_path_factory.mktemp("tiny-llama-varied")
    tok = make_tokenizer()
    make_tiny_llama(len(tok), layers=2, initializer_range=0.2).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def served_target_dir(tmp_path_factory) -> Path:
    """A tiny target vLLM's CPU build serves: heads of 64 (its CPU attention has no kernel for 16), varied answers."""
    out = tmp_path_factory.mktemp("tiny-llama-served")
    tok = make_tokenizer()
    make_tiny_llama(len(tok), layers=5, initializer_range=0.2, hidden_size=128, heads=2).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def other_target_dir(tmp_path_factory) -> Path:
    """Same architecture and tokenizer, other weights: must not pass for the tiny target."""
    out = tmp_path_factory.mktemp("tiny-llama-other")
    tok = make_tokenizer()
    make_tiny_llama(len(tok), seed=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_conversation(rng: random.Random, turns: int) -> list[dict]:
    roles = ["human", "gpt"] * turns
    return [{"from": r, "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))} for r in roles]


def write_sharegpt(path: Path, n: int, seed: int = 0, extra_rows: list | None = None) -> Path:
    rng = random.Random(seed)
    rows = [{"id": f"conv{i}", "conversations": random_conversation(rng, rng.randint(1, 3))} for i in range(n)]
    path.write_text(json.dumps(rows + list(extra_rows or [])))
    return path


@pytest.fixture()
def sharegpt_file(tmp_path) -> Path:
    return write_sharegpt(tmp_path / "chats.json", 40)


def tiny_recipe(target_dir: Path, data: Path, out: Path, **precompute):
    from mtptrain.config import load_recipe

    # float32 pinned: on a tiny model bfloat16 and float32 products run in a near tie, which the machine's
    # measurement may break either way, and the tests compare with float32 forwards.
    overrides = [f"target.model={target_dir}", "target.dtype=float32", f"data.source={data}", "data.max_length=160",
                 "data.validation_fraction=0.1", f"precompute.output_dir={out}", "precompute.layers=[0, 2]",
                 "precompute.batch_tokens=512"]
    overrides += [f"precompute.{k}={v}" for k, v in precompute.items()]
    return load_recipe(None, overrides)


@pytest.fixture(scope="session")
def tiny_store(tiny_target_dir, tmp_path_factory):
    """A feature store of the tiny target with layers [0, 1, 2] and the last (3), for training runs."""
    from mtptrain.features.precompute import run_precompute

    tmp = tmp_path_factory.mktemp("train-store")
    recipe = tiny_recipe(tiny_target_dir, write_sharegpt(tmp / "c.json", 160, seed=5), tmp / "features",
                         layers="[0, 1, 2]", dtype="float32")
    run_precompute(recipe, show_progress=False)
    return tmp / "features"


def read_offline_wandb_run(run_file: Path, timeout: float = 60) -> dict:
    """An offline W&B run file read back once all its records are on disk (its exit record). The W&B service
    of a test process outlives run.finish() and may still be writing the file; a command's process ends
    with it."""
    import time

    from wandb_files import read_offline_run

    deadline = time.time() + timeout
    while True:
        run = read_offline_run(run_file)
        if run["finished"] or time.time() > deadline:
            return run
        time.sleep(0.5)


def recipe_file(overrides: list[str], path: Path) -> Path:
    """A recipe YAML holding `section.key=value` overrides, for a command line to read."""
    import yaml

    raw: dict = {}
    for item in overrides:
        section_key, value = item.split("=", 1)
        section, key = section_key.split(".")
        raw.setdefault(section, {})[key] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(raw))
    return path


def kill_after_first_group(command: list, output: Path, cwd: Path, timeout: float = 120) -> dict:
    """Starts a `mtptrain regenerate` command line writing `output`, SIGKILLs it as soon as its state file records
    a finished group of conversations, and returns that state."""
    import signal
    import subprocess
    import time

    from mtptrain.data.resumable import state_path

    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if state_path(output).is_file() and json.loads(state_path(output).read_text() or "{}").get("groups_done"):
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    return json.loads(state_path(output).read_text())
