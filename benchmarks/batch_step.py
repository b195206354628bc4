"""One step of batched decoding (regenerate's inner loop, mtptrain/runtime/batch.py) under each of the runtime's
CPU kernel settings, interleaved step by step in one process, so that the VM's drift (±15% between runs of
the whole stage on the 2-core machines) falls on every setting alike.

    python benchmarks/batch_step.py [--rows 128] [--chunks 40,120] [--steps 15] [--dtype auto] [--model DIR]

The target of recipes/reference.yaml (the embedded SmolLM2-135M-Instruct, or the one --model names) on its
runtime choice. --rows rows
hold 60 to 384 cached positions each (seeded, uniform: the reference run's spread), in the runtime's length
bands; their caches hold random keys and values, as the cost of a step does not depend on them. A step takes
one token per row, plus the prompt chunks of --chunks rows just given a new request (regenerate averages 0.4
prompt tokens per generated one). The step is run and undone, so every step is the same. Settings:

  torch          torch's elementwise operations and batch attention (the runtime before the C++ kernels)
  layer-ops      the fused elementwise kernels (csrc/layer_ops.cpp), torch's batch attention
  kernels        the fused elementwise kernels and the step kernel (csrc/decode_attention.cpp: writes and
                 attention of each band, chunks included, in one call per band and layer)

Prints the CPU, the median ms per step of each setting and its ratio to torch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mtptrain.config import load_recipe
from mtptrain.machine import describe_cpu
from mtptrain.runtime import model as runtime_model
from mtptrain.runtime.batch import Request, _Row, _Slots
from mtptrain.runtime.runner import load_decoder
from mtptrain.target import load_target

SETTINGS = ("torch", "layer-ops", "kernels")


def build(decoder, rows: int, chunks: list[int], vocab: int, seed: int = 0) -> _Slots:
    rng = random.Random(seed)
    top = min(40000, vocab)  # token ids drawn from 100 up to here
    slots = _Slots(decoder)
    for _ in range(rows):
        length = rng.randint(60, 384)
        held = [rng.randrange(100, top) for _ in range(length)]
        row = _Row(Request(held + [1], 512), [], 1)
        slots.rows.append(row)
        slots._fit(row, length + 1, 0)
        row.held = held
    for band in slots.bands:
        for store in (band.keys, band.values):
            for tensor in store:
                tensor.normal_()
    for row, size in zip(rng.sample(slots.rows, len(chunks)), chunks):
        row.chunk = [rng.randrange(100, top) for _ in range(size)]
        slots._fit(row, len(row.held) + size + 1, len(row.held))
    return slots


def one_step(slots: _Slots) -> float:
    saved = [(row, list(row.held), list(row.chunk), row.feed) for row in slots.rows]
    started = time.perf_counter()
    slots.step()
    seconds = time.perf_counter() - started
    for row, held, chunk, feed in saved:
        row.held, row.chunk, row.feed = held, chunk, feed
    return seconds


def use(setting: str, native, step_kernel) -> None:
    runtime_model._native = native if setting != "torch" else (lambda x: None)
    fused = setting.startswith("kernels")
    runtime_model.FastDecoder.step_kernel = property(lambda self: step_kernel(self) if fused else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/reference.yaml")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--chunks", default="50", help="prompt chunk lengths taken in with the step")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per setting")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--model", help="target.model (a model directory, GGUF or hub id) instead of the recipe's")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, [f"target.dtype={args.dtype}", *([f"target.model={args.model}"] if args.model
                                                                      else [])])
    model = load_target(recipe.target).model
    decoder = load_decoder(model, batched=True)
    assert decoder is not None, "the target must run on the runtime"
    native, step_kernel = runtime_model._native, runtime_model.FastDecoder.step_kernel.fget
    chunks = [int(c) for c in args.chunks.split(",") if c]
    slots = build(decoder, args.rows, chunks, model.config.vocab_size)
    settings = args.settings.split(",")
    cpu = describe_cpu()
    print(f"CPU: {cpu['model']}, torch {torch.__version__} at {cpu['capability']}, extensions "
          f"{', '.join(cpu['extensions'] or [])}; {torch.get_num_threads()} threads")
    print(f"runtime: {decoder.choice.describe()}")
    print(f"{args.rows} rows of 60-384 positions, chunks {chunks}; bands "
          f"{[(band.limit, len(band.rows)) for band in slots.bands]}")
    times = {s: [] for s in settings}
    with torch.inference_mode():
        for setting in settings:  # warm-up: first calls, allocations
            use(setting, native, step_kernel)
            one_step(slots)
        for _ in range(args.steps):
            for setting in settings:
                use(setting, native, step_kernel)
                times[setting].append(one_step(slots))
    base = statistics.median(times[settings[0]])
    print(f"{'setting':14s} {'ms/step':>8s} {'spread':>14s} {'vs ' + settings[0]:>10s}")
    for setting in settings:
        t = sorted(times[setting])
        median = statistics.median(t)
        print(f"{setting:14s} {1000 * median:8.1f} {1000 * t[0]:6.1f}-{1000 * t[-1]:<6.1f} {base / median:9.2f}x")


if __name__ == "__main__":
    main()
