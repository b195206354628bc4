"""The eval report: report.md and three plots next to results.json.

acceptance.png   acceptance rate per draft position (cumulative), best configuration of each method
speedup.png      tokens/s against the baseline (median, whiskers over the repeats), best configuration of each
                 method
tau_vs_k.png     tau and speedup against K (and against the node budget for trees)
"""

from __future__ import annotations

from pathlib import Path

from mtptrain.io import atomic_write_text
from mtptrain.report_lines import cpu_text, run_line

# GenerationStats.acceptance(): at position i, the share of all steps whose drafts 1..i were all accepted, not
# the share of those that reached i-1.
ACCEPTANCE_KIND = "cumulative"


def write_report(results: dict, out_dir: Path) -> list[str]:
    """Writes report.md and the PNG plots; returns the file names written."""
    # matplotlib takes ~0.3 s to import with pyplot: only the plots need it, not the CLI's summary or export's
    # README, which use this module too. The backend is chosen here, before any pyplot import below.
    import matplotlib

    matplotlib.use("Agg")
    files = [_save(acceptance_figure(results), out_dir, "acceptance.png"),
             _save(speedup_figure(results), out_dir, "speedup.png"),
             _save(tau_vs_k_figure(results), out_dir, "tau_vs_k.png")]
    atomic_write_text(out_dir / "report.md", markdown(results))
    return ["report.md", *files]


def _best(results: dict) -> list[dict]:
    by_label = {m["label"]: m for m in results["methods"]}
    return [by_label[label] for label in results["best"].values()]


