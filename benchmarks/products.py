"""The target's linear products, one decoding step's worth, on every product this machine offers, in one run.

    python benchmarks/products.py [--rows 1,2,4,8,16,32,160] [--repeats 7] [--dtype bfloat16]
                                  [--recipe recipes/quickstart.yaml] [--model DIR]

The weights are the shapes of every layer of the recipe's target (its config, no weights loaded: random
values), fused as the runtime fuses them (q/k/v, gate/up), plus the LM head, each in the layout its product
reads: torch's `F.linear` on the plain weight, oneDNN's packed layout, and the runtime's blocked layout
(csrc/blocked_linear.cpp); in float32 also the blocked product over weights whose values are bfloat16 (a
bfloat16 checkpoint run in float32), which the runtime holds in bfloat16 blocks. They are far more than any
cache holds, so each pass streams them from memory as a decoding step does. For each row count, the products
take turns pass by pass (`--repeats` each); the table shows the median ms of a pass, its bandwidth (the bytes
the pass reads / time) and the ratio against oneDNN's packed product, which the runtime used before its own.

With --kernels-at REV (a git revision: HEAD~1, a commit; or a directory holding a copy of csrc/), also the
native product of the kernels built from csrc/ as REV holds it, over the same blocks, in the same turns: a
kernel change's before and after in one run.

Then (unless --no-steps) whole decoding steps of the recipe's target on the runtime, once per product, each
on its own copy of the model: one token after a 200-token prefix, and a verification of 4 and 8 tokens, the
products' steps interleaved; the runtime's other kernels are the ones this machine measured.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from mtptrain.config import load_recipe
from mtptrain.machine import cpu_line, describe_cpu
from mtptrain.runtime.choice import shapes
from mtptrain.runtime.native_kernels import extension_at
from mtptrain.runtime.products import PRODUCTS, products
from mtptrain.target import load_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,160", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="passes per product and row count")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--recipe", default="recipes/quickstart.yaml", help="whose target's shapes")
    parser.add_argument("--model", help="target.model (a model directory, GGUF or hub id) instead of the recipe's")
    parser.add_argument("--no-steps", action="store_true", help="only the products, not whole decoding steps")
    parser.add_argument("--kernels-at", metavar="REV",
                        help="also time the native product built from csrc/ at this git revision (e.g. HEAD~1) or "
                             "from this directory's copy of csrc/")
    return parser.parse_args()


def kernels_at(revision: str):
    """The runtime's kernels built from mtptrain/runtime/csrc as git revision `revision` of this checkout holds
    them, or from the directory `revision` (native_kernels.extension_at)."""
    if Path(revision).is_dir():
        return built(extension_at(Path(revision)), revision)
    if revision.startswith("-"):  # git would read it as an option
        raise SystemExit(f"--kernels-at {revision}: not a revision or a directory")
    csrc = "mtptrain/runtime/csrc"
    root = Path(__file__).resolve().parent.parent
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", revision, csrc], capture_output=True,
                                 check=False)
    except FileNotFoundError:
        raise SystemExit(f"--kernels-at {revision}: git is not installed; pass a directory holding a copy of csrc/")
    if archive.returncode != 0:
        raise SystemExit(f"--kernels-at {revision}: git archive could not read {csrc} there: "
                         f"{archive.stderr.decode(errors='replace').strip()}")
    with tempfile.TemporaryDirectory(prefix="kernels-at-") as scratch:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(scratch, filter="data")
        return built(extension_at(Path(scratch) / csrc), revision)


def built(module, revision: str):
    """`module`, or the exit that says the kernels at `revision` did not build."""
    if module is None:
        raise SystemExit(f"--kernels-at {revision}: its kernels did not build (the warning above says why)")
    return module


def steps(recipe_path: str, sets: list[str], dtype: torch.dtype, names: list[str], repeats: int) -> None:
    """Median ms of a forward over 1, 4 and 8 new tokens after a 200-token prefix, per product."""
    from mtptrain.runtime.choice import choose
    from mtptrain.runtime.model import FastDecoder
    from mtptrain.runtime.runner import FastRunner
    from mtptrain.target import load_target

    recipe = load_recipe(recipe_path, [*sets, f"target.dtype={str(dtype).removeprefix('torch.')}"])
    runners = {}
    for name in names:
        model = load_target(recipe.target).model
        choice = choose(model.config, torch.device("cpu"), str(dtype).removeprefix("torch."))
        runners[name] = FastRunner(FastDecoder(model, choice, name))
    vocab = model.config.vocab_size  # ids past a small vocabulary wrap around
    prefix = [t % vocab for t in range(1000, 1200)]
    for runner in runners.values():
        runner.reset()
        runner.forward(prefix, last_only=True)
    widths = (1, 4, 8)
    times = {(name, w): [] for name in names for w in widths}
    for step in range(repeats * 5):
        for w in widths:
            for name, runner in runners.items():
                runner.rollback(len(prefix))
                started = time.perf_counter()
                runner.forward([t % vocab for t in range(2000 + step, 2000 + step + w)])
                times[name, w].append(time.perf_counter() - started)
    print(f"\ndecoding steps of the target, each product on its own copy (otherwise {choice.describe()}), "
          f"median ms of {repeats * 5}:")
    print(f"{'tokens':>7}" + "".join(f"{name:>14}" for name in names))
    for w in widths:
        print(f"{w:>7}" + "".join(f"{1000 * statistics.median(times[name, w]):>11.2f} ms" for name in names))


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    sets = [f"target.model={args.model}"] if args.model else []
    config = load_config(load_recipe(args.recipe, sets).target)
    layer = shapes(config)
    every = layer * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]
    generator = torch.Generator().manual_seed(0)
    plain = [(torch.randn(o, i, generator=generator) * 0.02).to(dtype) for o, i in every]
    weight_bytes = sum(w.numel() * w.element_size() for w in plain)
    names = [p for p in products(dtype) if p != "skinny"]  # skinny is F.linear past 32 rows
    laid_out = {p: [PRODUCTS[p].lay_out(w) for w in plain] for p in names}
    columns = {name: (PRODUCTS[name], laid_out[name], weight_bytes) for name in names}  # and the bytes a pass reads
    if dtype == torch.float32 and "native" in names:  # a bfloat16 checkpoint run in float32: bfloat16 blocks
        columns["native, bf16 values"] = (PRODUCTS["native"],
                                          [PRODUCTS["native"].lay_out(w.to(torch.bfloat16).float()) for w in plain],
                                          weight_bytes // 2)
    if args.kernels_at:
        if "native" not in names:
            raise SystemExit("--kernels-at: this machine has no native product for " + args.dtype)
        module = kernels_at(args.kernels_at)
        if not hasattr(module, "blocked_supports"):
            raise SystemExit(f"--kernels-at {args.kernels_at}: those kernels have no blocked product (older than it)")
        if not module.blocked_supports(dtype == torch.bfloat16):
            raise SystemExit(f"--kernels-at {args.kernels_at}: those kernels have no {args.dtype} product here")
        columns[f"native @{args.kernels_at}"] = (
            lambda x, w, bias: module.blocked_linear(x, w.blocks, bias, w.out_features), laid_out["native"],
            weight_bytes)
    cpu = describe_cpu()
    print(cpu_line(cpu) + f"; {torch.get_num_threads()} threads")
    whose = f"the target {args.model}" if args.model else f"{args.recipe}'s target"
    print(f"{len(every)} products of {whose} ({config.num_hidden_layers} layers and the LM head), "
          f"{weight_bytes / 1e6:.0f} MB in {args.dtype}; median ms of a pass over {args.repeats}, interleaved\n")
    print(f"{'rows':>5}" + "".join(f"{name:>30}" for name in columns))
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {i: torch.randn(rows, i, generator=generator).to(dtype) for _, i in every}
        times = {name: [] for name in columns}
        for product, weights, _ in columns.values():  # warm-up: first-call allocations, kernel builds
            product(inputs[every[0][1]], weights[0], None)
        for _ in range(args.repeats):
            for name, (product, weights, _) in columns.items():
                started = time.perf_counter()
                for (_, i), w in zip(every, weights):
                    product(inputs[i], w, None)
                times[name].append(time.perf_counter() - started)
        base = statistics.median(times["packed"]) if "packed" in times else None
        cells = []
        for name, (_, _, read) in columns.items():
            ms = 1000 * statistics.median(times[name])
            ratio = f" {base * 1000 / ms:.2f}x" if base else ""
            cells.append(f"{ms:8.2f} ms {read / ms / 1e6:5.1f} GB/s{ratio}")
        print(f"{rows:>5}" + "".join(f"{c:>30}" for c in cells))
    if not args.no_steps:
        steps(args.recipe, sets, dtype, names, args.repeats)


if __name__ == "__main__":
    main()
