"""A training run's learning curve: its validations against the training tokens seen, as a Markdown table.

    python scripts/learning_curve.py runs/reference/train            # the table, printed
    python scripts/learning_curve.py runs/reference/train --plot curve.png

One row per validation in `metrics.jsonl` (every `train.eval_every` steps): the tokens seen by then, the
chain and tree tau and per-position acceptance of the head drafting in the engine (`train.engine_eval`), and
the teacher-forced top-1 agreement per draft position. The tokens come from the row itself
(`train/tokens_seen`) or, for runs logged before that key, from the head snapshot of the same step
(`train.head_snapshots`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def validations(run: Path) -> list[dict]:
    """The run's validation rows, the last logged for each step (a resumed run logs a step again)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"error: {metrics} not found: pass a training run directory (train.output_dir)")
    rows = {}
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {metrics}:{n} is not JSON ({e}); a killed run can leave a cut last line: "
                             "delete it") from None
        if any(k.startswith("val/") for k in row):
            rows[row["step"]] = row
    for step, row in rows.items():
        if "train/tokens_seen" not in row:
            snapshot = run / "snapshots" / f"step-{step:07d}" / "config.json"
            if snapshot.is_file():
                row["train/tokens_seen"] = json.loads(snapshot.read_text())["train"]["tokens"]
    return [rows[s] for s in sorted(rows)]


def _series(row: dict, prefix: str) -> list[float]:
    values, i = [], 1
    while f"{prefix}{i}" in row:
        values.append(row[f"{prefix}{i}"])
        i += 1
    return values


def table(rows: list[dict]) -> str:
    def fmt(values: list[float], digits: int = 2) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in values) or "–"

    def num(v, spec: str) -> str:
        return format(v, spec) if v is not None else "–"

    lines = ["| step | training tokens | chain tau | chain acceptance per position | tree tau | agreement "
             "(teacher-forced), positions 1–n |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {num(r.get('train/tokens_seen'), ',')} | {num(r.get('val/tau_chain'), '.2f')} "
                     f"| {fmt(_series(r, 'val/accept_chain_'))} | {num(r.get('val/tau_tree'), '.2f')} "
                     f"| {fmt(_series(r, 'val/acc_'), 3)} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("train/tokens_seen")]
    x = [r["train/tokens_seen"] / 1e6 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("val/tau_chain", "chain"), ("val/tau_tree", "tree")):
        if any(key in r for r in rows):
            left.plot(x, [r.get(key) for r in rows], marker="o", label=label)
    left.set(xlabel="training tokens (M)", ylabel="tau (engine, held-out prompts)")
    left.legend()
    for i, _ in enumerate(_series(rows[0], "val/acc_") if rows else [], 1):
        right.plot(x, [r[f"val/acc_{i}"] for r in rows], marker="o", label=f"position {i}")
    right.set(xlabel="training tokens (M)", ylabel="teacher-forced agreement")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a training run directory (train.output_dir)")
    parser.add_argument("--plot", type=Path, help="also draw the curve to this PNG")
    args = parser.parse_args()
    rows = validations(args.run)
    if not rows:
        raise SystemExit(f"error: {args.run / 'metrics.jsonl'} has no validation yet (train.eval_every)")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
