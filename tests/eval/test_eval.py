"""`mtptrain eval` on a tiny target: every method measured against the baseline on the same prompts, exactness
checked, results written as JSON, Markdown and PNG (and to W&B)."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.config import TargetConfig
from mtptrain.eval.prompts import request_ids
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.target import load_target


def save_random_head(target_dir: Path, out: Path, spec: HeadSpec) -> Path:
    target = load_target(TargetConfig(model=str(target_dir)))
    torch.manual_seed(0)
    save_head(out, spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    return out


def write_prompts(path: Path, n: int = 3) -> Path:
    rows = [{"id": f"q{i}", "category": "writing" if i % 2 else "coding",
             "turns": [f"the word is hot and you see {i}", "now say it again"]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def eval_args(target_dir, head, prompts, out, *overrides):
    settings = [f"target.model={target_dir}", f"eval.head={head}", f"eval.prompts={prompts}", f"eval.output_dir={out}",
                "eval.max_new_tokens=20", "eval.k=[1,3]", "eval.tree.budgets=[4,8]", "eval.tree.depth=3",
                "eval.tree.branch=2", "eval.repeats=1", *overrides]  # repeated timings: test_repeats.py
    return ["eval", "--no-progress", *[a for s in settings for a in ("--set", s)]]


@pytest.fixture(scope="module")
def eagle3_head(tiny_target_dir, tmp_path_factory):
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    return save_random_head(tiny_target_dir, tmp_path_factory.mktemp("head") / "head", spec)


def test_eval_measures_every_method_on_the_same_prompts_and_writes_the_report(tiny_target_dir, eagle3_head, tmp_path):
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl"), out,
                     "eval.methods=[ngram,suffix,chain,tree,draft]", "eval.draft.layers=2", "eval.chain.stops=[0,0.5]")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    labels = [m["label"] for m in results["methods"]]
    assert labels == ["baseline", "ngram K=1", "ngram K=3", "suffix K=1", "suffix K=3", "chain K=1", "chain K=3",
                      "chain K=3 stop 0.5", "tree N=4", "tree N=8", "draft K=1", "draft K=3"]
    baseline = results["methods"][0]
    assert baseline["tau"] == 1.0 and baseline["speedup"] == 1.0
    for m in results["methods"][1:]:
        assert m["exactness"] == {"checked": 6, "identical": 6, "near_ties": [], "failures": []}, m["label"]
        assert m["tokens"] == baseline["tokens"]  # the same text, so the same token count
        assert m["speedup"] == pytest.approx(m["tokens_per_second"] / baseline["tokens_per_second"], rel=1e-3)
        # a tree's depth and a stopped chain's length vary: at most K
        assert len(m["acceptance"]) == m["k"] if m["method"] != "tree" and "stop" not in m else \
            1 <= len(m["acceptance"]) <= m["k"]
    chain3, stopped = (next(m for m in results["methods"] if m["label"] == label)
                       for label in ("chain K=3", "chain K=3 stop 0.5"))
    # a random head is unsure (its top probability over 64 tokens is far below 0.5): its chains end early
    assert stopped["stop"] == 0.5 and "stop" not in chain3
    assert 1.0 <= stopped["verified_tokens_per_step"] < 2.0 < chain3["verified_tokens_per_step"]
    draft3 = next(m for m in results["methods"] if m["label"] == "draft K=3")
    assert draft3["tau"] > 1.0 and draft3["verified_tokens_per_step"] > 1.0
    tree8 = next(m for m in results["methods"] if m["label"] == "tree N=8")
    assert 4 < tree8["verified_tokens_per_step"] <= 8
    assert set(results["best"]) == {"ngram", "suffix", "chain", "tree", "draft"}
    assert set(baseline["tau_by_category"]) == {"coding", "writing"}
    # second turns were asked after the baseline's own first answer
    q0 = results["conversations"]["q0"]
    assert [m["role"] for m in q0] == ["user", "assistant", "user", "assistant"]
    assert len(q0[1]["content"]) > 0 and q0[2]["content"] == "now say it again"
    # the report: a table row per configuration, and three real PNG figures
    report = (out / "report.md").read_text()
    assert all(f"| {label} |" in report for label in labels)
    from PIL import Image

    for name in ("acceptance.png", "speedup.png", "tau_vs_k.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 300
    assert "best per method" in result.output and "tree N=" in result.output


def test_eval_measures_ssd_with_the_head_and_with_a_draft_model(tiny_target_dir, eagle3_head, tmp_path):
    """Both SSD drafters run in their own processes; outputs equal the baseline's; the cache's hits and misses
    count every round that followed another (warm-up excluded)."""
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[chain,ssd,ssd-draft]", "eval.draft.layers=2", "eval.k=[3]", "eval.ssd.budget=4")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["baseline", "chain K=3", "ssd K=3", "ssd-draft K=3"]
    for m in results["methods"][1:]:
        assert m["exactness"] == {"checked": 4, "identical": 4, "near_ties": [], "failures": []}, m["label"]
    for m in results["methods"][2:]:
        cache = m["ssd"]
        # each request's first draft has no earlier outcome to look up: 4 requests
        assert sum(cache["hits_by_accepted"]) + sum(cache["misses_by_accepted"]) == m["steps"] - 4, m
        assert 0.0 <= cache["hit_rate"] <= 1.0
    assert "ssd K=3: speculation cache hit rate" in result.output
    assert "## Speculation cache (ssd)" in (out / "report.md").read_text()
    assert set(results["best"]) == {"chain", "ssd", "ssd-draft"}


def test_eval_logs_the_table_and_figures_to_wandb_offline(tiny_target_dir, eagle3_head, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: auto means offline
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 1), out,
                     "eval.methods=[ngram,chain]", "eval.max_turns=1")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = sorted(p.name.rsplit("_", 2)[0] for p in (runs[0] / "files" / "media" / "images" / "eval").glob("*.png"))
    assert images == ["acceptance", "speedup", "tau_vs_k"]
    tables = list((runs[0] / "files" / "media" / "table" / "eval").glob("results_*.table.json"))
    table = json.loads(tables[0].read_text())
    assert [row[0] for row in table["data"]] == ["baseline", "ngram K=1", "ngram K=3", "chain K=1", "chain K=3"]
    assert table["columns"][-3:] == ["acceptance_1", "acceptance_2", "acceptance_3"]
    measured = {m["label"]: m for m in json.loads((out / "results.json").read_text())["methods"]}
    for row in table["data"]:
        m = measured[row[0]]
        assert row[4:7] == [m["tau"], m["tokens_per_second"], m["speedup"]]
        assert row[7:] == m["acceptance"] + [None] * (3 - len(m["acceptance"]))
    from conftest import read_offline_wandb_run

    (run_file,) = runs[0].glob("run-*.wandb")
    run = read_offline_wandb_run(run_file)
    assert (run["group"], run["job_type"]) == ("run", "eval")  # the recipe's name, as no group was set
    assert run["config"]["eval"]["methods"] == ["ngram", "chain"]
    assert run["summary"]["tau/chain K=3"] == measured["chain K=3"]["tau"]


def test_a_divergence_that_is_not_a_near_tie_fails_the_command(tiny_target_dir, eagle3_head, tmp_path, monkeypatch):
    """A verifier that accepts every draft breaks exactness: eval must say so and exit with code 3."""
    import mtptrain.engine.generate as generate_module
    from mtptrain.engine.verify import Verdict

    def accepts_everything(draft, logits):
        return Verdict(len(draft), draft + [int(logits[len(draft)].argmax())])

    monkeypatch.setattr(generate_module, "verify_greedy", accepts_everything)
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[chain]", "eval.k=[2]", "eval.max_turns=1")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 3, result.output
    assert "differ from the baseline beyond a near-tie" in result.output
    chain = json.loads((out / "results.json").read_text())["methods"][1]
    assert len(chain["exactness"]["failures"]) == 2 and chain["exactness"]["identical"] == 0
    assert all(f["top2_gap"] >= 1e-3 for f in chain["exactness"]["failures"])
    assert "FAILURE" in (out / "report.md").read_text()


def test_a_finished_eval_is_kept_only_with_the_same_settings_head_weights_and_a_whole_file(
        tiny_target_dir, tmp_path):
    """What scripts that rerun many evals keep (benchmarks/ablations.py, peer_speculators.py): an eval written
    with every setting and the head's weights as now; any other setting, a head retrained in place, or a results.json
    truncated or not an eval's is run again."""
    from mtptrain.config import load_recipe
    from mtptrain.eval.run import finished_eval

    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=64)
    head = save_random_head(tiny_target_dir, tmp_path / "head", spec)
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, head, write_prompts(tmp_path / "p.jsonl", 1), out, "eval.methods=[chain]",
                     "eval.k=[2]", "eval.max_turns=1", "eval.max_new_tokens=6")
    assert CliRunner().invoke(app, [*args, "--no-wandb"]).exit_code == 0
    sets = [a for a in args[2:] if a != "--set"]
    written = json.loads((out / "results.json").read_text())
    assert finished_eval(load_recipe(None, sets)) == written
    for changed in ("eval.repeats=2", "eval.max_new_tokens=7", "eval.k=[2,3]", "eval.methods=[chain,tree]",
                    "eval.temperature=1", "eval.max_prompts=1", f"eval.prompts={tmp_path / 'other.jsonl'}",
                    f"eval.head={tmp_path / 'other-head'}", "data.max_length=64", "target.dtype=bfloat16"):
        assert finished_eval(load_recipe(None, [*sets, changed])) is None, changed
    assert finished_eval(load_recipe(None, [*sets, f"eval.output_dir={tmp_path / 'none'}"])) is None
    torch.manual_seed(1)  # retrained in place: other weights, so another sha256 in its config.json
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    save_head(head, spec.family.build(spec, FrozenTarget.of(target.model)), spec, target.identity())
    assert finished_eval(load_recipe(None, sets)) is None
    save_random_head(tiny_target_dir, head, spec)  # the weights it drafted with, again
    assert finished_eval(load_recipe(None, sets)) == written
    text = (out / "results.json").read_text()
    for broken in (text[:len(text) // 2], "[]", "[" * 100_000, json.dumps({**written, "config": "x"}),
                   json.dumps({**written, "head": {}})):
        (out / "results.json").write_text(broken)
        assert finished_eval(load_recipe(None, sets)) is None


def test_sampled_eval_runs_every_method_and_skips_the_exactness_check(tiny_target_dir, eagle3_head, tmp_path):
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[ngram,chain,tree]", "eval.temperature=1.0", "eval.top_p=0.9", "eval.max_turns=1")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["temperature"] == 1.0
    assert all(m["exactness"]["checked"] == 0 for m in results["methods"])
    assert all(m["steps"] > 0 for m in results["methods"])


def test_a_head_drafting_from_int8_weights_is_measured_beside_its_own_and_every_output_stays_exact(
        tiny_target_dir, eagle3_head, tmp_path):
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, eagle3_head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[chain,tree]", "eval.k=[3]", "eval.tree.budgets=[4]", "eval.max_turns=1",
                     "eval.draft_weights=[head,int8]")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    methods = results["methods"]
    assert [m["label"] for m in methods] == ["baseline", "chain K=3", "chain K=3 int8", "tree N=4", "tree N=4 int8"]
    assert [m.get("draft_weights") for m in methods] == [None, None, "int8", None, "int8"]
    for m in methods[1:]:
        assert m["exactness"] == {"checked": 2, "identical": 2, "near_ties": [], "failures": []}, m["label"]
        assert m["steps"] > 0
    assert "| chain K=3 int8 |" in (out / "report.md").read_text()


