"""The fused decode-attention kernel (mtptrain/runtime/csrc/decode_attention.cpp) against today's batched path.

    python benchmarks/decode_attention.py [--rows 128] [--rounds 5] [--steps 3] [--dtypes bfloat16,float32]

SmolLM2-135M's attention shapes (9 query heads, 3 kv heads, head dim 64, 30 layers); --rows rows of lengths
drawn uniform in 60..384 (seeded), grouped as the runtime groups them into bands by length (<= 128, <= 256,
<= 512 positions), each band one tensor [rows in band, 3, capacity, 64] with the capacity its longest row
rounded up to 64. One step is the 30 layers, each with its own cache (so nothing stays in the CPU's caches):
  plain        attention.plain_attention per band, with the additive float32 mask of `batch_mask(seen, "plain", dtype)`
  kernel       the kernel per band, with each row's length
  kernel-one   the kernel over one tensor holding every row, capacity 384
The three are timed in turn, round after round; the table shows the median ms per step, the bandwidth of the
live keys and values (each row's positions, both tensors, all layers) and the ratio against plain. The
machine's copy bandwidth (dst.copy_(src) of 256 MB, bytes read plus written) and read bandwidth (a sum over
256 MB) are printed for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtptrain.machine import describe_cpu, memory_bandwidth
from mtptrain.runtime.attention import batch_mask, plain_attention
from mtptrain.runtime.native_kernels import decode_attention_kernel

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
LENGTHS = (60, 384)
BANDS = (128, 256, 512)


def caches(rows: int, capacity: int, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, KV_HEADS, capacity, DIM).to(dtype), torch.randn(rows, KV_HEADS, capacity, DIM).to(dtype))
            for _ in range(LAYERS)]


def run(dtype, rows: int, rounds: int, steps: int, attend) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(LENGTHS[0], LENGTHS[1] + 1, (rows,), generator=generator)
    bands = []  # (lengths, q, per-layer caches, additive mask)
    lower = 0
    for limit in BANDS:
        members = lengths[(lengths > lower) & (lengths <= limit)]
        lower = limit
        if not len(members):
            continue
        capacity = -(-int(members.max()) // 64) * 64
        seen = (torch.arange(capacity)[None] < members[:, None])[:, None, None, :]
        q = torch.randn(len(members), 1, HEADS, DIM).to(dtype).transpose(1, 2)  # the runtime's q is a view
        bands.append((members, q, caches(len(members), capacity, dtype), batch_mask(seen, "plain", dtype)))
    q_all = torch.randn(rows, 1, HEADS, DIM).to(dtype).transpose(1, 2)
    one = caches(rows, LENGTHS[1], dtype)

    def plain():
        for layer in range(LAYERS):
            for _, q, per_layer, mask in bands:
                keys, values = per_layer[layer]
                plain_attention(q, keys, values, mask, False)

    def kernel():
        for layer in range(LAYERS):
            for members, q, per_layer, _ in bands:
                keys, values = per_layer[layer]
                attend(q, keys, values, members)

    def kernel_one():
        for layer in range(LAYERS):
            keys, values = one[layer]
            attend(q_all, keys, values, lengths)

    methods = {"plain": plain, "kernel": kernel, "kernel-one": kernel_one}
    for fn in methods.values():  # warm up: page in the caches, start the threads
        fn()
    times = {name: [] for name in methods}
    for round_ in range(rounds):
        order = list(methods) if round_ % 2 == 0 else list(reversed(methods))
        for name in order:
            for _ in range(steps):
                start = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - start)

    element = torch.tensor([], dtype=dtype).element_size()
    live = int(lengths.sum()) * KV_HEADS * DIM * element * 2 * LAYERS
    rectangle = sum(per_layer[0][0].numel() for _, _, per_layer, _ in bands) * element * 2 * LAYERS
    print(f"\n{str(dtype).removeprefix('torch.')}: {rows} rows, lengths {LENGTHS[0]}..{LENGTHS[1]} (mean "
          f"{float(lengths.float().mean()):.0f}), bands {[len(m) for m, *_ in bands]}; live K/V per step "
          f"{live / 1e6:.0f} MB, the bands' rectangles {rectangle / 1e6:.0f} MB")
    base = statistics.median(times["plain"])
    print(f"{'':12} {'ms/step':>9} {'spread':>15} {'live GB/s':>10} {'vs plain':>9}")
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:12} {median * 1e3:9.2f} {min(measured) * 1e3:7.2f}-{max(measured) * 1e3:<7.2f} "
              f"{live / median / 1e9:10.1f} {base / median:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per method in each round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()

    start = time.perf_counter()
    attend = decode_attention_kernel()
    built = time.perf_counter() - start
    if attend is None:
        raise SystemExit("the kernel did not build (see the warning above)")
    cpu = describe_cpu()
    print(f"CPU {cpu['model']} (torch kernels {cpu['capability']}, {' '.join(cpu['extensions'] or [])}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; kernel loaded in {built:.1f} s")
    copy, read = memory_bandwidth()
    print(f"memory: copy {copy:.1f} GB/s (read + written), read {read:.1f} GB/s (sum over 256 MB)")
    for name in args.dtypes.split(","):
        run(getattr(torch, name), args.rows, args.rounds, args.steps, attend)


if __name__ == "__main__":
    main()
