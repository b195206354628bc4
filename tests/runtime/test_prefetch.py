"""The products' prefetch (csrc/blocked_linear.cpp, runtime/prefetch.py): from how many rows a pass prefetches
changes no product's result, bit for bit; the decoder sets its own before each forward; the rule reads the timed
ratios as documented; the measurement on a model's forwards is cached only when it can be trusted, and a cached
entry is checked before use."""

import functools
import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.machine import cpu_flags
from mtptrain.runtime import prefetch
from mtptrain.runtime.cache import NoCache
from mtptrain.runtime.native_kernels import blocked_linear_kernel, extension
from mtptrain.runtime.products import blocked, blocked_product, int8_blocked, int8_product
from mtptrain.runtime.runner import load_decoder

from test_native import _model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    extension()  # built (or loaded) in the suite's cache, not compiled again in tmp_path
    monkeypatch.setenv("MTPTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(prefetch, "other_load", lambda start, end: 0.0)  # a quiet machine unless a test says not
    monkeypatch.setattr(prefetch, "_SETTLED", {})
    monkeypatch.setattr(prefetch, "_one_token_seconds", lambda decoder: 1e-3)  # 40 pairs fit any budget used here
    yield tmp_path / "runtime-prefetch.json"
    extension().blocked_prefetch_from(prefetch.DEFAULT_FROM)


# the runtime's own product for short inputs and for batches, whatever this machine measured for a tiny model
NATIVE = {"dtype": "float32", "product": "native", "product_batch": "native", "attention_one": "sdpa",
          "attention_many": "sdpa", "attention_batch": "sdpa"}


@pytest.fixture
def decoder():
    """A tiny model's decoder on the runtime's own product (its prefetch measured whatever its size)."""
    built = load_decoder(_model("llama"), record=NATIVE)
    assert built is not None and prefetch.applies(built), built.describe()
    return built


PRODUCTS = [("bfloat16", blocked, blocked_product), ("float32", blocked, blocked_product),
            ("float32 over bfloat16 blocks", blocked, blocked_product), ("int8", int8_blocked, int8_product)]


@pytest.mark.parametrize("kind,lay_out,product", PRODUCTS, ids=[p[0] for p in PRODUCTS])
def test_where_passes_prefetch_changes_no_product_bit_for_bit(kind, lay_out, product):
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    if kind == "bfloat16" and blocked_linear_kernel(torch.bfloat16) is None:
        # only a CPU without avx512_bf16 lacks it (a build that lost it fails here): there torch's product runs,
        # which has no prefetch to set
        assert "avx512_bf16" not in (cpu_flags() or ""), "the kernels were built without their bfloat16 product"
        pytest.skip("no bfloat16 product on this CPU (it needs avx512_bf16): torch's runs instead")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g)
    w = w.bfloat16() if kind == "bfloat16" else (w.bfloat16().float() if "over" in kind else w)
    laid_out = lay_out(w)
    setter = extension().blocked_prefetch_from
    try:
        for rows in (1, 2, 4, 5, 8, 9, 12, 13, 25):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            outs = []
            for start in (2, 5, 9, 13):
                setter(start)
                assert extension().blocked_prefetching_from() == start
                outs.append(product(x, laid_out, None))
            assert all(torch.equal(out, outs[0]) for out in outs[1:]), (kind, rows)
    finally:
        setter(prefetch.DEFAULT_FROM)


def test_a_pass_of_one_row_cannot_be_asked_to_prefetch():
    with pytest.raises(RuntimeError, match="passes of one row never prefetch"):
        extension().blocked_prefetch_from(1)


@pytest.mark.parametrize("ratios,chosen", [
    ({1: 1.0, 4: 0.90, 8: 0.93}, 9),  # both verification sizes faster without: passes up to 8 rows stop
    ({1: 1.0, 4: 0.95, 8: 0.99}, 5),  # only 4 rows
    ({1: 1.0, 4: 1.05, 8: 0.90}, 2),  # 4 rows gain from it: passes of several rows keep it (8 rows not looked at)
    ({1: 1.0, 4: 0.98, 8: 0.98}, 9),  # at the margin
    ({1: 1.0, 4: 0.981, 8: 0.9}, 2),
    ({1: 0.95, 4: 0.8, 8: 0.8}, None),  # the control is off: too noisy to choose
    ({1: 1.04, 4: 1.0, 8: 1.0}, None),
])
def test_the_rule_reads_the_ratios_as_documented(ratios, chosen):
    assert prefetch.rule(ratios) == chosen