def test_an_mtp_head_drafts_chains_up_to_its_depths_and_no_trees_or_ssd(tiny_target_dir, tmp_path):
    head = save_random_head(tiny_target_dir, tmp_path / "mtp", HeadSpec("mtp", last_layer=3, mtp_depths=2))
    out = tmp_path / "eval"
    args = eval_args(tiny_target_dir, head, write_prompts(tmp_path / "p.jsonl", 2), out,
                     "eval.methods=[chain,tree,ssd]", "eval.k=[1,2,3]", "eval.max_turns=1",
                     "eval.draft_weights=[head,int8]")
    result = CliRunner().invoke(app, [*args, "--no-wandb"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in results["methods"]] == ["baseline", "chain K=1", "chain K=2"]
    assert "note: eval.draft_weights int8: mtp heads: its drafter multiplies by the head's own weights only; " \
           "skipped" in result.output
    assert all(m["exactness"]["identical"] == 2 for m in results["methods"][1:])
    assert any("at most 2 tokens" in n for n in results["notes"]) and any("chains only" in n for n in results["notes"])
    assert "note: tree: MTP heads draft chains only" in result.output
    assert "note: ssd: an MTP head drafts all its depths from one target state" in result.output


def test_eval_errors_name_the_missing_piece(tiny_target_dir, other_target_dir, eagle3_head, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 1)
    missing = CliRunner().invoke(app, eval_args(tiny_target_dir, tmp_path / "nowhere", prompts, tmp_path / "e"))
    assert missing.exit_code == 1
    assert "no trained head at" in missing.output and "mtptrain train" in missing.output
    other = CliRunner().invoke(app, eval_args(other_target_dir, eagle3_head, prompts, tmp_path / "e"))
    assert other.exit_code == 1 and "trained for target" in other.output
    draft = CliRunner().invoke(app, eval_args(tiny_target_dir, eagle3_head, prompts, tmp_path / "e",
                                              "eval.methods=[draft]"))
    assert draft.exit_code == 1 and "eval.draft.layers" in draft.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["fine"]}\n{"turns": []}\n')
    broken = CliRunner().invoke(app, eval_args(tiny_target_dir, eagle3_head, bad, tmp_path / "e"))
    assert broken.exit_code == 1 and "bad.jsonl:2" in broken.output
    unknown = CliRunner().invoke(app, eval_args(tiny_target_dir, eagle3_head, prompts, tmp_path / "e",
                                                "eval.methods=[medusa]"))
    assert unknown.exit_code == 2 and "eval.methods" in unknown.output



