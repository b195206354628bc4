"""Every benchmark runs for real at a tiny size, in a subprocess as a user runs it, on the suite's tiny random
targets (tests/conftest.py), and prints what it measures: its table's rows, ratios that are positive and finite,
its baseline row, the exactness counts where it checks them, the files it writes. No speed is asserted: a
benchmark's targets are its own. The kernels' cross-target check and the hostile tries still parse their
arguments."""

import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import environment, write_sharegpt
from mtptrain.config import dump_recipe, load_recipe
from mtptrain.runtime.native_kernels import blocked_linear_kernel

ROOT = Path(__file__).parent.parent
# benchmarks/_*.py are helpers the benchmarks import (run through theirs), not benchmarks
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
SCRIPTS = [ROOT / "scripts" / "check_kernel_targets.py", ROOT / "scripts" / "hostile_tries.py"]
# In-process training tests leave a loopback rendezvous in this process's environment: not for the child.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
NUM = r"[\d,]+(?:\.\d+)?"  # a printed number: 12,345.6


def run_benchmark(name: str, *args) -> str:
    """What benchmarks/<name> prints to stdout when run with `args` from the repository's root; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, f"benchmarks/{name}", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def number(text: str) -> float:
    """A printed number, ratio or share ("12,345.6", "1.23x", "x1.23", "45%"): positive or zero, and finite."""
    value = float(text.replace(",", "").strip("x%"))
    assert math.isfinite(value) and value >= 0, text
    return value


def positive(text: str) -> float:
    value = number(text)
    assert value > 0, text
    return value


def table(out: str, row: str) -> dict[str, dict]:
    """The lines of `out` that match the regular expression `row`, by their group `name`."""
    found = {m["name"]: m.groupdict() for m in re.finditer(row, out, re.M)}
    assert found, f"no line matches {row!r} in:\n{out}"
    return found


def test_every_benchmark_has_its_run_here():
    """A new benchmark gets its test of a real run, named after it: otherwise it rots unnoticed."""
    assert len(BENCHMARKS) >= 10
    assert [p.name for p in BENCHMARKS if f"test_{p.stem}" not in globals()] == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_imports_and_prints_its_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_head(tiny_target_dir, tmp_path_factory) -> Path:
    """A random EAGLE-3 head of the tiny target: drafting runs, whatever it accepts."""
    from mtptrain.config import TargetConfig
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.target import load_target

    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bench-head") / "head"
    save_head(out, spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    return out


@pytest.fixture(scope="module")
def head_recipe(varied_target_dir, tmp_path_factory) -> Path:
    """The recipe file of the head-quality benchmarks' stages: the varied target (its answers are text to train
    and score on), one feature layer, two TTT steps, one eval prompt of one turn."""
    tmp = tmp_path_factory.mktemp("bench-recipe")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q0", "turns": ["the word is hot and you see", "say it again"]}) + "\n")
    recipe = load_recipe(None, [
        "name=bench", f"target.model={varied_target_dir}", "target.dtype=float32",
        f"data.source={write_sharegpt(tmp / 'chats.json', 40)}", "data.max_length=160",
        "data.validation_fraction=0.1", f"precompute.output_dir={tmp / 'features'}", "precompute.layers=[0]",
        "precompute.dtype=float32", "head.kind=eagle3", "head.ttt_steps=2", "head.draft_vocab_size=64",
        f"train.features={tmp / 'features'}", f"train.output_dir={tmp / 'train'}", "train.micro_batch_size=4",
        "train.precision=fp32", "train.num_workers=0", "train.engine_eval.prompts=0", "tracking.wandb=disabled",
        f"eval.prompts={prompts}", "eval.max_turns=1", "eval.max_new_tokens=8", "eval.methods=[chain]",
        "eval.k=[2]", "eval.repeats=1"])
    dump_recipe(recipe, tmp / "recipe.yaml")
    return tmp / "recipe.yaml"


def test_precompute_throughput(tiny_target_dir, tmp_path):
    out = run_benchmark("precompute_throughput.py", "--rounds", 1, "--set", f"target.model={tiny_target_dir}",
                        "--set", f"data.source={write_sharegpt(tmp_path / 'c.json', 20)}",
                        "--set", "data.max_length=160", "--set", "precompute.batch_tokens=512")
    head = re.search(rf"target (\S+), 20 samples, ({NUM}) tokens, (\d+) batches, layers \[([\d, ]+)\]", out)
    assert head and head[1] == tiny_target_dir.name and positive(head[2]) and positive(head[3])
    bare = re.search(rf"bare forward +({NUM}) tok/s +\(passes: ([^)]*)\)", out)
    full = re.search(rf"precompute +({NUM}) tok/s +\(passes: ({NUM});", out)
    assert bare and full and [positive(p) for p in bare[2].split(", ")]
    assert len(bare[2].split(", ")) == 2  # before and after the one precompute pass
    measured = positive(re.search(r"ratio +(\S+) +\(target >= 0.9\)", out)[1])
    assert measured == pytest.approx(positive(full[1]) / positive(bare[1]), rel=0.01)
    layers = len(head[4].split(","))
    written = re.search(rf"bytes per token +({NUM}) +minimum ({NUM}) \({layers} layers x 64 x 2 B\): (x\S+)", out)
    assert written and number(written[2]) == layers * 64 * 2 and positive(written[3]) >= 1
    assert positive(written[1]) >= number(written[2])


@pytest.mark.multiprocess
def test_train_throughput(tiny_target_dir, tiny_store):
    """Before and after (fp32 against the machine's precision) and the 1 -> 2 process scaling under torchrun."""
    out = run_benchmark("train_throughput.py", "--features", tiny_store, "--steps", 2, "--rounds", 1,
                        "--set", f"target.model={tiny_target_dir}", "--set", "head.draft_vocab_size=64")
    assert re.search(rf"round 1, before \(precision fp32, {re.escape(str(tiny_store))}\): {NUM} tokens/s", out)
    assert re.search(rf"round 1, after \(precision auto, {re.escape(str(tiny_store))}\): {NUM} tokens/s", out)
    before = re.search(rf"^before +({NUM}) tokens/s$", out, re.M)
    after = re.search(rf"^after +({NUM}) tokens/s +(x\S+)$", out, re.M)
    assert before and after and positive(after[2]) == pytest.approx(positive(after[1]) / positive(before[1]),
                                                                     rel=0.02, abs=0.01)
    one = re.search(rf"^1 process +({NUM}) tokens/s +data wait +({NUM}%)$", out, re.M)
    two = re.search(rf"^2 processes +({NUM}) tokens/s per process, ({NUM}) in all +data wait +({NUM}%)$", out, re.M)
    assert one and two and number(one[2]) <= 100 and number(two[3]) <= 100
    assert positive(two[2]) == pytest.approx(2 * positive(two[1]), abs=2)
    scaling = positive(re.search(r"^scaling 1 -> 2 +(\S+) +\(1.0 = perfect\)$", out, re.M)[1])
    assert scaling == pytest.approx(positive(two[1]) / positive(one[1]), rel=0.01, abs=0.002)


def test_engine_speed(tiny_target_dir, tiny_head):
    """Every method on the same prompts; the engine's own methods decode exactly what the runtime's AR does."""
    out = run_benchmark("engine_speed.py", "--model", tiny_target_dir, "--head", tiny_head, "--prompts", 2,
                        "--new-tokens", 8, "--repeats", 1, "--k", 2, "--dtype", "float32", "--forward-rounds", 1)
    methods = table(out, r"^(?P<name>[\w.-]+(?: [\w=.-]+)?) +(?P<tokens>\d+) +(?P<tps>[\d.]+) +(?P<ratio>[\d.]+x) "
                         r"+(?P<spread>\d+%) +(?P<tau>[\d.]+|-)  (?P<same>\d+)/2$")
    assert list(methods) == ["runtime AR", "transformers AR", "hf-generate", "ngram K=2", "hf-prompt-lookup K=2",
                             "suffix K=2", "chain K=2", "tree N=8"]
    base = methods["runtime AR"]
    assert positive(base["ratio"]) == 1.0 and base["tau"] == "1.00" and int(base["same"]) == 2
    for name, m in methods.items():
        positive(m["tps"]), positive(m["ratio"])
        if name in ("ngram K=2", "suffix K=2", "chain K=2", "tree N=8"):  # verified drafts: exact by construction
            assert m["same"] == "2" and m["tokens"] == base["tokens"] and number(m["tau"]) >= 1, name
        elif m["same"] != "2":  # a peer's output that differs is explained by a near-tie
            assert re.search(rf"^  {re.escape(name)}: differs from runtime AR at token \d+, top-2 gap", out, re.M)
    assert "llama.cpp: reads the embedded GGUF, not measured with --model" in out
    machine = re.search(rf"cpu copy bandwidth ({NUM}) GB/s .* runtime AR ({NUM}) ms/token", out)
    assert machine and positive(machine[1]) and positive(machine[2])
    costs = table(out, r"^(?P<name>runtime|transformers) +(?P<cells>(?:[\d.]+ \([\d.]+\) *){5})$")
    assert list(costs) == ["runtime", "transformers"]
    for cost in costs.values():
        cells = re.findall(r"([\d.]+) \(([\d.]+)\)", cost["cells"])
        assert cells[0][1] == "1.00" and all(positive(ms) and positive(rel) for ms, rel in cells)


def test_head_drafting(tiny_target_dir, tiny_head):
    """The chain with the head's modules and with the fused operations decodes what the runtime's AR does, and the
    drafting steps are timed both ways, after a target forward and back to back."""
    out = run_benchmark("head_drafting.py", "--model", tiny_target_dir, "--head", tiny_head, "--prompts", 2,
                        "--new-tokens", 8, "--repeats", 2, "--k", 2, "--dtype", "float32", "--rounds", 3)
    ways = table(out, r"^\| (?P<name>runtime AR|chain K=2, [\w', ]+) \| (?P<tau>[\d.]+) \| (?P<draft>[\d.]+) / "
                      r"(?P<verify>[\d.]+) \| (?P<tps>[\d.]+) \| (?P<ratio>[\d.]+x) \((?P<low>[\d.]+)-(?P<high>[\d.]+)\) "
                      r"\| (?P<same>\d+)/2 \|$")
    assert list(ways) == ["runtime AR", "chain K=2, head's modules", "chain K=2, fused",
                          "chain K=2, fused, int8 weights"]
    assert number(ways["runtime AR"]["ratio"]) == 1.0 and ways["runtime AR"]["tau"] == "1.00"
    for way in ways.values():
        assert way["same"] == "2" and positive(way["tps"]) and positive(way["ratio"]) and positive(way["verify"])
    for name in ("chain K=2, head's modules", "chain K=2, fused", "chain K=2, fused, int8 weights"):
        assert positive(ways[name]["draft"]) and number(ways[name]["tau"]) >= 1
    steps = table(out, r"^\| (?P<name>head's modules|fused|fused, int8 weights) \| (?P<cold>[\d.]+) ms \| "
                       r"(?P<warm>[\d.]+) ms \|$")
    assert list(steps) == ["head's modules", "fused", "fused, int8 weights"]
    assert all(positive(s["cold"]) and positive(s["warm"]) for s in steps.values())


def test_argmax():
    """Both ways choose the same tokens (the script checks it) and each row count gets its timings and ratios."""
    out = run_benchmark("argmax.py", "--vocab", 1000, "--rows", 1, 4, "--repeats", 3, "--flush-mb", 8)
    rows = table(out, rf"^\| (?P<name>\d+) \| (?P<tw>{NUM}) µs \| (?P<kw>{NUM}) µs \| (?P<rw>{NUM})x \| "
                      rf"(?P<tc>{NUM}) µs \| (?P<kc>{NUM}) µs \| (?P<rc>{NUM})x \|$")
    assert list(rows) == ["1", "4"]
    assert all(positive(v) for row in rows.values() for k, v in row.items() if k != "name")


def test_rms_norm(tiny_target_dir, tiny_head):
    """Both ways agree (the script checks it), each row count gets its timings, and the decoding ways run the chain:
    with only the head's norms on the kernel, every output is torch's way's."""
    out = run_benchmark("rms_norm.py", "--rows", 1, 4, "--width", 64, "--repeats", 3, "--flush-mb", 8, "--decode", 2,
                        "--decode-repeats", 2, "--new-tokens", 8, "--model", tiny_target_dir, "--head", tiny_head,
                        "--target-dtype", "float32")
    rows = table(out, rf"^\| (?P<name>\d+) \| (?P<tw>{NUM}) µs \| (?P<kw>{NUM}) µs \| (?P<rw>{NUM})x \| "
                      rf"(?P<tc>{NUM}) µs \| (?P<kc>{NUM}) µs \| (?P<rc>{NUM})x \|$")
    assert list(rows) == ["1", "4"]
    assert all(positive(v) for row in rows.values() for k, v in row.items() if k != "name")
    ways = table(out, rf"^\| (?P<name>torch|kernel in drafting|kernel) \| (?P<draft>{NUM}) / (?P<verify>{NUM}) \| "
                      rf"(?P<tps>{NUM}) \((?P<low>{NUM})-(?P<high>{NUM})\) \| (?P<same>\d+)/2 \|$")
    assert list(ways) == ["torch", "kernel in drafting", "kernel"]
    assert ways["torch"]["same"] == ways["kernel in drafting"]["same"] == "2"
    assert all(positive(way[k]) for way in ways.values() for k in ("draft", "verify", "tps"))
    assert re.search(rf"^kernel in drafting / torch tokens/s: {NUM}x \({NUM}-{NUM}\)$", out, re.M)


def test_prefetch(tiny_target_dir, tiny_head):
    """Every row count gets both ways' times and a ratio, the rule says what it chooses, and the decoding ways run
    the chain at temperature 1 with the same outputs (prefetching changes no product's result)."""
    out = run_benchmark("prefetch.py", "--rows", 1, 4, 8, "--pairs", 3, "--decode", 2, "--decode-repeats", 2,
                        "--new-tokens", 8, "--model", tiny_target_dir, "--head", tiny_head, "--target-dtype", "float32",
                        "--from", 2, 9, "--temperature", 1, "--stop", 0.3)
    rows = table(out, rf"^\| (?P<name>\d+) \| (?P<ahead>{NUM}) \| (?P<none>{NUM}) \| (?P<ratio>{NUM}) \| "
                      rf"(?P<low>{NUM})-(?P<high>{NUM}) \|$")
    assert list(rows) == ["1", "4", "8"]
    assert all(positive(v) for row in rows.values() for k, v in row.items() if k != "name")
    assert re.search(r"^the rule's choice: (passes of (2|5|9) or more rows prefetch|none \(the control's ratio is "
                     r"off 1: too noisy to choose\))$", out, re.M)
    ways = table(out, rf"^\| (?P<name>from \d+) \| (?P<draft>{NUM}) / (?P<verify>{NUM}) \| "
                      rf"(?P<tps>{NUM}) \((?P<low>{NUM})-(?P<high>{NUM})\) \| (?P<same>\d+)/2 \|$")
    assert list(ways) == ["from 2", "from 9"] and ways["from 9"]["same"] == "2"
    assert all(positive(way[k]) for way in ways.values() for k in ("draft", "verify", "tps"))
    assert re.search(rf"^from 9 / from 2 tokens/s: {NUM}x \({NUM}-{NUM}\)$", out, re.M)


def test_stage_speed(varied_target_dir, tmp_path):
    """Both stages on the runtime and on the former path; in float32 the regenerated answers are the same."""
    out = run_benchmark("stage_speed.py", "--conversations", 6, "--regenerate-conversations", 6, "--rounds", 1,
                        "--set", f"target.model={varied_target_dir}", "--set", "target.dtype=float32",
                        "--set", f"data.source={write_sharegpt(tmp_path / 'c.json', 6)}", "--set",
                        "data.max_length=160", "--set", "regenerate.max_new_tokens=16")
    assert re.search(rf"round 1, before: regenerate {NUM} tok/s, precompute {NUM} tok/s", out)
    assert re.search(rf"round 1, after: regenerate {NUM} tok/s, precompute {NUM} tok/s", out)
    stages = table(out, r"^(?P<name>regenerate|precompute) +(?P<before>\d+) +(?P<after>\d+) +(?P<ratio>[\d.]+x)$")
    assert list(stages) == ["regenerate", "precompute"]
    for stage in stages.values():
        assert positive(stage["before"]) and positive(stage["after"]) and positive(stage["ratio"])
    same = re.search(r"regenerated answers identical before/after: (\d+)/(\d+) \(after computes in float32\)", out)
    assert same and int(same[2]) >= 6 and same[1] == same[2]


def test_kept_states(varied_target_dir, tmp_path):
    """Both ways of making a store, alternately; the stores hold the same conversations with close states."""
    out = run_benchmark("kept_states.py", "--conversations", 8, "--rounds", 2,
                        "--set", f"target.model={varied_target_dir}", "--set", "target.dtype=float32",
                        "--set", f"data.source={write_sharegpt(tmp_path / 'c.json', 8)}", "--set",
                        "data.max_length=160", "--set", "regenerate.max_new_tokens=16", "--set",
                        "data.validation_fraction=0")
    for r, way in ((1, "kept"), (1, "computed"), (2, "computed"), (2, "kept")):
        run = re.search(rf"round {r}, {way} *: regenerate +{NUM} s, precompute +{NUM} s, both +{NUM} s "
                        r"\([\d,]+ answer tokens, store ([\d,]+) tokens, ([\d,]+) copied\)", out)
        assert run, (r, way)
        store, copied = (int(x.replace(",", "")) for x in run.groups()[-2:])
        assert store > 0 and copied == (store if way == "kept" else 0)
    assert re.search(rf"both stages: {NUM}x faster with the states kept \(rounds: {NUM}, {NUM}\)", out)
    same = re.search(r"(\d+) of (\d+) conversations with the same ids both ways; states: largest difference "
                     r"([\d.e+-]+), mean relative difference ([\d.e+-]+)", out)
    assert same and same[1] == same[2] and int(same[1]) >= 6
    assert float(same[4]) < 1e-2


def test_decode_attention():
    out = run_benchmark("decode_attention.py", "--rows", 4, "--rounds", 1, "--steps", 1)
    assert re.search(rf"kernel loaded in {NUM} s", out)
    memory = re.search(rf"memory: copy ({NUM}) GB/s \(read \+ written\), read ({NUM}) GB/s", out)
    assert memory and positive(memory[1]) and positive(memory[2])
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"^{dtype}: 4 rows, lengths 60..384 \(mean \d+\), bands \[[\d, ]+\]; live K/V per step "
                         r"\d+ MB", out, re.M), dtype
    runs = re.findall(r"^(plain|kernel|kernel-one) +([\d.]+) +[\d.]+-[\d.]+ +([\d.]+) +([\d.]+x)$", out, re.M)
    assert [r[0] for r in runs] == ["plain", "kernel", "kernel-one"] * 2  # per dtype
    for name, ms, _, times in runs:
        assert positive(ms) and (positive(times) == 1.0 if name == "plain" else positive(times))


