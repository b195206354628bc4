"""Eval's timings: every request generated eval.repeats times by every configuration in a changing order, medians
with their spread, and warnings where the spread or the machine's load makes a speedup unreliable."""

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mtptrain.eval.run as run_module
from mtptrain.eval.report import markdown, methods_table
from mtptrain.report_lines import run_line
from mtptrain.eval.report import format_results
from mtptrain.eval.exactness import exactness_failures
from mtptrain.eval.methods import Config
from mtptrain.eval.run import run_order
from mtptrain.eval.tally import Tally, flag_unreliable, timing_summary
from mtptrain.cli import app
from mtptrain.engine.generate import GenerationStats

from test_eval import eagle3_head, eval_args, write_prompts  # noqa: F401  (eagle3_head: a fixture)

# results.json as an eval wrote it before repeats, spreads and the CPU description (the first reference run's)
OLD_RESULTS = Path(__file__).resolve().parent / "fixtures" / "results-before-repeats.json"


@pytest.mark.parametrize("count", [3, 4, 7])
def test_the_order_changes_so_that_no_configuration_always_follows_the_same_one(count):
    orders = [run_order(count, r) for r in range(3)]
    assert orders[0] == list(range(count))  # the first repeat starts with the baseline, whose answers it records
    assert all(sorted(o) == list(range(count)) for o in orders)
    predecessors = {c: set() for c in range(count)}
    for order in orders:
        sequence = order + order  # two requests in a row
        for before, after in zip(sequence, sequence[1:]):
            predecessors[after].add(before)
    assert all(len(p) > 1 for p in predecessors.values()), predecessors


def test_speedup_is_the_median_of_the_per_repeat_speedups_with_its_spread():
    # tokens/s 100, 50, 80 against a baseline at 50, 50, 100: speedups 2.0, 1.0, 0.8
    summary = timing_summary([100, 100, 100], [1.0, 2.0, 1.25], [50.0, 50.0, 100.0])
    assert summary["repeats"] == 3
    assert summary["seconds_per_repeat"] == [1.0, 2.0, 1.25] and summary["seconds"] == 1.25
    assert summary["tokens_per_second"] == 80.0
    assert summary["speedup_per_repeat"] == [2.0, 1.0, 0.8]
    assert (summary["speedup"], summary["speedup_min"], summary["speedup_max"]) == (1.0, 0.8, 2.0)
    assert summary["speedup_spread"] == pytest.approx(1.2)
    once = timing_summary([100], [2.0], [25.0])
    assert once["speedup"] == 2.0 and once["speedup_spread"] is None  # one timing: its spread is unknown


def crafted_results(other_load: float | None = 0.05) -> dict:
    def method(label, kind, speedup, low, high, spread, acceptance):
        return {"label": label, "method": kind, "k": 2, "budget": None, "tokens": 200, "seconds": 2.0,
                "tokens_per_second": 100.0 * speedup, "speedup": speedup, "speedup_min": low, "speedup_max": high,
                "speedup_spread": spread, "repeats": 3, "seconds_per_repeat": [2.0, 2.0, 2.0], "tau": 1.4,
                "steps": 140, "acceptance": acceptance, "draft_ms_per_step": 1.0, "verify_ms_per_step": 9.0,
                "verified_tokens_per_step": 2.0, "tau_by_category": {},
                "exactness": {"checked": 2, "identical": 2, "near_ties": [], "failures": []}}

    return {
        "name": "crafted", "target": "tiny", "head": None, "notes": [], "best": {"ngram": "ngram K=2"},
        "settings": {"prompts": "p.jsonl", "prompt_count": 2, "requests": 2, "max_new_tokens": 100,
                     "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "near_tie": 1e-3, "repeats": 3,
                     "max_spread": 0.1, "max_other_load": 0.25},
        "machine": {"device": "cpu", "dtype": "torch.float32", "threads": 2, "cpu": "Example Xeon 8480",
                    "cpu_capability": "AVX512", "cpu_extensions": ["avx2", "avx512f", "amx_tile"],
                    "logical_cores": 8, "measured_seconds": 42.0, "other_load": other_load},
        "methods": [method("baseline", "baseline", 1.0, 1.0, 1.0, 0.0, []),
                    method("ngram K=2", "ngram", 0.83, 0.70, 0.95, 0.3012, [0.3, 0.1]),
                    method("chain K=2", "chain", 1.21, 1.19, 1.23, 0.0331, [0.5, 0.25])],
    }