def test_second_turns_reuse_their_first_turns_cache_unless_told_not_to(tiny_target_dir, eagle3_head, tmp_path):
    """eval.prefix_cache: each configuration runs only what a request adds to its own last one; the outputs, tau
    and acceptance are those of running every prompt whole."""
    prompts = write_prompts(tmp_path / "p.jsonl")
    runs = {}
    for setting in ("true", "false"):
        out = tmp_path / setting
        result = CliRunner().invoke(app, [*eval_args(tiny_target_dir, eagle3_head, prompts, out,
                                                     "eval.methods=[chain,tree]", "eval.k=[3]",
                                                     "eval.tree.budgets=[4]", f"eval.prefix_cache={setting}"),
                                          "--no-wandb"])
        assert result.exit_code == 0, result.output
        runs[setting] = json.loads((out / "results.json").read_text())
    reused, whole = runs["true"], runs["false"]
    assert reused["settings"]["prefix_cache"] is True and whole["settings"]["prefix_cache"] is False
    assert reused["conversations"] == whole["conversations"]
    tokenizer = load_target(TargetConfig(model=str(tiny_target_dir))).tokenizer
    held = sum(len(request_ids(tokenizer, conversation[: i + 1], 10**6, "test"))
               for conversation in whole["conversations"].values() for i in (0, 2))
    for ours, theirs in zip(reused["methods"], whole["methods"], strict=True):
        assert ours["label"] == theirs["label"]
        assert (ours["tau"], ours["acceptance"], ours["exactness"]) == \
            (theirs["tau"], theirs["acceptance"], theirs["exactness"])
        assert theirs["prompt_tokens_run"] == held
        # each second turn runs its question alone; the first turns share the chat template's opening
        assert ours["prompt_tokens_run"] < held / 2
    # every configuration runs each repeat's first request whole (a fresh head reuses nothing), so the prefixes
    # reused after it were computed alike everywhere; a drafting configuration's cache may also hold its answer's
    # last token, which the baseline's never does (one token less to run in each second turn)
    run = sorted(m["prompt_tokens_run"] for m in reused["methods"])
    assert run[-1] - run[0] <= len(whole["conversations"]), run