def test_cuda_shapes(tmp_path):
    """The dry run (CPU, shrunk shapes): every part and choice timed and recorded; on the CPU no kernel is cuDNN's."""
    out = run_benchmark("cuda_shapes.py", "--dry-run", "--shapes", 2, "--out", tmp_path / "shapes.json")
    rows = table(out, rf"^(?P<name>(train|precompute) (default|no_cudnn|default_pad64)): first visits "
                      rf"(?P<first>{NUM}) s, second (?P<second>{NUM}) s \((?P<ratio>{NUM})x no_cudnn's\), "
                      rf"-?{NUM} ms more per new shape")
    assert sorted(rows) == ["precompute default", "precompute no_cudnn", "train default", "train default_pad64",
                            "train no_cudnn"]
    assert all(number(r["first"]) >= 0 and number(r["second"]) >= 0 and positive(r["ratio"]) for r in rows.values())
    record = json.loads((tmp_path / "shapes.json").read_text())
    train = record["train"]
    assert [len(train[c]["lengths"]) for c in ("default", "no_cudnn", "default_pad64")] == [2, 2, 2]
    lengths = [n for c in ("default", "no_cudnn", "default_pad64") for n in train[c]["lengths"]]
    assert len(set(lengths)) == 6 and not any(n % 64 == 0 for n in lengths)  # no choice meets another's shapes
    assert not any("cudnn" in op for part in ("train", "precompute") for c in ("default", "no_cudnn")
                   for op in record[part][c]["attention_ops"])


