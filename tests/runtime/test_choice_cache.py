"""The runtime's measured choice (runtime/choice.py) against a cache file anyone can edit and a machine that is
not always quiet: entries that do not validate are measured again with one warning, a measurement taken under
load is never cached, the ranks of a group use rank 0's timings, and a report names the kernels that ran."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from mtptrain.runtime import attention, choice, native_kernels, products
from mtptrain.runtime.products import PRODUCTS

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def _timings(products: dict, attention_kernel: str = "sdpa") -> dict:
    """A valid entry's timings: `products` (name -> ms) in both dtypes, one attention kernel everywhere."""
    sections = {"products": products, "products_batch": products,
                **{s: {attention_kernel: 0.5} for s in ("attention_one", "attention_many", "attention_batch")}}
    return {"float32": sections, "bfloat16": json.loads(json.dumps(sections))}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    native_kernels.extension()  # built (or loaded) in the suite's cache, not compiled again in tmp_path
    monkeypatch.setenv("MTPTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "other_load", lambda start, end: 0.0)  # a quiet machine unless a test says not
    return tmp_path / "runtime-choice.json"


def _key() -> str:
    return choice.machine_key(_config())


def test_a_change_to_the_kernels_sources_is_measured_again(cache, monkeypatch, tmp_path):
    before = _key()
    extra = tmp_path / "changed.h"
    extra.write_text("// a kernel's source changed\n")
    monkeypatch.setattr(native_kernels, "HEADERS", [*native_kernels.HEADERS, extra])
    after = _key()
    assert after != before and after.split("|kernels=")[0] == before.split("|kernels=")[0]


@pytest.mark.parametrize("content", [
    "null", "[]", '"abc"', "{not json", "[" * 100_000,  # the last nested past the JSON parser's depth
    json.dumps({"@KEY": None}),
    json.dumps({"@KEY": {"timings": {"float32": {}}}}),  # fields missing: once `min() arg is an empty sequence`
    json.dumps({"@KEY": {"timings": _timings({"turbo": 0.1})}}),  # a kernel that does not exist: once a KeyError
    json.dumps({"@KEY": {"timings": _timings({"linear": -1.0})}}),
    json.dumps({"@KEY": {"timings": _timings({"linear": True})}}),
    json.dumps({"@KEY": {"timings": _timings({"linear": 1.0}, attention_kernel="flash")}}),
])
def test_a_cache_entry_that_does_not_validate_is_measured_again_with_one_warning(cache, content, caplog):
    cache.write_text(content.replace("@KEY", _key()))
    with caplog.at_level(logging.WARNING, logger="mtptrain.runtime.choice"):
        picked = choice.choose(_config(), CPU)
    assert picked.source == "measured"
    assert picked.product in PRODUCTS and picked.attention_one in (*attention.ATTENTION, "fused")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(cache) in warnings[0].getMessage()
    assert json.loads(cache.read_text())[_key()]["timings"] == picked.timings  # replaced by the new measurement
    assert choice.choose(_config(), CPU).source == "cached"


def test_a_valid_cache_entry_is_used_as_it_is(cache):
    cache.write_text(json.dumps({_key(): {"timings": _timings({"linear": 1.0, "skinny": 0.5})}}))
    picked = choice.choose(_config(), CPU)
    assert (picked.source, picked.product, picked.dtype) == ("cached", "skinny", torch.float32)


def test_a_measurement_under_load_is_used_by_its_process_and_never_cached(cache, monkeypatch, caplog):
    monkeypatch.setattr(choice, "other_load", lambda start, end: 1.0)
    with caplog.at_level(logging.WARNING, logger="mtptrain.runtime.choice"):
        first = choice.choose(_config(), CPU)
    assert first.source == "measured under load"
    assert "not cached" in caplog.text and "mtptrain measure" in caplog.text
    assert not cache.exists() or _key() not in json.loads(cache.read_text())
    measured = []
    monkeypatch.setattr(choice, "_measure_kernels", lambda config: measured.append(1))
    assert choice.choose(_config(), CPU).timings == first.timings and not measured  # not measured twice
    monkeypatch.undo()
    monkeypatch.setenv("MTPTRAIN_CACHE", str(cache.parent))
    monkeypatch.setattr(choice, "other_load", lambda start, end: 0.0)
    timings, source = choice.measure(_config())  # `mtptrain measure` on a quiet machine
    assert source == "measured" and json.loads(cache.read_text())[_key()]["timings"] == timings
    assert choice.choose(_config(), CPU).source == "cached"


def test_the_report_names_the_kernels_that_run_where_the_native_ones_do_not_build(cache, monkeypatch):
    cache.write_text(json.dumps({_key(): {"timings": _timings({"native": 0.1, "linear": 1.0}, "fused")}}))
    monkeypatch.setattr(products, "blocked_linear_kernel", lambda dtype: None)
    monkeypatch.setattr(attention, "decode_attention_kernel", lambda: None)
    picked = choice.choose(_config(), CPU)
    assert picked.product in ("packed", "linear") and picked.product_batch in ("packed", "linear")
    assert {picked.attention_one, picked.attention_many, picked.attention_batch} == {"plain"}
    described = picked.describe()
    assert "did not build" in described and "native runs as" in described
    assert "products native" not in described and "attention fused" not in described
    assert picked.record()["product"] == picked.product


AGREE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, transformers
    rank = int(sys.argv[1])
    os.environ["MTPTRAIN_CACHE"] = sys.argv[2 + rank]  # each rank its own cache, with other timings in it
    from mtptrain.runtime import choice
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=2)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    alone = choice.choose(config, torch.device("cpu")).product
    choice.agree(config, torch.device("cpu"))
    agreed = choice.choose(config, torch.device("cpu"))
    print(json.dumps({"alone": alone, "agreed": agreed.product, "source": agreed.source}), flush=True)
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort the interpreter's own shutdown ("terminate called ...")
""")


def test_the_ranks_of_a_group_run_rank_0s_choice(tmp_path):
    caches = []
    for rank, fastest in enumerate(("skinny", "linear")):
        directory = tmp_path / f"cache{rank}"
        directory.mkdir()
        key = choice.machine_key(_config()).replace(f"threads={torch.get_num_threads()}", "threads=1")
        products = {"linear": 1.0, "skinny": 1.0, fastest: 0.1}
        (directory / "runtime-choice.json").write_text(json.dumps({key: {"timings": _timings(products)}}))
        caches.append(str(directory))
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), *caches, str(tmp_path / "rendezvous")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for rank in range(2)]
    results = []
    for process in ranks:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["alone"] for r in results] == ["skinny", "linear"]  # each rank's own cache disagrees
    assert [r["agreed"] for r in results] == ["skinny", "skinny"]
    assert results[1]["source"] == "cached by rank 0"


TOGETHER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch, transformers
    from mtptrain.runtime import choice
    # A quiet machine, as in the tests above: the cores' other users (a CI host's neighbours, its steal time)
    # would make both processes measure "under load" and cache nothing. Without the lock both still measure.
    choice.other_load = lambda start, end: 0.0
    ready = Path(sys.argv[1])
    (ready / f"ready-{os.getpid()}").touch()
    while len(list(ready.glob("ready-*"))) < 2:  # both imported: neither loads the cores while the other measures
        time.sleep(0.05)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    picked = choice.choose(config, torch.device("cpu"))
    print(json.dumps({"source": picked.source, "dtype": str(picked.dtype), "product": picked.product}))
""")


def test_processes_started_together_measure_once_and_choose_alike(tmp_path):
    """Ranks without a process group (srun tasks, a job array) share the machine's cache: one measures while
    the others wait idle, and they read its answer."""
    suite_cache = Path(os.environ["MTPTRAIN_CACHE"])
    native_kernels.extension()  # built in the suite's cache; the processes below load it from there
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(suite_cache / "kernels", target_is_directory=True)
    script = tmp_path / "together.py"
    script.write_text(TOGETHER)
    env = {**os.environ, "MTPTRAIN_CACHE": str(cache)}
    processes = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(2)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["source"] for r in results) == ["cached", "measured"]
    assert results[0]["dtype"] == results[1]["dtype"] and results[0]["product"] == results[1]["product"]