def acceptance_figure(results: dict):
    # pyplot (~0.3 s) only when a plot is drawn; see write_report
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    best = _best(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in best:
        if m["acceptance"]:
            ax.plot(range(1, len(m["acceptance"]) + 1), m["acceptance"], marker="o", label=m["label"])
    ax.set(xlabel="draft position i", ylim=(0, 1), title="Acceptance per draft position")
    ax.set_ylabel(f"acceptance rate, {ACCEPTANCE_KIND}\n(steps with drafts 1..i all accepted)", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if best:
        _legend_outside(ax)
    return fig


def speedup_figure(results: dict):
    """Bars at the median speedup, whiskers from the slowest to the fastest repeat."""
    import matplotlib.pyplot as plt  # ~0.3 s, only when a plot is drawn; see write_report

    fig, ax = plt.subplots(figsize=(6, 4))
    shown = [results["methods"][0]] + _best(results)
    heights = [m["speedup"] or 0 for m in shown]
    tops = [max(h, m.get("speedup_max") or 0) for h, m in zip(heights, shown)]
    errors = [[h - (m.get("speedup_min") or h) for h, m in zip(heights, shown)],
              [top - h for h, top in zip(heights, tops)]]
    bars = ax.bar([m["label"] for m in shown], heights, yerr=errors, capsize=3, color="tab:blue")
    for bar, m, top in zip(bars, shown, tops):
        ax.annotate(f"{m['speedup']:.2f}x\ntau {m['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, top),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    # Headroom for the two-line labels above the tallest bar: without it they run into the title.
    ax.set_ylim(0, max(tops + [1.0]) * 1.3)
    repeated = any(m.get("speedup_spread") is not None for m in shown)
    ax.set(ylabel="speedup vs autoregressive" + ("\n(median; whiskers: slowest to fastest repeat)" if repeated else ""),
           title="Speedup per method (best configuration)")
    ax.tick_params(axis="x", rotation=20)
    return fig


def tau_vs_k_figure(results: dict):
    import matplotlib.pyplot as plt  # ~0.3 s, only when a plot is drawn; see write_report

    methods = results["methods"]
    trees = [m for m in methods if m["method"] == "tree"]
    fig, axes = plt.subplots(1, 3 if trees else 2, figsize=(15 if trees else 10, 4))
    left, right = axes[0], axes[1]
    for method in dict.fromkeys(_key(m) for m in methods if m["method"] not in ("baseline", "tree")):
        rows = [m for m in methods if _key(m) == method]
        left.plot([m["k"] for m in rows], [m["tau"] for m in rows], marker="o", label=method)
        right.plot([m["k"] for m in rows], [m["speedup"] for m in rows], marker="o", label=method)
    left.set(xlabel="draft length K", ylabel="tau (tokens per target forward)", title="tau vs K")
    right.set(xlabel="draft length K", ylabel="speedup", title="speedup vs K")
    if trees:
        budgets = [m["budget"] for m in trees]
        axes[2].plot(budgets, [m["tau"] for m in trees], marker="s", label="tau")
        axes[2].plot(budgets, [m["speedup"] for m in trees], marker="o", label="speedup")
        axes[2].set(xlabel="tree node budget", title=f"tree (depth {trees[0]['k']})")
        axes[2].set_xticks(budgets)
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            _legend_outside(ax)
    right.axhline(1.0, color="grey", lw=0.8)
    return fig


def _key(m: dict) -> str:
    """A line of the tau-vs-K plot: a row's method with its chain stop, and its engine where that is not the
    embedded one (eval/tally.py's method_key names the same without the stop: the best per method)."""
    engine = m.get("engine", "embedded")
    method = (m["method"] + (f" stop {m['stop']:g}" if m.get("stop") else "")
              + (f" draft T {m['draft_temperature']:g}" if m.get("draft_temperature") is not None else "")
              + (" int8" if m.get("draft_weights") == "int8" else ""))
    return method if engine == "embedded" else f"{engine} {method}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _legend_outside(ax) -> None:
    """Right of the axes: any corner inside them can hold a data point."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)


def _save(fig, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt  # ~0.3 s, only when a plot is drawn; see write_report

    fig.tight_layout()
    tmp = out_dir / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out_dir / name)
    return name


def spread_cell(m: dict, markdown: bool = False) -> str:
    """'0.95-1.02' (markdown: '0.95-1.02x (7%)'), '!' appended where the speedup is unreliable; '-' for a single
    timing and for results written before timings were repeated."""
    if m.get("speedup_spread") is None:
        cell = "-"
    elif markdown:
        cell = f"{m['speedup_min']:.2f}-{m['speedup_max']:.2f}x ({m['speedup_spread']:.0%})"
    else:
        cell = f"{m['speedup_min']:.2f}-{m['speedup_max']:.2f}"
    if m.get("unreliable"):
        cell += " **!**" if markdown else " !"
    return cell


def timing_lines(results: dict) -> list[str]:
    """How the timings were taken and how busy the machine was (nothing for results that predate repeats)."""
    s, machine = results["settings"], results["machine"]
    lines = []
    if "repeats" in s:
        lines.append(f"tokens/s and speedup: median of {s['repeats']} repeats, each repeat's speedup against that "
                     "repeat's baseline; spread: the slowest and the fastest repeat's speedup; ! marks a speedup "
                     f"whose spread exceeds {s['max_spread']:.0%} of its median (eval.max_spread) or a run where "
                     f"other processes used more than {s['max_other_load']:g} CPU cores (eval.max_other_load)")
    if "other_load" in machine:
        load = machine["other_load"]
        lines.append("the machine's load was not measured (no /proc/stat): a busy machine would go unnoticed"
                     if load is None else
                     f"other processes used {load:.2f} CPU cores on average during the "
                     f"{machine['measured_seconds']:.0f} s measured")
    return lines


def decoding_line(results: dict) -> str | None:
    """The speedups with each request's time to its first token left out (the prompt's forward, and a drafter
    reading its states), which the same prompts cost every method about alike, and that time per request; None
    for results that predate it."""
    timed = [m for m in results["methods"] if "decoding_speedup" in m]
    if not any(m["method"] != "baseline" for m in timed):
        return None
    return ("after the first token (the time to it left out): " + ", ".join(
        f"{m['label']} {m['decoding_speedup']:.2f}x" for m in timed if m["method"] != "baseline")
        + "; time to the first token, ms per request: " + ", ".join(
        f"{m['label']} {m['prefill_ms_per_request']:.0f}" for m in timed))


def methods_table(results: dict) -> list[str]:
    """The per-configuration table of an eval run, as markdown lines."""
    lines = ["| method | tau | tokens/s | speedup | speedup spread | draft ms/step | verify ms/step | "
             f"verified tokens/step | exact | acceptance per position ({ACCEPTANCE_KIND}) | tau, acceptance "
             "per request |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in results["methods"]:
        ex = m["exactness"]
        exact = (f"**{len(ex['failures'])} failures**" if ex["failures"] else
                 "-" if not ex["checked"] else f"{ex['identical']}/{ex['checked']} identical")
        if ex["near_ties"]:
            exact += f", {len(ex['near_ties'])} near-ties"
        lines.append(f"| {m['label']} | {m['tau']:.2f} | {m['tokens_per_second']:.1f} | {m['speedup']:.2f}x | "
                     f"{spread_cell(m, markdown=True)} | {_ms(m['draft_ms_per_step'])} | "
                     f"{_ms(m['verify_ms_per_step'])} | {m['verified_tokens_per_step']:.1f} | {exact} | "
                     f"{' '.join(f'{a:.2f}' for a in m['acceptance'])} | {_per_request(m)} |")
    return lines


def _per_request(m: dict) -> str:
    if "tau_per_request" not in m:
        return "-"
    return f"{m['tau_per_request']:.2f}: " + " ".join(f"{a:.2f}" for a in m["acceptance_per_request"])


def ssd_hits_by_j(ssd: dict) -> str:
    """'j=0 3/10, j=1 ...': hits out of rounds for each number of drafts accepted."""
    return ", ".join(f"j={j} {h}/{h + n}" for j, (h, n) in enumerate(zip(ssd["hits_by_accepted"],
                                                                          ssd["misses_by_accepted"])) if h + n)


def markdown(results: dict) -> str:
    head = results["head"]
    lines = [f"# Eval report: {results['name']}", "", run_line(results)]
    if head:
        lines.append(f"Head: `{head['path']}` ({head['kind']}, norms {head['norms']}, {head['parameters']:,} parameters).")
    if results.get("warnings"):
        lines += ["", "**Warning: unreliable timings.** These speedups say more about the machine than about the "
                  "methods; rerun on a quiet machine or with more eval.repeats.", ""]
        lines += [f"- {warning}" for warning in results["warnings"]]
    lines += ["", "tau counts tokens per target forward, bonus included; speedup is tokens/s against the baseline "
              "measured in the same run on the same prompts. Acceptance per position is cumulative: at position i, "
              "the share of all steps in which drafts 1..i were all accepted (a step that drafted fewer than i "
              "tokens did not reach i), so tau = 1 + their sum, less the tokens cut where an answer ended inside a "
              "step (its token budget or an end of sequence); not the share of the steps that got as far as "
              "position i.", ""]
    lines += [f"{line[0].upper()}{line[1:]}." for line in timing_lines(results)]
    lines += ["", *methods_table(results)]
    decoding = decoding_line(results)
    if decoding:
        lines += ["", f"{decoding[0].upper()}{decoding[1:]}."]
    lines += ["", "## Best configuration per method", ""]
    by_label = {m["label"]: m for m in results["methods"]}
    for method, label in results["best"].items():
        m = by_label[label]
        spread = f", spread {spread_cell(m, markdown=True)}" if m.get("speedup_spread") is not None else ""
        lines.append(f"- {method}: **{label}**, tau {m['tau']:.2f}, {m['speedup']:.2f}x{spread}")
    lines += (_serving_section(results) + _ssd_section(results) + _divergence_section(results)
              + _category_section(results))
    for note in results["notes"]:
        lines += ["", f"Note: {note}"]
    lines += ["", "![acceptance](acceptance.png)", "", "![speedup](speedup.png)", "", "![tau vs K](tau_vs_k.png)", ""]
    return "\n".join(lines)


def serving_line(results: dict) -> str | None:
    """Which vLLM measured the vllm rows, and how often its baseline wrote the embedded baseline's answers."""
    serving = results.get("serving")
    if not serving:
        return None
    line = (f"vllm rows: vLLM {serving['vllm']} (torch {serving['torch']}) on {serving['device']} in "
            f"{serving['dtype']}, {serving['threads']} threads, engine core "
            f"{'in the worker process' if serving.get('in_process') else 'in its own process'}"
            + (f", head read from {serving['format']}" if serving.get("format") else ""))
    if serving.get("fixed"):
        line += f"; replaced in vLLM for this run: {'; '.join(serving['fixed'])}"
    if "baselines_compared" in serving:
        line += (f"; its baseline wrote {serving['baselines_identical']}/{serving['baselines_compared']} answers "
                 "identical to the embedded baseline's")
    return line


def _serving_section(results: dict) -> list[str]:
    line = serving_line(results)
    if line is None:
        return []
    return ["", "## The serving engine", "", line + ".", "",
            "Its rows come from vLLM's own counters (vllm:spec_decode_num_drafts, "
            "vllm:spec_decode_num_accepted_tokens_per_pos) read around each request, which runs alone (batch 1); "
            "each request is timed inside vLLM's process. tau and the acceptance columns are pooled over all "
            "steps of all requests (what vLLM's and SGLang's metrics report); the last column averages them per "
            "request (what SpecForge reports). Its speedups are against its own baseline."]


def _ssd_section(results: dict) -> list[str]:
    ssd = [m for m in results["methods"] if "ssd" in m]
    if not ssd:
        return []
    lines = ["", "## Speculation cache (ssd)", "",
             "While the target verifies a draft, the drafter's process pre-drafts continuations for the likely "
             "outcomes (drafts accepted j, next token). A hit means the next draft was ready when verification "
             "ended. Hits / rounds by j, then guesses pre-drafted and rounds whose speculation the outcome cut "
             "short (first repeat).", "",
             "| method | hit rate | hits by j | guesses | rounds cut short | prompt-lookup drafts |",
             "|---|---|---|---|---|---|"]
    for m in ssd:
        lines.append(f"| {m['label']} | {m['ssd']['hit_rate']:.2f} | {ssd_hits_by_j(m['ssd'])} | "
                     f"{m['ssd']['guesses']} | {m['ssd']['rounds_cut']} | {m['ssd']['backup_drafts']} |")
    return lines


def _divergence_section(results: dict) -> list[str]:
    divergences = [(m["label"], d, kind) for m in results["methods"] for kind in ("failures", "near_ties")
                   for d in m["exactness"][kind]]
    if not divergences:
        return []
    lines = ["", "## Divergences from the baseline", "",
             "At temperature 0 every method must reproduce the baseline, and every later repeat its first one. A "
             "divergence is tolerated only where the baseline's top-2 logit gap is below "
             f"{results['settings']['near_tie']:g}, or in bfloat16 / float16 below "
             f"{results['settings'].get('near_tie_ulps', 0):g} rounding steps of the top logit (batched and "
             "one-token forwards round differently and can break a near-tie either way).", ""]
    for label, d, kind in divergences:
        verdict = "FAILURE" if kind == "failures" else "near-tie"
        repeat = f" (repeat {d['repeat']} against the first)" if "repeat" in d else ""
        bound = f" < {d['bound']:.2e}" if kind == "near_ties" and "bound" in d else ""
        lines.append(f"- {label}, request {d['request']}{repeat}, token {d['position']}: top-2 gap "
                     f"{d['top2_gap']:.2e}{bound} ({verdict})")
    return lines


def _category_section(results: dict) -> list[str]:
    categories = sorted({c for m in results["methods"] for c in m["tau_by_category"]})
    if len(categories) <= 1:
        return []
    drafted = [m for m in results["methods"] if m["label"] in results["best"].values()]
    lines = ["", "## tau by category (best configurations)", "",
             "| category | " + " | ".join(m["label"] for m in drafted) + " |", "|---|" + "---|" * len(drafted)]
    for c in categories:
        lines.append(f"| {c} | " + " | ".join(f"{m['tau_by_category'].get(c, 0):.2f}" for m in drafted) + " |")
    return lines


def format_results(results: dict) -> str:
    """The CLI's summary: the table (a ! on unreliable speedups), the best configurations, and what the marks,
    the repeats and the machine's load mean."""
    width = max([14] + [len(m["label"]) + 1 for m in results["methods"]])  # "chain K=5 stop 0.15" fits
    rows = [f"{'method':<{width}}{'tau':>7}{'tok/s':>9}{'speedup':>9}  {'spread':<12}{'exact':<10}"
            f"acceptance per position ({ACCEPTANCE_KIND})"]
    for m in results["methods"]:
        accept = " ".join(f"{a:.2f}" for a in m["acceptance"])
        rows.append(f"{m['label']:<{width}}{m['tau']:>7.2f}{m['tokens_per_second']:>9.1f}{m['speedup']:>8.2f}x  "
                    f"{spread_cell(m):<12}{_exact_cell(m['exactness']):<10}{accept}")
    best = results["best"]
    lines = ["\n".join(rows)]
    if best:
        by_label = {m["label"]: m for m in results["methods"]}
        lines.append("best per method: " + ", ".join(
            f"{label} (tau {by_label[label]['tau']:.2f}, {by_label[label]['speedup']:.2f}x"
            f"{' !' if by_label[label].get('unreliable') else ''})" for label in best.values()))
    if any(m["exactness"]["near_ties"] for m in results["methods"]):
        lines.append("* some outputs diverge from the baseline at float near-ties (see report.md)")
    decoding = decoding_line(results)
    if decoding:
        lines.append(decoding)
    lines += timing_lines(results) + [f"CPU: {cpu_text(results['machine'])}"]
    if serving_line(results):
        lines.append(serving_line(results))
    per_request = [m for m in results["methods"] if "tau_per_request" in m]
    if per_request:
        lines.append("tau averaged per request: " + ", ".join(f"{m['label']} {m['tau_per_request']:.2f}"
                                                               for m in per_request))
    lines += [f"! {warning}" for warning in results.get("warnings", [])]
    for m in results["methods"]:
        if "ssd" in m:
            lines.append(f"{m['label']}: speculation cache hit rate {m['ssd']['hit_rate']:.2f} "
                         f"({ssd_hits_by_j(m['ssd'])})")
    for note in results["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _exact_cell(ex: dict) -> str:
    if ex["failures"]:
        return "FAIL"
    if not ex["checked"]:
        return "-"
    return f"{ex['identical']}/{ex['checked']}" + ("*" if ex["near_ties"] else "")
