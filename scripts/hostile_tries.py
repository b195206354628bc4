"""Run the CLI against hostile and unlucky files, as a careless or hostile user would, and report each answer.

Each try builds its own files in a scratch directory (a tiny random target from the test suite's helpers, a
store and a trained head of it), runs one `mtptrain` command in a child process and prints: its exit code,
whether a traceback reached the user, the first line of what it said, and the child's peak memory. A try
passes when the answer is the one it expects (a refusal with a clear error, or a warning and a clean run where
the input is only a stale cache) and nothing written before is lost.

    .venv/bin/python scripts/hostile_tries.py [--only NAME ...] [--keep DIR]

Runs in about 5 minutes on 2 cores, most of it one rebuild of the runtime's C++ kernels (the damaged-kernel
try) and the measurement under load. Exit code 1 when a try did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the suite's tiny target and chats


@dataclass
class Answer:
    rc: int
    out: str
    err: str
    peak_mb: float

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    def said(self) -> str:
        """Its error line, else its first warning, else its last line."""
        lines = self.err.splitlines()
        picked = [line for line in lines if line.startswith("error:")] or \
            [line for line in lines if "WARNING" in line and "accelerator" not in line] or lines[-1:] or [""]
        return picked[0][:220]


PEAKS: list[float] = []  # MB, each command's peak resident memory, in order
ANSWERS: list["Answer"] = []

# The child that runs the command reports, last on its stderr, the peak memory of what it ran.
MEASURED = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(code)")


def run(args: list[str], env: dict | None = None, fsize: int | None = None, timeout: float = 600) -> Answer:
    """`mtptrain ARGS` in a child process (under a file-size limit of `fsize` bytes where given)."""
    def limits():
        if fsize is not None:
            import signal

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    done = subprocess.run([sys.executable, "-c", MEASURED, sys.executable, "-m", "mtptrain.cli", *args], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, preexec_fn=limits,
                          timeout=timeout)
    err, _, peak = done.stderr.rpartition("PEAK_KB ")
    PEAKS.append(int(peak.split()[0]) / 1024 if peak.strip() else float("nan"))
    ANSWERS.append(Answer(done.returncode, done.stdout, err, PEAKS[-1]))
    return ANSWERS[-1]


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


class World:
    """The scratch files the tries share: a tiny target, chats, a recipe's settings, a store and a head."""

    def __init__(self, root: Path):
        from conftest import make_tiny_llama, make_tokenizer, write_sharegpt

        self.root = root
        self.cache = root / "cache"
        self.target = root / "target"
        tok = make_tokenizer()
        make_tiny_llama(len(tok)).save_pretrained(self.target)
        tok.save_pretrained(self.target)
        self.chats = write_sharegpt(root / "chats.json", 80, seed=3)
        self.env = {"MTPTRAIN_CACHE": str(self.cache), "WANDB_MODE": "disabled"}
        self.store = root / "store"
        self.base = [f"target.model={self.target}", "target.dtype=float32", f"data.source={self.chats}",
                     "data.max_length=160", "data.validation_fraction=0.1", "precompute.layers=[0,1,2]",
                     "head.kind=eagle3", "head.draft_vocab_size=128", "train.max_steps=2", "train.checkpoint_every=1",
                     "train.micro_batch_size=4",
                     "train.engine_eval.prompts=0", "train.num_workers=0", "tracking.wandb=disabled"]
        answer = self.cli("precompute", f"precompute.output_dir={self.store}")
        assert answer.rc == 0, answer.err[-2000:]
        # this machine's runtime choice as the precompute cached it, which the tries that damage it put back after
        # them: None where the precompute measured under other processes' load (nothing is cached then)
        choices = self.cache / "runtime-choice.json"
        self.choices = choices.read_text() if choices.is_file() else None
        self.run_dir = root / "run"
        answer = self.cli("train", f"train.features={self.store}", f"train.output_dir={self.run_dir}")
        assert answer.rc == 0, answer.err[-2000:]

    def cli(self, command: str, *overrides: str, env: dict | None = None, **kw) -> Answer:
        quiet = ["--no-progress"] if command in ("precompute", "train", "eval") else []
        return run([command, *quiet, *sets(*self.base, *overrides)], {**self.env, **(env or {})}, **kw)

    def copy(self, what: Path, name: str) -> Path:
        out = self.root / name
        shutil.rmtree(out, ignore_errors=True)
        return Path(shutil.copytree(what, out, symlinks=True))


# --------------------------------------------------------------------------- tries: (name, build-and-run) -> verdict