def test_batch_step(tiny_target_dir):
    out = run_benchmark("batch_step.py", "--model", tiny_target_dir, "--rows", 6, "--chunks", 20, "--steps", 2)
    assert re.search(r"^6 rows of 60-384 positions, chunks \[20\]; bands \[(\(\d+, \d+\)(, )?)+\]$", out, re.M)
    settings = table(out, r"^(?P<name>torch|layer-ops|kernels) +(?P<ms>[\d.]+) +[\d.]+-[\d.]+ +(?P<ratio>[\d.]+x)$")
    assert list(settings) == ["torch", "layer-ops", "kernels"]
    assert positive(settings["torch"]["ratio"]) == 1.0
    assert all(positive(s["ms"]) and positive(s["ratio"]) for s in settings.values())


def test_products(tiny_target_dir):
    out = run_benchmark("products.py", "--model", tiny_target_dir, "--rows", "1,4", "--repeats", 1)
    assert f"17 products of the target {tiny_target_dir} (4 layers and the LM head)" in out
    names = re.search(r"^ rows((?: +\w+)+)$", out, re.M)[1].split()
    assert names[0] == "linear" and set(names) <= {"linear", "packed", "native"}
    passes = table(out, r"^ +(?P<name>[14]) (?P<cells>.* GB/s.*)$")
    assert list(passes) == ["1", "4"]
    for row in passes.values():
        cells = re.findall(r"([\d.]+) ms +([\d.]+) GB/s(?: ([\d.]+x))?", row["cells"])
        assert len(cells) == len(names) and all(positive(ms) for ms, _, _ in cells)
        if "packed" in names:  # the ratios are against oneDNN's packed product
            assert [positive(r) for _, _, r in cells][names.index("packed")] == 1.0
    steps = table(out, r"^ +(?P<name>[148]) (?P<cells>(?: +[\d.]+ ms)+)$")
    assert list(steps) == ["1", "4", "8"]
    assert all(len(re.findall(r"[\d.]+ ms", s["cells"])) == len(names) for s in steps.values())