def test_a_wide_spread_flags_that_configuration_and_a_busy_machine_flags_every_one():
    results = crafted_results()
    warnings = flag_unreliable(results, max_spread=0.10, max_other_load=0.25)
    assert [m["unreliable"] for m in results["methods"]] == [[], ["spread"], []]
    assert len(warnings) == 1 and "ngram K=2" in warnings[0] and "0.70x" in warnings[0] and "0.95x" in warnings[0]
    busy = crafted_results(other_load=0.8)
    warnings = flag_unreliable(busy, max_spread=0.10, max_other_load=0.25)
    assert [m["unreliable"] for m in busy["methods"]] == [["load"], ["spread", "load"], ["load"]]
    assert any("0.80 CPU cores" in w for w in warnings)
    unknown = crafted_results(other_load=None)
    flag_unreliable(unknown, max_spread=0.10, max_other_load=0.25)
    assert unknown["methods"][2]["unreliable"] == []


def test_the_table_and_the_report_show_the_spread_mark_unreliable_rows_and_name_the_cpu():
    results = crafted_results(other_load=0.8)
    results["warnings"] = flag_unreliable(results, max_spread=0.10, max_other_load=0.25)
    table = format_results(results)
    assert "acceptance per position (cumulative)" in table
    ngram = next(line for line in table.splitlines() if line.startswith("ngram K=2"))
    assert "0.70-0.95" in ngram and "!" in ngram
    assert "median of 3 repeats" in table and "0.80 CPU cores" in table
    report = markdown(results)
    assert "acceptance per position (cumulative)" in report
    assert "drafts 1..i were all accepted" in report  # what cumulative means, under the table
    assert "0.70-0.95x" in report and "spread" in report
    assert "**Warning: unreliable timings.**" in report and "0.80 CPU cores" in report and "ngram K=2" in report
    assert "Example Xeon 8480" in report and "AVX512" in report and "amx_tile" in report


def test_an_unmeasured_load_is_said_not_silently_dropped():
    results = crafted_results(other_load=None)
    results["warnings"] = flag_unreliable(results, max_spread=0.10, max_other_load=0.25)
    assert "load was not measured" in format_results(results)
    assert "load was not measured" in markdown(results)


def test_results_written_before_repeats_still_render():
    results = json.loads(OLD_RESULTS.read_text())
    assert "speedup_spread" not in results["methods"][0]
    assert len(methods_table(results)) == 2 + len(results["methods"])
    assert "x86_64" in run_line(results)
    assert "acceptance per position (cumulative)" in format_results({**results, "notes": []})


def test_acceptance_per_position_is_cumulative_not_conditional():
    stats = GenerationStats()
    for accepted in (0, 1, 3, 2):  # four steps, each drafting 3 tokens
        stats.record(drafted=3, accepted=accepted, emitted=accepted + 1)
    # cumulative: steps whose drafts 1..i were all accepted, out of all 4; conditional would be 3/4, 2/3, 1/2
    assert stats.acceptance() == [3 / 4, 2 / 4, 1 / 4]
    assert stats.tau == 1 + sum(stats.acceptance())


def test_acceptance_counts_steps_that_drafted_less_as_not_reaching_the_position():
    stats = GenerationStats()
    # a tree's depth varies: 2 deep steps fully accepted, 2 shallow ones with their one node accepted,
    # and an n-gram-like step that drafted nothing
    for drafted, accepted in ((3, 3), (3, 3), (1, 1), (1, 1), (0, 0)):
        stats.record(drafted=drafted, accepted=accepted, emitted=accepted + 1)
    assert stats.acceptance() == [4 / 5, 2 / 5, 2 / 5]  # out of the drafting steps alone: 1, 1, 1
    assert stats.tau == 1 + sum(stats.acceptance())
    merged = GenerationStats()
    merged.merge(stats)
    merged.merge(stats)
    assert merged.acceptance() == stats.acceptance()