def refused(answer: Answer, *words: str) -> str | None:
    """None when `answer` is a clean refusal mentioning `words`; else what is wrong."""
    if answer.rc == 0:
        return "exit code 0"
    if answer.traceback:
        return "a traceback reached the user"
    missing = [w for w in words if w not in answer.err]
    return f"the message lacks {missing}" if missing else None


def _tamper_shard(world: World, name: str, change: Callable[[dict], None]) -> Path:
    from safetensors import safe_open

    from mtptrain.features.store import write_safetensors

    store = world.copy(world.store, name)
    manifest = json.loads((store / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    with safe_open(str(store / entry["file"]), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k).clone() for k in fh.keys()}
        metadata = fh.metadata()
    change(tensors)
    entry.update(write_safetensors(store / entry["file"], tensors, metadata))
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store


def _train_on(world: World, store: Path, name: str) -> Answer:
    return world.cli("train", f"train.features={store}", f"train.output_dir={world.root / name}")


def try_checkpoint_pointer(world: World) -> str | None:
    run_dir = world.copy(world.run_dir, "run-evil")
    (run_dir / "summary.json").unlink(missing_ok=True)
    marker, evil = world.root / "PWNED", world.root / "evil" / "step-x"
    evil.mkdir(parents=True, exist_ok=True)

    class Marker:
        def __reduce__(self):
            return open, (str(marker), "w")
    (evil / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps({"module": Marker()}))
    (run_dir / "checkpoints" / "latest").write_text("../../evil/step-x")
    answer = world.cli("train", f"train.features={world.store}", f"train.output_dir={run_dir}")
    return ("the pickle ran" if marker.exists() else None) or refused(answer, "latest")


def try_choice_cache(content: str) -> Callable[[World], str | None]:
    def attempt(world: World) -> str | None:
        cache = world.cache / "runtime-choice.json"
        cache.write_text(content.replace("@KEY", next(iter(json.loads(world.choices or "{}")), "v7|x")))
        answer = world.cli("precompute", f"precompute.output_dir={world.root / 'store-choice'}",
                           "target.dtype=auto")
        shutil.rmtree(world.root / "store-choice", ignore_errors=True)
        if world.choices is not None:  # as the setup cached it, for the next try (a run under load caches nothing)
            cache.write_text(world.choices)
        if answer.rc != 0 or answer.traceback:
            return f"exit code {answer.rc}: {answer.said()}"
        return None if "measured again" in answer.err else "no warning about the cache"
    return attempt


def try_damaged_kernel(world: World) -> str | None:
    libraries = sorted(world.cache.glob("kernels/*/*.so"))
    if not libraries:
        return "no compiled kernel in the cache to damage"
    data = libraries[0].read_bytes()
    libraries[0].write_bytes(data[: len(data) // 3])
    answer = world.cli("precompute", f"precompute.output_dir={world.root / 'store-kernel'}", "target.dtype=auto")
    if answer.rc != 0:
        return f"exit code {answer.rc}: {answer.said()}"
    return None if "rebuilt" in answer.err else "no warning about the damaged kernel"


def try_measure_under_load(world: World) -> str | None:
    cache = world.root / "cache-load"
    shutil.copytree(world.cache / "kernels", cache / "kernels")  # the kernels built; nothing measured yet
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1)
        answer = run(["measure", *sets(f"target.model={world.target}")], {**world.env, "MTPTRAIN_CACHE": str(cache)})
    finally:
        for spinner in spinners:
            spinner.kill()
    if (cache / "runtime-choice.json").exists():
        return "a measurement under load was cached"
    return refused(answer, "not cached")


def try_kernels_not_built(world: World) -> str | None:
    cache = world.root / "cache-nocc"
    cache.mkdir(exist_ok=True)
    if world.choices is None:
        return "no runtime choice was cached while the tries set up (other processes kept the cores busy): rerun idle"
    known = json.loads(world.choices)
    for entry in known.values():  # a cached choice of the runtime's own product and attention
        for sections in entry["timings"].values():
            for section, kernels in sections.items():
                kernels["native" if section.startswith("products") else "fused"] = 1e-4
    (cache / "runtime-choice.json").write_text(json.dumps(known))
    head = world.run_dir / "head"
    prompts = world.root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q0", "turns": ["the word is hot"]}) + "\n")
    out = world.root / "eval-nocc"
    answer = world.cli("eval", f"eval.head={head}", f"eval.prompts={prompts}", f"eval.output_dir={out}",
                       "eval.max_new_tokens=8", "eval.methods=[ngram]", "eval.repeats=1", "target.dtype=auto",
                       env={"MTPTRAIN_CACHE": str(cache), "CXX": "/bin/false"})
    if answer.rc not in (0, 3) or answer.traceback:
        return f"exit code {answer.rc}: {answer.said()}"
    runtime = json.loads((out / "results.json").read_text())["machine"]["runtime"]
    report = (out / "report.md").read_text()
    if "native /" in runtime or "attention fused" in runtime:
        return f"results.json says {runtime}"
    return None if "did not build" in runtime and "did not build" in report else "the fallback is not named"


def try_store(change: Callable[[dict], None], *words: str) -> Callable[[World], str | None]:
    def attempt(world: World) -> str | None:
        name = f"store-{abs(hash(words)) % 10**6}"
        return refused(_train_on(world, _tamper_shard(world, name, change), name + "-run"), *words)
    return attempt


def try_manifest(change: Callable[[dict], None], *words: str) -> Callable[[World], str | None]:
    def attempt(world: World) -> str | None:
        store = world.copy(world.store, f"store-m{abs(hash(words)) % 10**6}")
        manifest = json.loads((store / "manifest.json").read_text())
        change(manifest)
        (store / "manifest.json").write_text(json.dumps(manifest))
        return refused(_train_on(world, store, store.name + "-run"), *words)
    return attempt


def _tripled(manifest: dict) -> None:
    first = manifest["shards"][0]
    manifest["shards"] += [dict(first), dict(first)]
    totals = manifest["totals"][first["split"]]
    totals["samples"] += 2 * first["samples"]
    totals["tokens"] += 2 * first["tokens"]


def try_huge_header(world: World) -> str | None:
    store = world.copy(world.store, "store-header")
    shard = store / json.loads((store / "manifest.json").read_text())["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    answer = _train_on(world, store, "store-header-run")
    return refused(answer, shard.name) or ("advises deleting" if "delete" in answer.err.lower() else None)


def try_alias_bomb(world: World) -> str | None:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i, name in enumerate("bcdefghi"):
        lines.append(f"{name}: &{name} [*{'abcdefghi'[i]}" + f", *{'abcdefghi'[i]}" * 8 + "]")
    recipe = world.root / "bomb.yaml"
    recipe.write_text("\n".join(lines) + "\ndata:\n  source: *i\n")
    return refused(run(["recipe", "--recipe", str(recipe)], world.env, timeout=60), "alias")


def try_deep_recipe(world: World) -> str | None:
    recipe = world.root / "deep.yaml"
    recipe.write_text("name: " + "[" * 100_000 + "]" * 100_000 + "\n")
    return refused(run(["recipe", "--recipe", str(recipe)], world.env, timeout=60), "nested more than")


def try_prompts(text: bytes, *words: str) -> Callable[[World], str | None]:
    def attempt(world: World) -> str | None:
        prompts = world.root / "prompts-bad.jsonl"
        prompts.write_bytes(text)
        out = world.root / "eval-bad"
        answer = world.cli("eval", f"eval.head={world.run_dir / 'head'}", f"eval.prompts={prompts}",
                           f"eval.output_dir={out}", "eval.max_new_tokens=8", "eval.methods=[ngram]",
                           "eval.repeats=1", timeout=120)
        return refused(answer, *words) or ("results written" if (out / "results.json").exists() else None)
    return attempt


def try_disk_full(world: World) -> str | None:
    out = world.root / "store-full"
    answer = world.cli("precompute", f"precompute.output_dir={out}", "precompute.shard_mb=2", fsize=1_000_000)
    error = refused(answer, str(out))
    if error:
        return error
    again = world.cli("precompute", f"precompute.output_dir={out}", "precompute.shard_mb=2")
    return None if again.rc == 0 else f"the rerun failed: {again.said()}"


def try_export_full(world: World) -> str | None:
    out = world.root / "export-full"
    answer = world.cli("export", f"export.head={world.run_dir / 'head'}", f"export.output_dir={out}",
                       "export.sglang_ids=before-25454", fsize=100_000)
    return refused(answer, "file size limit")


def try_export_not_writable(world: World) -> str | None:
    """As root, no permission bit stops a write: a directory under /sys (read-only in a container) does."""
    answer = world.cli("export", f"export.head={world.run_dir / 'head'}", "export.output_dir=/sys/fs/mtptrain/x",
                       "export.sglang_ids=before-25454")
    return refused(answer, "/sys/fs")


def try_edited_head(world: World) -> str | None:
    head = world.copy(world.run_dir / "head", "head-edited")
    config = json.loads((head / "config.json").read_text())
    config["head"]["feature_layers"] = [2, 1, 0]  # the weights were trained on [0, 1, 2], in that order
    (head / "config.json").write_text(json.dumps(config))
    answer = world.cli("export", f"export.head={head}", f"export.output_dir={world.root / 'export-edited'}",
                       "export.sglang_ids=before-25454")
    return refused(answer, "config.json")


def try_bool_as_int(world: World) -> str | None:
    return refused(run(["recipe", *sets("train.micro_batch_size=true")], world.env), "micro_batch_size")


TRIES: dict[str, Callable[[World], str | None]] = {
    "checkpoint latest -> ../../evil (a pickle)": try_checkpoint_pointer,
    "runtime-choice.json: null": try_choice_cache("null"),
    "runtime-choice.json: []": try_choice_cache("[]"),
    'runtime-choice.json: "abc"': try_choice_cache('"abc"'),
    "runtime-choice.json: fields missing": try_choice_cache('{"@KEY": {"timings": {"float32": {}}}}'),
    "runtime-choice.json: unknown kernel": try_choice_cache(json.dumps({"@KEY": {"timings": {
        d: {s: {"turbo": 1.0} for s in ("products", "products_batch", "attention_one", "attention_many",
                                        "attention_batch")} for d in ("float32", "bfloat16")}}})),
    "kernel .so truncated": try_damaged_kernel,
    "measured under load (2 busy processes)": try_measure_under_load,
    "kernels cannot build (CXX=/bin/false)": try_kernels_not_built,
    "store: offsets out of order": try_store(lambda t: t["offsets"].__setitem__([1, 2], t["offsets"][[2, 1]]),
                                             "offsets"),
    "store: offsets past the end": try_store(lambda t: t["offsets"].__setitem__(-1, t["offsets"][-1] + 1000),
                                             "offsets"),
    "store: a layer of another width": try_store(lambda t: t.update({"hidden.0": t["hidden.0"][:, :-1].clone()}),
                                                 "hidden.0"),
    "store: ids outside the vocabulary": try_store(lambda t: t["input_ids"].__setitem__(3, 10**6), "input_ids"),
    "store: a bfloat16 store's layer in float32": try_store(
        lambda t: t.update({"hidden.0": t["hidden.0"].float()}), "hidden.0"),
    "manifest: a shard listed 3 times": try_manifest(_tripled, "twice"),
    "manifest: negative token count": try_manifest(lambda m: m["shards"][0].update(tokens=-5), "tokens"),
    "manifest: absurd token count": try_manifest(lambda m: m["shards"][0].update(tokens=10**12), "tokens"),
    "shard header claims 1 TB": try_huge_header,
    "recipe: YAML alias bomb": try_alias_bomb,
    "prompts: one 5 MB prompt": try_prompts(json.dumps({"id": "big", "turns": ["word " * 1_000_000]}).encode(),
                                            "big"),
    "prompts: empty file": try_prompts(b"", "no prompts"),
    "prompts: a line nested 100,000 deep": try_prompts(b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested past"),
    "recipe: a value nested 100,000 deep": try_deep_recipe,
    "prompts: invalid UTF-8": try_prompts(b'{"id": "a", "turns": ["\xff\xfe"]}\n', ":1"),
    "precompute: file size limit (disk full)": try_disk_full,
    "export: file size limit (disk full)": try_export_full,
    "export: a parent that may not be written": try_export_not_writable,
    "export: head config edited after training": try_edited_head,
    "--set train.micro_batch_size=true": try_bool_as_int,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="Run the tries whose name contains one of these words.")
    parser.add_argument("--keep", type=Path, help="Build the scratch files here and keep them.")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="mtptrain-tries-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    world = World(root)
    print(f"scratch files in {root} (set up in {time.perf_counter() - started:.0f} s)\n")
    failed = 0
    for name, attempt in TRIES.items():
        if args.only and not any(word in name for word in args.only):
            continue
        clock, first = time.perf_counter(), len(PEAKS)
        problem = attempt(world)
        failed += problem is not None
        print(f"{'ok  ' if problem is None else 'FAIL'} {name:46s} {time.perf_counter() - clock:6.1f} s  "
              f"peak {max(PEAKS[first:], default=float('nan')):5.0f} MB"
              + (f"\n     {problem}" if problem else "")
              + (f"\n     rc {ANSWERS[-1].rc}: {ANSWERS[-1].said()}" if len(ANSWERS) > first else ""))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{len(TRIES) - failed if not args.only else 'selected'} tries: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