def test_products_beside_other_kernels(tiny_target_dir, tmp_path):
    """--kernels-at: the native product of another copy of csrc/ (here the checkout's own, so nothing is built
    again) in a column of its own, every row timed; a copy that does not compile, or a revision git cannot read,
    is an error that names it."""
    args = ("--model", tiny_target_dir, "--rows", "1,4", "--repeats", 1, "--no-steps", "--dtype", "float32")
    if blocked_linear_kernel(torch.float32) is None:  # no AVX2 here: the benchmark says so rather than time nothing
        done = subprocess.run([sys.executable, "benchmarks/products.py", *map(str, args), "--kernels-at",
                               "mtptrain/runtime/csrc"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode != 0 and "no native product for float32" in done.stderr
        return
    out = run_benchmark("products.py", *args, "--kernels-at", "mtptrain/runtime/csrc")
    header = re.search(r"^ rows(.*)$", out, re.M)[1]
    assert header.split()[-2:] == ["native", "@mtptrain/runtime/csrc"]
    columns = len(re.findall(r"linear|packed|native(?:, bf16 values| @\S+)?", header))
    passes = table(out, r"^ +(?P<name>[14]) (?P<cells>.* GB/s.*)$")
    assert list(passes) == ["1", "4"]
    for row in passes.values():
        cells = re.findall(r"([\d.]+) ms +([\d.]+) GB/s", row["cells"])
        assert len(cells) == columns and all(positive(ms) and positive(rate) for ms, rate in cells)
    done = subprocess.run([sys.executable, "benchmarks/products.py", *map(str, args), "--kernels-at",
                           "no-such-revision"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "--kernels-at no-such-revision: git archive could not read" in done.stderr
    broken = tmp_path / "csrc"  # the copy given is what is built: one that cannot compile fails (at once)
    shutil.copytree(ROOT / "mtptrain/runtime/csrc", broken)
    (broken / "kernels.cpp").write_text('#include "no_such_header.h"\n')
    done = subprocess.run([sys.executable, "benchmarks/products.py", *map(str, args), "--kernels-at", str(broken)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and f"--kernels-at {broken}: its kernels did not build" in done.stderr


def test_row_attention(tiny_target_dir):
    """Each kernel alone and in the whole forward, against the first named; each forward relative to one token."""
    out = run_benchmark("row_attention.py", "--model", tiny_target_dir, "--kernels", "fused,sdpa,plain",
                        "--rounds", 1, "--prefix", 8)
    assert re.search(r"^target .*: (float32|bfloat16)", out, re.M)
    assert re.search(rf"other processes used {NUM} CPU cores", out)
    alone = table(out, r"^(?P<name>fused|sdpa|plain) +(?P<one>[\d.]+) \((?P<r1>[\d.]+x)\) +(?P<four>[\d.]+) "
                       r"\((?P<r4>[\d.]+x)\)$")
    assert list(alone) == ["fused", "sdpa", "plain"]
    assert all(positive(a["one"]) and positive(a["four"]) and positive(a["r1"]) and positive(a["r4"])
               for a in alone.values())
    assert number(alone["fused"]["r1"]) == number(alone["fused"]["r4"]) == 1.0
    forward = table(out, r"^(?P<name>fused|sdpa|plain)(?P<cells>(?: +[\d.]+ \([\d.]+\) [\d.]+x){4})$")
    assert list(forward) == ["fused", "sdpa", "plain"]
    for name, row in forward.items():
        cells = re.findall(r"([\d.]+) \(([\d.]+)\) ([\d.]+)x", row["cells"])
        assert len(cells) == 4 and all(positive(ms) and positive(rel) and positive(ratio) for ms, rel, ratio in cells)
        assert number(cells[0][1]) == 1.0
        if name == "fused":
            assert all(number(ratio) == 1.0 for _, _, ratio in cells)


def test_retokenization(tiny_target_dir):
    """Every answer of both turns counted, and no more differing tokens than decoded ones."""
    out = run_benchmark("retokenization.py", "--model", tiny_target_dir, "--prompts", 3, "--turns", 2,
                        "--new-tokens", 8)
    rows = table(out, r"^\| (?P<name>\d) \| (?P<answers>\d+) \| (?P<tokens>[\d,]+) \| (?P<differing>\d+) \| "
                      r"(?P<missing>[\d,]+) \((?P<share>[\d.]+)%\) \|$")
    assert list(rows) == ["1", "2"]
    for row in rows.values():
        assert row["answers"] == "3" and 0 < number(row["tokens"]) <= 3 * 8
        assert int(row["differing"]) <= 3 and number(row["missing"]) <= number(row["tokens"])
        assert abs(number(row["share"]) - 100 * number(row["missing"]) / number(row["tokens"])) < 0.006
    assert re.search(r"^most frequent differences .*, of \d+:$", out, re.M)


def test_retokenization_reads_each_stored_answer_without_its_end_marker(tiny_target_dir):
    from mtptrain.config import TargetConfig
    from mtptrain.target.loading import load_tokenizer

    stored_answers = runpy.run_path(str(ROOT / "benchmarks" / "retokenization.py"))["stored_answers"]
    tok = load_tokenizer(TargetConfig(model=str(tiny_target_dir)))
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, like"}]
    answers = stored_answers(tok, messages, frozenset({1}))
    assert [tok.decode(a) for a in answers] == ["Blue, like the sky.", "Green, like"]
    assert all(t not in tok.all_special_ids for a in answers for t in a)


def test_first_turns(tiny_target_dir, tmp_path):
    """Each conversation's messages up to its first answer, that answer cut to its first --cut tokens; one without
    an answer left out; a damaged line is named by file and line, and nothing is written for it."""
    from transformers import AutoTokenizer

    recipe = tmp_path / "recipe.yaml"
    dump_recipe(load_recipe(None, [f"target.model={tiny_target_dir}"]), recipe)
    long_answer = "the cat sat on the mat and the dog ran to the hot sun " * 3
    rows = [{"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": long_answer},
                                     {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]},
            {"id": "b", "messages": [{"role": "user", "content": "no answer yet"}]},
            {"id": "c", "messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "yes"}]}]
    source = tmp_path / "regenerated.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "first-turns.jsonl"
    printed = run_benchmark("first_turns.py", source, out, "--cut", 5, "--recipe", recipe)
    assert f"2 first turns, answers cut at 5 tokens -> {out}" in printed
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["a", "c"]
    assert [m["role"] for m in written[0]["messages"]] == ["system", "user", "assistant"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tokenizer(long_answer, add_special_tokens=False)["input_ids"]
    assert len(ids) > 5 and written[0]["messages"][-1]["content"] == tokenizer.decode(ids[:5])
    assert written[1]["messages"][-1]["content"] == "yes"

    source.write_text(json.dumps(rows[0]) + "\n{not json\n")
    damaged = tmp_path / "damaged.jsonl"
    done = subprocess.run([sys.executable, "benchmarks/first_turns.py", str(source), str(damaged), "--recipe",
                           str(recipe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"{source.name}:2: malformed JSON" in done.stderr
    assert not damaged.exists() and not damaged.with_name("damaged.jsonl.tmp").exists()


def test_ssd(tiny_target_dir, tiny_head):
    """Autoregressive, speculative and speculative speculative decoding with the draft model, all equal to ar-2;
    then the sweeps with the head (each SSD worker is a process of its own: one for each of the three)."""
    out = run_benchmark("ssd.py", "--model", tiny_target_dir, "--head", tiny_head, "--prompts", 2, "--new-tokens", 8,
                        "--k", 2, "--drafters", "draft", "--draft-layers", 2, "--sweep-drafters", "head", "--budget", 4,
                        "--budgets", 4, "--factors", 0.5)
    assert "drafters: head = head, draft = first 2 of 4 layers" in out
    methods = table(out, r"^(?P<name>ar-\d|sd-\d \w+|ssd \w+) +(?P<tps>[\d.]+) +(?P<ratio>[\d.]+) +(?P<tau>[\d.]+) "
                         r"+(?P<draft>[\d.]+) +(?P<verify>[\d.]+) +(?P<same>\d+)/2$")
    assert list(methods) == ["ar-2", "ar-1", "sd-2 draft", "sd-1 draft", "ssd draft"]
    assert positive(methods["ar-2"]["ratio"]) == 1.0
    for name, m in methods.items():
        assert m["same"] == "2" and positive(m["tps"]) and positive(m["ratio"]) and number(m["tau"]) >= 1, name
        assert positive(m["verify"]) and (number(m["draft"]) == 0 if name.startswith("ar-") else positive(m["draft"]))
    cache = r"hit rate (?P<rate>[\d.]+) \((?P<by_j>[^)]*)\), (?P<guesses>\d+) guesses, (?P<cut>\d+) rounds cut short"
    hits = re.search(rf"^ssd draft: {cache}$", out, re.M)
    assert hits
    by_j = [tuple(map(int, x)) for x in re.findall(r"j=\d+:(\d+)/(\d+)", hits["by_j"])]
    assert by_j and all(h <= n for h, n in by_j)
    assert number(hits["rate"]) == pytest.approx(sum(h for h, _ in by_j) / sum(n for _, n in by_j), abs=0.005)
    # the sweeps spend every round's budget before the next draft: no round is cut short
    swept = re.search(rf"^  budget +4: {cache}; tau (?P<tau>[\d.]+)$", out, re.M)
    assert swept and int(swept["cut"]) == 0 and int(swept["guesses"]) > 0 and number(swept["tau"]) >= 1
    factor = re.search(rf"^  C 0.5 *: {cache}; acceptance at position 1 (?P<accepted>[\d.]+), tau (?P<tau>[\d.]+)$",
                       out, re.M)
    assert factor and int(factor["cut"]) == 0 and number(factor["accepted"]) <= 1 and number(factor["tau"]) >= 1


@pytest.fixture(scope="module")
def ablation(head_recipe, tmp_path_factory) -> tuple[Path, str]:
    """One arm of the ablations, trained two steps and evaluated, scored by head_agreement.py on that eval's
    answers: its output directory and what it printed."""
    out = tmp_path_factory.mktemp("ablations")
    printed = run_benchmark("ablations.py", "--recipe", head_recipe, "--out", out, "--arms", "eagle3", "--k", "[2]",
                            "--prompts", 1, "--turns", 1, "--tokens", 8, "--no-curve", "--agreement-eval",
                            out / "eagle3" / "eval", "--set", "train.max_steps=2")
    return out, printed


def test_ablations(ablation):
    out, printed = ablation
    report = json.loads((out / "ablations.json").read_text())
    (arm,) = report["arms"]
    assert arm["arm"] == "eagle3" and arm["steps"] == 2 and arm["tokens"] > 0 and report["curve"] == []
    assert len(arm["val_acc"]) == 2 and all(0 <= a <= 1 for a in arm["val_acc"])
    (chain,) = arm["chains"]
    assert chain["label"] == "chain K=2" and chain["tau"] >= 1 and positive(str(chain["speedup"]))
    results = json.loads((out / "eagle3" / "eval" / "results.json").read_text())
    assert results["methods"][1]["exactness"] == {"checked": 1, "identical": 1, "near_ties": [], "failures": []}
    row = rf"\| eagle3 \| 2 \| {arm['tokens']:,} \| [\d. /]+ \| [\d. /]+ \| [\d. /]+ \| chain K=2 \| [\d.]+ \| 1.00x \|"
    assert re.search(row, (out / "ablations.md").read_text())
    assert re.search(row, printed)


def test_head_agreement_scores_the_first_tokens_of_each_answer():
    keep = runpy.run_path(str(ROOT / "benchmarks" / "head_agreement.py"))["answer_prefix"]
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.uint8)
    assert keep(2)(mask).tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert keep(11)(mask).tolist() == mask.tolist() and keep(2)(mask).dtype == mask.dtype


def test_head_agreement(ablation, head_recipe):
    """The ablation's head scored teacher-forced on the store's validation split and on its eval's answers."""
    out, printed = ablation
    head = out / "eagle3" / "train" / "head"
    scores = json.loads((out / "eagle3" / "agreement.json").read_text())
    assert list(scores) == ["held-out: the training stores' validation split", "MT-bench: the eval's baseline answers"]
    assert all(len(acc) == 2 and all(0 <= a <= 1 for a in acc) for acc in scores.values())
    manifest = json.loads((Path(load_recipe(head_recipe).train.features) / "manifest.json").read_text())
    text = (out / "eval-answers" / "agreement.md").read_text()
    assert f"Teacher-forced top-1 agreement of {head} with the target, per draft position" in text
    for (name, acc), count in zip(scores.items(), (manifest["totals"]["validation"]["samples"], 1)):
        assert f"| {name} | {count} | {' / '.join(f'{a:.3f}' for a in acc)} |" in text
    assert re.search(r"^- chain K=2: [\d.]+ / [\d.]+$", text, re.M)
    assert text.strip() in printed
    assert json.loads((out / "ablations.json").read_text())["arms"][0]["agreement"] == scores


@pytest.mark.interop
def test_peer_speculators(head_recipe, tmp_path):
    """speculators' trainer (its own environment, scripts/setup_interop.sh, which the benchmark runs) and ours on
    the same store, both heads evaluated."""
    environment("scripts/setup_interop.sh")  # the suite's background build of it, done (the benchmark's own run: seconds)
    out = tmp_path / "peer"
    printed = run_benchmark("peer_speculators.py", "--recipe", head_recipe, "--out", out, "--prompts", 1,
                            "--k", "[2]", "--total-seq-len", 256, "--eval-set", "eval.max_new_tokens=6")
    theirs = json.loads((out / "speculators-head" / "config.json").read_text())
    assert theirs["imported"] and theirs["head"]["kind"] == "eagle3"
    for name in ("mtptrain", "speculators"):
        results = json.loads((out / f"eval-{name}" / "results.json").read_text())
        assert results["methods"][1]["exactness"] == {"checked": 1, "identical": 1, "near_ties": [], "failures": []}
        assert results["settings"]["max_new_tokens"] == 6  # --eval-set reaches both evals
        assert re.search(rf"^\| {name} \| chain K=2 \| [\d.]+ \| [\d.]+x \| [\d.]+ / [\d.]+ \|$", printed, re.M)
    tokens = re.search(rf"training tokens: mtptrain ({NUM}); speculators 1 x ({NUM})", printed)
    assert tokens and positive(tokens[1]) and positive(tokens[2])


@pytest.fixture(scope="module")
def served_head(served_target_dir, tmp_path_factory) -> Path:
    """A random EAGLE-3 head of the tiny target vLLM serves (tests/conftest.py), exported as vLLM reads it."""
    from mtptrain.config import TargetConfig
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import save_head
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.target import load_target

    # feature layers from 1, as eagle3 exports want them (SGLang's numbering is ambiguous otherwise)
    spec = HeadSpec("eagle3", last_layer=4, feature_layers=[1, 2, 3], ttt_steps=2, draft_vocab_size=64)
    target = load_target(TargetConfig(model=str(served_target_dir), dtype="float32"))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("served-head") / "head"
    save_head(out, spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    return out


@pytest.mark.vllm
def test_vllm_side_by_side(served_target_dir, served_head, tmp_path):
    """Both engines on the tiny target in float32: the tables, the serving check's line, the regeneration rates."""
    environment("scripts/setup_vllm.sh")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("the word is hot and you", "say it")))
    out = run_benchmark("vllm_side_by_side.py", "--model", served_target_dir, "--head", served_head, "--prompts", prompts,
                        "--questions", 2, "--turns", 1, "--new-tokens", 8, "--k", 2, "--dtypes", "float32",
                        "--regenerate-conversations", 4, "--regenerate-tokens", 8, "--rows", 2,
                        "--regenerate-dtype", "float32", "--out", tmp_path / "out",
                        "--set", f"data.source={write_sharegpt(tmp_path / 'c.json', 4)}", "--set", "data.max_length=200")
    rows = table(out, rf"^(?P<name>(?:vllm )?(?:baseline|chain K=2)) +(?P<tau>{NUM}) +(?P<per_request>{NUM}|-) "
                      rf"+(?P<tps>{NUM}) +(?P<speedup>{NUM}x)  (?P<exact>\d+/\d+|-) ")
    assert list(rows) == ["baseline", "chain K=2", "vllm baseline", "vllm chain K=2"]
    for row in rows.values():
        positive(row["tps"]), positive(row["speedup"])
    assert rows["baseline"]["speedup"] == rows["vllm baseline"]["speedup"] == "1.00x"
    assert rows["chain K=2"]["exact"] == rows["vllm chain K=2"]["exact"] == "2/2"
    assert re.search(r"baselines identical across engines: 2/2; acceptance gap per position", out)
    assert re.search(rf"batch-1 decoding in float32: runtime {NUM} tok/s, vLLM {NUM} tok/s", out)
    engines = table(out, rf"^(?P<name>vllm|runtime) +(?P<tps>{NUM}) +(?P<ratio>{NUM}x)$")
    assert positive(engines["vllm"]["ratio"]) == 1.0 and positive(engines["runtime"]["tps"])
    same = re.search(r"regenerated answers identical across engines: (\d+)/(\d+)", out)
    assert same and int(same[2]) >= 3
    record = json.loads((tmp_path / "out" / "side_by_side.json").read_text())
    assert record["evals"][0]["dtype"] == "float32" and record["regenerate"]["compared"] == int(same[2])
