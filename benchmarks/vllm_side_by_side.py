"""vLLM (from scripts/setup_vllm.sh: its CPU build on a machine without CUDA) side by side with mtptrain's own
engine and runtime, each comparison measured in one run.

    python benchmarks/vllm_side_by_side.py [--questions 80] [--turns 2] [--new-tokens 64] [--k 3]
                                           [--dtypes float32 bfloat16] [--repeats 1]
                                           [--regenerate-conversations 256] [--regenerate-tokens 192] [--rows 64]

1. Acceptance: `mtptrain eval` with eval.engines [embedded, vllm] on the first --questions MT-bench questions,
   --turns turns each (a second turn follows the embedded baseline's first answer, in both engines), the head's
   chain at K=--k, once per dtype of --dtypes: in float32 both engines write the same answers, so the head drafts
   from the same contexts and the gap between their acceptance is the serving check's own spread
   (eval/serving.py's AGREEMENT_BOUND and AGREEMENT_SHARE come from it); bfloat16 is what users serve in.
2. Batch-1 decoding: each engine's baseline and chain tokens/s from the same runs (requests interleaved).
3. Regeneration: `mtptrain regenerate` with regenerate.engine runtime and vllm, alternately --rounds times, on
   the first --regenerate-conversations conversations of the recipe's data (first turns, up to
   --regenerate-tokens new tokens, --rows rows); tokens/s of each and the share of identical answers.

Everything is written to --out/side_by_side.json; the CPU is named under the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mtptrain.config import load_recipe
from mtptrain.data.regenerate import run_regenerate
from mtptrain.eval.run import run_eval
from mtptrain.eval.serving import AGREEMENT_BOUND, AGREEMENT_SHARE, conforms
from mtptrain.machine import describe_cpu


def side_by_side_eval(args, dtype: str, out: Path) -> dict:
    settings = [f"eval.max_prompts={args.questions}", f"eval.max_turns={args.turns}",
                f"eval.max_new_tokens={args.new_tokens}", "eval.methods=[chain]", f"eval.k=[{args.k}]",
                f"eval.repeats={args.repeats}", "eval.engines=[embedded, vllm]", f"target.dtype={dtype}",
                f"vllm.dtype={dtype}", f"eval.output_dir={out / f'eval-{dtype}'}", "tracking.wandb=disabled"]
    settings += [f"target.model={args.model}"] if args.model else []
    settings += [f"eval.head={args.head}"] if args.head else []
    settings += [f"eval.prompts={args.prompts}"] if args.prompts else []
    return run_eval(load_recipe(args.recipe, settings + args.sets), show_progress=False)


def print_eval(dtype: str, results: dict) -> dict:
    rows = {m["label"]: m for m in results["methods"]}
    s, serving = results["settings"], results["serving"]
    print(f"\neval in {dtype}: {s['prompt_count']} questions, {s['requests']} requests x {s['max_new_tokens']} "
          f"tokens, {s['repeats']} repeat(s)")
    print(f"{'row':<18}{'tau':>6}{'tau/request':>13}{'tok/s':>9}{'speedup':>9}  {'exact':<8}acceptance per position "
          "(pooled | per request)")
    for m in results["methods"]:
        ex = m["exactness"]
        exact = f"{ex['identical']}/{ex['checked']}" if ex["checked"] else "-"
        pooled = " ".join(f"{a:.3f}" for a in m["acceptance"])
        per_request = " ".join(f"{a:.3f}" for a in m.get("acceptance_per_request", []))
        tau_request = f"{m['tau_per_request']:.3f}" if "tau_per_request" in m else "-"
        print(f"{m['label']:<18}{m['tau']:>6.3f}{tau_request:>13}{m['tokens_per_second']:>9.1f}{m['speedup']:>8.2f}x"
              f"  {exact:<8}{pooled}{' | ' + per_request if per_request else ''}")
    [entry] = serving["agreement"]
    # The check holds the engines to the same drafts on the same answers: float32 only (in bfloat16 their kernels
    # round apart, and so do their answers and drafts)
    failures = conforms(entry) if dtype == "float32" else None
    verdict = ("pass" if not failures else "FAIL: " + "; ".join(failures)) if failures is not None else \
        "applies in float32"
    print(f"baselines identical across engines: {serving['baselines_identical']}/{serving['baselines_compared']}; "
          f"acceptance gap per position {' '.join(f'{g:.3f}' for g in entry['acceptance_gap'])} (bound "
          f"{AGREEMENT_BOUND}); requests answered alike by both chains {entry['same_answers']}, with identical "
          f"counts {entry['identical_counts']} (share {entry['identical_share']}, bound {AGREEMENT_SHARE}); "
          f"serving check: {verdict}")
    ours, theirs = rows["baseline"]["tokens_per_second"], rows["vllm baseline"]["tokens_per_second"]
    print(f"batch-1 decoding in {dtype}: runtime {ours:.1f} tok/s, vLLM {theirs:.1f} tok/s (runtime / vLLM "
          f"{ours / theirs:.2f}x)")
    return {"dtype": dtype, "settings": s, "serving": serving, "methods": results["methods"],
            "warnings": results["warnings"], "machine": results["machine"], "serving_check": failures}


def regenerate(args, engine: str, out: Path) -> tuple[float, dict]:
    settings = [f"data.max_conversations={args.regenerate_conversations}", "regenerate.max_turns=1",
                f"regenerate.max_new_tokens={args.regenerate_tokens}", f"regenerate.batch_size={args.rows}",
                f"regenerate.engine={engine}", f"data.regenerated={out / 'regenerated.jsonl'}",
                f"vllm.dtype={args.regenerate_dtype}", f"target.dtype={args.regenerate_dtype}"]
    settings += [f"target.model={args.model}"] if args.model else []
    summary = run_regenerate(load_recipe(args.recipe, settings + args.sets), show_progress=False)
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    answers = {row["id"]: [m["content"] for m in row["messages"] if m["role"] == "assistant"] for row in rows}
    return summary["tokens_this_run"] / summary["seconds_this_run"], answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--model", help="a target other than the recipe's (a local model directory)")
    parser.add_argument("--head", help="the EAGLE-3 head (default: the one eval would use)")
    parser.add_argument("--prompts", help="a prompt file instead of MT-bench")
    parser.add_argument("--questions", type=int, default=80)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--regenerate-conversations", type=int, default=256, help="0 skips regeneration")
    parser.add_argument("--regenerate-tokens", type=int, default=192)
    parser.add_argument("--regenerate-dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="runs/bench/vllm-side-by-side")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="further recipe overrides")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"evals": [print_eval(dtype, side_by_side_eval(args, dtype, out)) for dtype in args.dtypes]}

    if args.regenerate_conversations:
        rates: dict[str, list[float]] = {"runtime": [], "vllm": []}
        answers: dict[str, dict] = {}
        for r in range(args.rounds):
            for engine in ("runtime", "vllm") if r % 2 == 0 else ("vllm", "runtime"):
                with tempfile.TemporaryDirectory(dir=out) as tmp:
                    rate, answers[engine] = regenerate(args, engine, Path(tmp))
                rates[engine].append(rate)
                print(f"round {r + 1}, {engine}: regenerate {rate:.1f} tok/s")
        if not all(rates.values()) or min(min(r) for r in rates.values()) <= 0:
            raise SystemExit(f"regeneration wrote no tokens ({rates}): are the conversations' first prompts longer "
                             "than data.max_length allows?")
        both = sorted(set(answers["runtime"]) & set(answers["vllm"]))
        same = sum(answers["runtime"][i] == answers["vllm"][i] for i in both)
        ours, theirs = statistics.median(rates["runtime"]), statistics.median(rates["vllm"])
        print(f"\nregeneration ({args.regenerate_conversations} conversations, first turns, up to "
              f"{args.regenerate_tokens} tokens, {args.rows} rows, {args.regenerate_dtype}):")
        print(f"{'engine':<10}{'tok/s':>9}{'ratio':>9}")
        print(f"{'vllm':<10}{theirs:>9.1f}{1.0:>8.2f}x")
        print(f"{'runtime':<10}{ours:>9.1f}{ours / theirs:>8.2f}x")
        print(f"regenerated answers identical across engines: {same}/{len(both)}")
        record["regenerate"] = {"tokens_per_second": rates, "identical": same, "compared": len(both),
                                "conversations": args.regenerate_conversations, "rows": args.rows,
                                "new_tokens": args.regenerate_tokens, "dtype": args.regenerate_dtype}
    cpu = describe_cpu()
    record["cpu"] = cpu
    print(f"\nCPU: {cpu['model']} ({cpu['logical_cores']} logical cores; torch kernels {cpu['capability']}; "
          f"{' '.join(cpu['extensions'] or ['extensions unknown'])})")
    (out / "side_by_side.json").write_text(json.dumps(record, indent=2))
    print(f"written: {out / 'side_by_side.json'}")


if __name__ == "__main__":
    main()
