"""The eval report: report.md and three plots next to results.json.

acceptance.png   acceptance rate per draft position, best configuration of each method
speedup.png      tokens/s against the baseline, best configuration of each method
tau_vs_k.png     tau and speedup against K (and against the node budget for trees)
"""

from __future__ import annotations

from pathlib import Path

from mtptrain.io import atomic_write_text


def write_report(results: dict, out_dir: Path) -> list[str]:
    """Writes report.md and the PNG plots; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    by_label = {m["label"]: m for m in methods}
    best = [by_label[label] for label in results["best"].values()]
    files = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in best:
        if m["acceptance"]:
            ax.plot(range(1, len(m["acceptance"]) + 1), m["acceptance"], marker="o", label=m["label"])
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="Acceptance per draft position")
    ax.grid(alpha=0.3)
    if best:
        ax.legend()
    files.append(_save(fig, out_dir, "acceptance.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    shown = [methods[0]] + best
    bars = ax.bar([m["label"] for m in shown], [m["speedup"] or 0 for m in shown], color="tab:blue")
    for bar, m in zip(bars, shown):
        ax.annotate(f"{m['speedup']:.2f}x\ntau {m['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="speedup vs autoregressive", title="Speedup per method (best configuration)")
    ax.tick_params(axis="x", rotation=20)
    files.append(_save(fig, out_dir, "speedup.png"))

    trees = [m for m in methods if m["method"] == "tree"]
    fig, axes = plt.subplots(1, 3 if trees else 2, figsize=(15 if trees else 10, 4))
    left, right = axes[0], axes[1]
    for method in dict.fromkeys(m["method"] for m in methods if m["method"] not in ("baseline", "tree")):
        rows = [m for m in methods if m["method"] == method]
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
            ax.legend(loc="upper left")
    right.axhline(1.0, color="grey", lw=0.8)
    files.append(_save(fig, out_dir, "tau_vs_k.png"))

    atomic_write_text(out_dir / "report.md", markdown(results))
    return ["report.md", *files]


def _save(fig, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = out_dir / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out_dir / name)
    return name


def run_line(results: dict) -> str:
    """One sentence: target, machine, prompts and sampling of an eval run."""
    s, machine = results["settings"], results["machine"]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}"
    return (f"Target `{results['target']}` on {machine['device']} ({machine['dtype']}, {machine['threads']} threads). "
            f"Prompts: `{s['prompts']}`, {s['prompt_count']} prompts, {s['requests']} requests, up to "
            f"{s['max_new_tokens']} new tokens each, {sampling}, batch size 1.")


def methods_table(results: dict) -> list[str]:
    """The per-configuration table of an eval run, as markdown lines."""
    lines = ["| method | tau | tokens/s | speedup | draft ms/step | verify ms/step | verified tokens/step | exact | "
             "acceptance per position |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in results["methods"]:
        ex = m["exactness"]
        exact = "-" if not ex["checked"] else (f"**{len(ex['failures'])} failures**" if ex["failures"] else
                                               f"{ex['identical']}/{ex['checked']} identical")
        if ex["near_ties"]:
            exact += f", {len(ex['near_ties'])} near-ties"
        lines.append(f"| {m['label']} | {m['tau']:.2f} | {m['tokens_per_second']:.1f} | {m['speedup']:.2f}x | "
                     f"{m['draft_ms_per_step']:.1f} | {m['verify_ms_per_step']:.1f} | {m['verified_tokens_per_step']:.1f} | "
                     f"{exact} | {' '.join(f'{a:.2f}' for a in m['acceptance'])} |")
    return lines


def ssd_hits_by_j(ssd: dict) -> str:
    """'j=0 3/10, j=1 ...': hits out of rounds for each number of drafts accepted."""
    return ", ".join(f"j={j} {h}/{h + n}" for j, (h, n) in enumerate(zip(ssd["hits_by_accepted"],
                                                                          ssd["misses_by_accepted"])) if h + n)


def markdown(results: dict) -> str:
    s, head = results["settings"], results["head"]
    lines = [f"# Eval report: {results['name']}", "", run_line(results)]
    if head:
        lines.append(f"Head: `{head['path']}` ({head['kind']}, norms {head['norms']}, {head['parameters']:,} parameters).")
    lines += ["", "tau counts tokens per target forward, bonus included; speedup is tokens/s against the baseline "
              "measured in the same run on the same prompts.", ""]
    lines += methods_table(results)
    lines += ["", "## Best configuration per method", ""]
    by_label = {m["label"]: m for m in results["methods"]}
    for method, label in results["best"].items():
        m = by_label[label]
        lines.append(f"- {method}: **{label}**, tau {m['tau']:.2f}, {m['speedup']:.2f}x")
    ssd = [m for m in results["methods"] if "ssd" in m]
    if ssd:
        lines += ["", "## Speculation cache (ssd)", "",
                  "While the target verifies a draft, the drafter's process pre-drafts continuations for the likely "
                  "outcomes (drafts accepted j, next token). A hit means the next draft was ready when verification "
                  "ended. Hits / rounds by j, then guesses pre-drafted and rounds whose speculation the outcome cut "
                  "short.", "",
                  "| method | hit rate | hits by j | guesses | rounds cut short | prompt-lookup drafts |",
                  "|---|---|---|---|---|---|"]
        for m in ssd:
            lines.append(f"| {m['label']} | {m['ssd']['hit_rate']:.2f} | {ssd_hits_by_j(m['ssd'])} | "
                         f"{m['ssd']['guesses']} | {m['ssd']['rounds_cut']} | {m['ssd']['backup_drafts']} |")
    divergences = [(m["label"], d, kind) for m in results["methods"] for kind in ("failures", "near_ties")
                   for d in m["exactness"][kind]]
    if divergences:
        lines += ["", "## Divergences from the baseline", "",
                  f"At temperature 0 every method must reproduce the baseline. A divergence is tolerated only where the "
                  f"baseline's top-2 logit gap is below {s['near_tie']:g} (batched and one-token forwards round "
                  "differently and can break a near-tie either way).", ""]
        for label, d, kind in divergences:
            verdict = "FAILURE" if kind == "failures" else "near-tie"
            lines.append(f"- {label}, request {d['request']}, token {d['position']}: top-2 gap {d['top2_gap']:.2e} "
                         f"({verdict})")
    categories = sorted({c for m in results["methods"] for c in m["tau_by_category"]})
    if len(categories) > 1:
        drafted = [m for m in results["methods"] if m["label"] in results["best"].values()]
        lines += ["", "## tau by category (best configurations)", "",
                  "| category | " + " | ".join(m["label"] for m in drafted) + " |",
                  "|---|" + "---|" * len(drafted)]
        for c in categories:
            lines.append(f"| {c} | " + " | ".join(f"{m['tau_by_category'].get(c, 0):.2f}" for m in drafted) + " |")
    for note in results["notes"]:
        lines += ["", f"Note: {note}"]
    lines += ["", "![acceptance](acceptance.png)", "", "![speedup](speedup.png)", "", "![tau vs K](tau_vs_k.png)", ""]
    return "\n".join(lines)