def test_the_decoder_sets_its_own_prefetch_before_each_forward(decoder, cache):
    ids, positions = torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]
    for start in (9, 5, prefetch.DEFAULT_FROM):
        decoder.prefetch_from = start
        extension().blocked_prefetch_from(13)
        decoder.forward(ids, positions, NoCache(), 0, None)
        assert extension().blocked_prefetching_from() == start
    assert decoder.describe().endswith(f"prefetch from {prefetch.DEFAULT_FROM} rows")


def test_timing_pairs_leaves_the_decoder_and_the_kernel_as_they_were_and_times_every_row_count(decoder, cache):
    decoder.prefetch_from = 5
    extension().blocked_prefetch_from(9)
    timed = prefetch.time_pairs(decoder, (1, 4), 3)
    assert decoder.prefetch_from == 5 and extension().blocked_prefetching_from() == 9
    assert set(timed) == {1, 4}
    for t in timed.values():
        assert len(t["ahead"]) == len(t["none"]) == len(t["ratios"]) == 3
        assert all(r > 0 for r in t["ratios"])


def test_a_model_that_sits_in_the_caches_keeps_the_default_unmeasured(decoder, cache, monkeypatch):
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("measured"))
    assert prefetch.weight_bytes(decoder) < prefetch.MIN_WEIGHT_BYTES
    assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM
    assert not cache.exists()


def test_a_measurement_is_cached_and_then_used_as_it_is(decoder, cache, monkeypatch):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 0.9, 8: 0.99}))
    chosen, source = prefetch.measure(decoder, budget_s=30)
    assert (chosen, source) == (5, "measured")
    entry = json.loads(cache.read_text())[prefetch.decoder_key(decoder)]
    assert prefetch.invalid_entry(entry) is None and entry["from"] == 5 and entry["pairs"] == prefetch.PAIRS
    assert entry["ratios"] == {"1": 1.0, "4": 0.9, "8": 0.99}
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("measured again"))
    assert prefetch.prefetch_from(decoder) == chosen


def _timed(ratios: dict[int, float]):
    return lambda decoder, rows_timed, pairs: {r: {"ahead": [1.0], "none": [ratios[r]], "ratios": [ratios[r]]}
                                               for r in rows_timed}


def test_a_measurement_under_load_serves_its_process_and_is_never_cached(decoder, cache, monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "_busy", lambda: 0.0)  # quiet when it began
    monkeypatch.setattr(prefetch, "other_load", lambda start, end: 1.0)  # not while it timed
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 0.9, 8: 0.9}))
    with caplog.at_level(logging.WARNING):
        assert prefetch.measure(decoder) == (9, "measured under load")
    assert "this choice serves this run only" in caplog.text and not cache.exists()
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("measured again"))
    assert prefetch.prefetch_from(decoder) == 9  # what this process settled on


def test_a_timing_that_fails_keeps_the_default_with_a_warning(decoder, cache, monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)

    def fails(*args):
        raise ValueError("context of 264 tokens is longer than the model's sliding window (128)")

    monkeypatch.setattr(prefetch, "time_pairs", fails)
    with caplog.at_level(logging.WARNING):
        assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM
    assert "timing it failed (ValueError: context of 264 tokens" in caplog.text and not cache.exists()
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("timed again"))
    assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM  # settled for the process


def test_the_kernels_choice_is_timed_under_the_kernels_default_whatever_a_decoder_set(monkeypatch, cache):
    from mtptrain.runtime import choice

    seen = []
    monkeypatch.setattr(choice, "_measured_kernels", lambda config: seen.append(
        extension().blocked_prefetching_from()) or {})
    extension().blocked_prefetch_from(9)
    choice._measure_kernels(None)
    assert seen == [prefetch.DEFAULT_FROM] and extension().blocked_prefetching_from() == 9


def test_a_busy_machine_is_not_timed_and_keeps_the_default_in_this_process(decoder, cache, monkeypatch):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "other_load", lambda start, end: 1.0)
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("timed"))
    assert prefetch.measure(decoder) == (prefetch.DEFAULT_FROM, "busy")
    assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM and not cache.exists()


def test_a_noisy_control_keeps_the_default_with_a_warning(decoder, cache, monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 0.9, 4: 0.8, 8: 0.8}))
    with caplog.at_level(logging.WARNING):
        assert prefetch.measure(decoder) == (prefetch.DEFAULT_FROM, "noisy")
    assert "differed by 10.0%" in caplog.text and "mtptrain measure" in caplog.text and not cache.exists()


