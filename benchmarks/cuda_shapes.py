"""What a new batch shape costs on CUDA, in precompute and in training, with torch's default attention kernels and
with cuDNN's left out, in one run.

    python benchmarks/cuda_shapes.py [--parts precompute,train] [--shapes 10] [--target 8b]
                                     [--out runs/cuda-shapes.json] [--dry-run]

Precompute and training batch samples padded to the longest in the batch, so the shapes their attention sees change
from batch to batch: a run over a real store meets up to max_length distinct lengths. On Hopper, torch 2.11's SDPA
tries cuDNN's attention first, and cuDNN builds an execution plan the first time it sees a shape (decoding paid
for one at every step until it left cuDNN out: mtptrain/runtime/attention.py). This measures what that costs where
shapes repeat less often than at decoding but every batch is large:

  precompute  the stage's forward (`capture_states` on the source precompute uses, the runtime's batched decoder
              where it runs the model) of a random target at --target's shapes (recipes/shapes/*.json), batches of
              the recipe's precompute.batch_tokens at --shapes distinct lengths up to data.max_length
  train       the EAGLE-3 head's forward and backward at --target's shapes and the recipe's micro-batch
              (recipes/llama-3.1-<target>-eagle3.yaml), at --shapes distinct lengths
  online      the target's forward as `train.online` runs it: one micro-batch (train.micro_batch_size rows) at a
              time, at --shapes distinct lengths (not in the default --parts)

For each attention choice (`default`: whatever SDPA picks; `no_cudnn`: flash, mem-efficient and math only, the
decoding choice; in training and online also `default_pad64`: the default kernels on micro-batches rounded up to a
multiple of 64 tokens, what train.pad_multiple auto does to training's micro-batches on CUDA) every shape is run
twice, the second visit right after all first visits: a first visit pays for kernel choices and plans, a second
does not. The choices take turns over the lengths of one sorted draw with no multiple of 64 in it (each meets
lengths no other choice has seen, of the same spread). Prints, per part and choice, the seconds of the first
visits, of the second, their difference per new shape, the second visits' time against no_cudnn's (the warm speed
a choice gives up or wins), and which attention operators each choice ran (torch.profiler, one batch each, after
every timing of the part). Each part runs in a process of its own (its own plan caches) that builds its model
once; a warm-up at a length outside the draw goes first.

--dry-run shrinks every shape (as scripts/gpu_check.py --dry-run does) and runs on the CPU, float32: it checks the
script, not the GPU (on the CPU both choices are the same kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check_shapes import TARGETS, build_head, frozen_parts, random_batch, shape_config  # noqa: E402

from mtptrain.config import CUDA_PAD_MULTIPLE, load_recipe  # noqa: E402
from mtptrain.target.layers import resolve_layers  # noqa: E402
from mtptrain.heads.losses import Loss  # noqa: E402
from mtptrain.heads.objective import step_weights  # noqa: E402
from mtptrain.runtime.attention import DECODING_BACKENDS  # noqa: E402
from mtptrain.runtime.batch import capture_states  # noqa: E402
from mtptrain.runtime.runner import runtime_for  # noqa: E402


CHOICES = ("default", "no_cudnn")
PADDED = "default_pad64"  # training and the online forward only
DRY_MAX_LENGTH, DRY_BATCH_TOKENS = 96, 512


def kernels(choice: str):
    import contextlib

    return sdpa_kernel(DECODING_BACKENDS) if choice == "no_cudnn" else contextlib.nullcontext()


def padded(choice: str, length: int) -> int:
    return -(-length // CUDA_PAD_MULTIPLE) * CUDA_PAD_MULTIPLE if choice == PADDED else length


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lengths_for(choices: tuple[str, ...], count: int, low: int, high: int) -> dict[str, list[int]]:
    """len(choices) * count distinct lengths in [low, high), none a multiple of 64, sorted, dealt in turn."""
    generator = torch.Generator().manual_seed(0)
    pool = [n for n in torch.randperm(high - low, generator=generator).add(low).tolist() if n % CUDA_PAD_MULTIPLE]
    drawn = sorted(pool[: len(choices) * count])
    return {choice: drawn[i::len(choices)] for i, choice in enumerate(choices)}


def attention_ops(run, device) -> list[str]:
    """The attention operators one call of `run` went through (names with 'attention' in them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    return sorted({e.key for e in prof.key_averages() if "attention" in e.key.lower() and e.key.startswith("aten::")})


def visits(run, lengths: dict[str, list[int]], device) -> dict:
    """Each choice: first visits over its lengths, then second visits over the same, timed one by one."""
    found, seconds = {}, {}
    for choice in lengths:
        with kernels(choice):
            timed = {"first": [], "second": []}
            for visit in ("first", "second"):
                for length in lengths[choice]:
                    sync(device)
                    started = time.perf_counter()
                    run(padded(choice, length))
                    sync(device)
                    timed[visit].append(time.perf_counter() - started)
        first, second = sum(timed["first"]), sum(timed["second"])
        seconds[choice] = second
        found[choice] = {"lengths": lengths[choice], "first_s": [round(t, 4) for t in timed["first"]],
                         "second_s": [round(t, 4) for t in timed["second"]], "first_total_s": round(first, 3),
                         "second_total_s": round(second, 3),
                         "plan_s_per_shape": round((first - second) / len(lengths[choice]), 4),
                         "median_first_over_second": round(statistics.median(
                             a / b for a, b in zip(timed["first"], timed["second"])), 2)}
    for choice in lengths:  # after every timing: a profiled batch is slower than a timed one
        with kernels(choice):
            found[choice]["attention_ops"] = attention_ops(lambda: run(padded(choice, lengths[choice][0])), device)
    for choice in lengths:
        found[choice]["second_visits_over_no_cudnn"] = round(seconds[choice] / seconds["no_cudnn"], 3)
    return found


def precompute_part(args, device, dtype) -> dict:
    return target_forward(args, device, dtype, online=False)


def online_part(args, device, dtype) -> dict:
    return target_forward(args, device, dtype, online=True)


def target_forward(args, device, dtype, online: bool) -> dict:
    """The target's forward as precompute batches it (batch_tokens per batch), or as `train.online` runs it: one
    micro-batch (train.micro_batch_size rows) at a time, which training's rounding may also round."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(ROOT / "recipes" / f"{TARGETS[args.target]}-eagle3.yaml")
    config = shape_config(args.target, args.dry_run)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    source = runtime_for(model, recipe.target.runtime, batched=True)
    layers = resolve_layers(recipe.precompute.layers, config.num_hidden_layers)
    batch_tokens = DRY_BATCH_TOKENS if args.dry_run else recipe.precompute.batch_tokens
    max_length = DRY_MAX_LENGTH if args.dry_run else recipe.data.max_length
    generator = torch.Generator().manual_seed(1)

    def run(length: int) -> None:
        rows = recipe.train.micro_batch_size if online else max(
            1, min(recipe.precompute.max_batch_size, batch_tokens // length))
        ids = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
        with torch.inference_mode():
            capture_states(source, ids, layers)

    run(max_length // 8 - 1)  # warm-up below every drawn (and rounded) length
    choices = (*CHOICES, PADDED) if online else CHOICES
    lengths = lengths_for(choices, args.shapes, max_length // 8, max_length - CUDA_PAD_MULTIPLE * online)
    found = visits(run, lengths, device)
    found.update(source=type(source).__name__, layers=layers, **(
        {"rows": recipe.train.micro_batch_size} if online else
        {"batch_tokens": batch_tokens, "max_batch_size": recipe.precompute.max_batch_size}))
    return found


def train_part(args, device, dtype) -> dict:
    recipe = load_recipe(ROOT / "recipes" / f"{TARGETS[args.target]}-eagle3.yaml")
    config = shape_config(args.target, args.dry_run)
    model = frozen_parts(config, device)
    head, spec = build_head(recipe, model, device)
    head = head.to(dtype)
    weights = step_weights(recipe.head.step_weights, spec.draft_positions)
    feature_weight, loss = spec.family.feature_weight(recipe.head), Loss(recipe.train.loss, recipe.train.loss_eta)
    max_length = DRY_MAX_LENGTH if args.dry_run else recipe.data.max_length
    batches = {}

    def run(length: int) -> None:
        if length not in batches:
            batches.clear()
            batches[length] = random_batch(recipe, spec, config, device, length)
            if dtype != torch.bfloat16:
                batches[length]["hidden"] = {k: v.to(dtype) for k, v in batches[length]["hidden"].items()}
        head.zero_grad(set_to_none=True)
        result = spec.family.objective(head, batches[length], spec, weights, feature_weight, recipe.train.loss_chunk,
                                       loss)
        result.loss.backward()

    run(max_length // 8 - 1)  # warm-up below every drawn (and rounded) length
    lengths = lengths_for((*CHOICES, PADDED), args.shapes, max_length // 8, max_length - CUDA_PAD_MULTIPLE)
    found = visits(run, lengths, device)
    found.update(micro_batch=recipe.train.micro_batch_size, ttt_steps=recipe.head.ttt_steps)
    return found


PARTS = {"precompute": precompute_part, "train": train_part, "online": online_part}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="train,precompute")
    parser.add_argument("--shapes", type=int, default=10, help="distinct lengths per choice")
    parser.add_argument("--target", choices=sorted(TARGETS), default="8b")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cuda-shapes.json")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parts and any(p not in PARTS for p in args.parts.split(",")):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --dry-run")
    device, dtype = (torch.device("cpu"), torch.float32) if args.dry_run else (torch.device("cuda", 0), torch.bfloat16)
    record = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
              "target": args.target, "shapes": args.shapes}
    if args.child:  # one part in this process, its record to --out
        started = time.perf_counter()
        found = PARTS[args.parts](args, device, dtype)
        found["part_s"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(found) + "\n")
        return 0
    for name in args.parts.split(","):
        # each part in a process of its own: its own plan caches, and the last part's memory given back
        part_out = args.out.with_name(f"{args.out.stem}-{name}.part.json")
        part_out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--child", "--parts", name, "--shapes", str(args.shapes),
                        "--target", args.target, "--out", str(part_out), *(["--dry-run"] if args.dry_run else [])],
                       check=True)
        record[name] = part = json.loads(part_out.read_text())
        part_out.unlink()
        for choice in (c for c in (*CHOICES, PADDED) if c in part):
            found = part[choice]
            print(f"{name} {choice}: first visits {found['first_total_s']:.3f} s, second {found['second_total_s']:.3f}"
                  f" s ({found['second_visits_over_no_cudnn']:.3f}x no_cudnn's), "
                  f"{found['plan_s_per_shape'] * 1000:.1f} ms more per new shape; ops {found['attention_ops']}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