def test_the_decoding_speedup_leaves_out_each_requests_time_to_its_first_token():
    # two requests of 65 tokens a repeat: the baseline spends 2 s, 0.4 s of it before the first tokens; the chain
    # 1.5 s, 0.5 s of it there (its drafter reads the prompt's states too)
    baseline, chain = Tally(Config("baseline", "baseline")), Tally(Config("chain K=3", "chain", k=3))
    for tally, seconds, prefill in ((baseline, 1.0, 0.2), (chain, 0.75, 0.25)):
        for _ in range(2):  # repeats
            tally.new_repeat()
            for _ in range(2):
                tally.add_timing(65, seconds, prefill)
    assert baseline.decoding_tokens_per_second() == [pytest.approx(128 / 1.6)] * 2
    assert chain.decoding_tokens_per_second() == [pytest.approx(128 / 1.0)] * 2
    summary = chain.summary(baseline)
    assert summary["speedup"] == pytest.approx(2.0 / 1.5, abs=1e-4)  # end to end
    assert summary["decoding_speedup"] == pytest.approx(1.6, abs=1e-4)
    assert summary["prefill_ms_per_request"] == pytest.approx(250.0)
    assert baseline.summary(baseline)["decoding_speedup"] == 1.0


def test_every_request_is_timed_repeats_times_in_rotated_orders(tiny_target_dir, eagle3_head, tmp_path, monkeypatch):
    calls = []
    generate = run_module.generate

    def recorded(runner, ids, max_new_tokens, proposer=None, **kwargs):
        calls.append(type(proposer).__name__)
        return generate(runner, ids, max_new_tokens, proposer, **kwargs)

    monkeypatch.setattr(run_module, "generate", recorded)
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[ngram,chain]", "eval.k=[2]", "eval.max_turns=1", "eval.repeats=3",
                     "eval.max_spread=0")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    names = ["NoneType", "NgramProposer", "HeadChainProposer"]
    measured = calls[-2 * 3 * 3:]  # 2 requests, 3 configurations, 3 repeats; the warm-up came before
    assert measured == [names[i] for r in range(3) for _ in range(2) for i in run_order(3, r)]
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["repeats"] == 3
    for m in results["methods"]:
        assert m["repeats"] == 3 and len(m["seconds_per_repeat"]) == 3 and len(m["speedup_per_repeat"]) == 3
        assert m["speedup"] == pytest.approx(statistics.median(m["speedup_per_repeat"]), abs=1e-4)
        assert m["speedup_min"] <= m["speedup"] <= m["speedup_max"]
        assert m["exactness"]["checked"] == (0 if m["method"] == "baseline" else 2)  # the first repeat's
    baseline, ngram, chain = results["methods"]
    assert baseline["speedup_per_repeat"] == [1.0, 1.0, 1.0] and baseline["unreliable"] in ([], ["load"])
    assert baseline["decoding_speedup"] == 1.0 and chain["decoding_speedup"] > 0
    for m in results["methods"]:  # the first token's share of each request's time, measured
        assert 0 < m["prefill_ms_per_request"] < 1000 * min(m["seconds_per_repeat"]) / 2
    assert f"chain K=2 {chain['decoding_speedup']:.2f}x" in next(
        line for line in result.output.splitlines() if line.startswith("after the first token"))
    assert "spread" in ngram["unreliable"] and "spread" in chain["unreliable"]  # eval.max_spread=0
    assert any("ngram K=2" in w for w in results["warnings"])
    machine = results["machine"]
    assert machine["cpu"] and machine["cpu_capability"] and "other_load" in machine
    assert "!" in next(line for line in result.output.splitlines() if line.startswith("chain K=2"))
    report = (out / "report.md").read_text()
    assert "**Warning: unreliable timings.**" in report and "median of 3 repeats" in report


def test_a_later_repeat_that_differs_from_the_first_is_an_exactness_failure(tiny_target_dir, eagle3_head, tmp_path,
                                                                           monkeypatch):
    chain_calls = []
    generate = run_module.generate

    def flaky(runner, ids, max_new_tokens, proposer=None, **kwargs):
        result = generate(runner, ids, max_new_tokens, proposer, **kwargs)
        if type(proposer).__name__ == "HeadChainProposer":
            chain_calls.append(1)
            if len(chain_calls) == 3:  # warm-up, first repeat, then the second repeat's only request
                result.tokens[-1] = (result.tokens[-1] + 1) % 100
        return result

    monkeypatch.setattr(run_module, "generate", flaky)
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 1), out,
                     "eval.methods=[chain]", "eval.k=[2]", "eval.max_turns=1", "eval.repeats=2", "eval.near_tie=0")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 3, result.output
    results = json.loads((out / "results.json").read_text())
    chain = results["methods"][1]
    assert chain["exactness"]["identical"] == chain["exactness"]["checked"] == 1
    (failure,) = chain["exactness"]["failures"]
    assert failure["repeat"] == 2 and failure["position"] == chain["tokens"] - 1  # the token the test changed
    assert "repeat 2" in exactness_failures(results)[0]