def test_a_model_too_slow_to_time_within_the_budget_keeps_the_default(decoder, cache, monkeypatch):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "time_pairs", lambda *args: pytest.fail("timed"))
    assert prefetch.measure(decoder, budget_s=1e-6) == (prefetch.DEFAULT_FROM, "too slow")
    monkeypatch.setattr(prefetch, "LOAD_BUDGET_S", 1e-6)
    monkeypatch.setattr(prefetch, "_one_token_seconds", lambda decoder: pytest.fail("timed again"))
    assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM  # settled for the process


@pytest.mark.parametrize("entry,why", [
    ({"from": 3, "ratios": {"1": 1.0, "4": 0.9, "8": 0.9}}, "from 3 is not one of 2, 5, 9"),
    ({"from": True, "ratios": {"1": 1.0, "4": 0.9, "8": 0.9}}, "from True"),
    ({"from": 9.0, "ratios": {"1": 1.0, "4": 0.9, "8": 0.9}}, "from 9.0"),
    ({"from": 9, "ratios": {"1": 1.0, "4": 0.9}}, "ratios are not an object of the timed row counts"),
    ({"from": 9, "ratios": {"1": 1.0, "4": -0.9, "8": 0.9}}, "ratio -0.9 is not a positive number"),
    ({"from": 9, "ratios": {"1": 1.0, "4": "0.9", "8": 0.9}}, "is not a positive number"),
    ([9], "not an object"),
])
def test_a_cached_entry_that_does_not_validate_is_dropped_and_measured_again(decoder, cache, monkeypatch, caplog,
                                                                             entry, why):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    key = prefetch.decoder_key(decoder)
    cache.write_text(json.dumps({key: entry}))
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 0.9, 8: 1.0}))
    with caplog.at_level(logging.WARNING):
        assert prefetch.prefetch_from(decoder) == 5
    assert why in caplog.text
    assert json.loads(cache.read_text())[key]["from"] == 5


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "[" * 100_000], ids=["cut", "list", "nested"])
def test_an_unreadable_cache_is_measured_again(decoder, cache, monkeypatch, caplog, content):
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    cache.write_text(content)
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 1.1, 8: 1.1}))
    with caplog.at_level(logging.WARNING):
        assert prefetch.prefetch_from(decoder) == prefetch.DEFAULT_FROM
    assert "measured again" in caplog.text


def test_batched_decoders_keep_the_kernels_default_and_reports_name_the_choice(cache, monkeypatch):
    model = _model("llama")
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 0.9, 8: 0.9}))
    assert load_decoder(model, batched=True, record=NATIVE).prefetch_from == prefetch.DEFAULT_FROM
    single = load_decoder(model, record=NATIVE)
    assert single.prefetch_from == 9 and single.describe().endswith(", prefetch from 9 rows")


def test_mtptrain_measure_times_the_prefetch_on_the_targets_forwards_and_caches_it(cache, monkeypatch,
                                                                                   tiny_target_dir):
    from mtptrain.runtime import choice, runner

    monkeypatch.setattr(choice, "other_load", lambda start, end: 0.0)
    # the prefetch is timed on the runtime's own product, whatever this machine measures for a tiny model
    monkeypatch.setattr(runner, "decoder_choice", lambda model: choice.Choice.from_record(NATIVE))
    args = ["measure", "--set", f"target.model={tiny_target_dir}", "--set", "target.dtype=float32"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "products' prefetch: passes of 2 or more rows (not measured: the model's weights sit in the CPU's " \
           "caches)" in done.output
    monkeypatch.setattr(prefetch, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(prefetch, "time_pairs", _timed({1: 1.0, 4: 0.9, 8: 0.9}))
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "products' prefetch: passes of 9 or more rows (measured)" in done.output and str(cache) in done.output
    assert [entry["from"] for entry in json.loads(cache.read_text()).values()] == [9]
    measure = prefetch.measure
    monkeypatch.setattr(prefetch, "measure", functools.partial(measure, budget_s=1e-6))  # a target too slow to time
    cache.unlink()
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0 and "(too slow)" in done.output and "the default stays" in done.output
    assert not cache.exists()
    monkeypatch.setattr(prefetch, "measure", measure)
    monkeypatch.setattr(prefetch, "other_load", lambda start, end: 1.0)  # now busy: exit 1, nothing cached
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 1 and "(busy)" in done.output and not cache.exists()
    assert "the products' prefetch was not cached" in done.output
