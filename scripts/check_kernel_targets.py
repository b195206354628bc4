"""Build the runtime's C++ kernels (mtptrain/runtime/csrc/) for other x86 targets than this CPU's and check them.

    python scripts/check_kernel_targets.py [--march haswell,skylake-avx512]

The runtime builds its kernels with -march=native, so the tests only ever run the code paths of the machine
they run on. This builds the same sources for each target named (each must be one this CPU can run: a subset
of its instruction sets) and checks, on every build:

  decode_attention   against float64 softmax attention, float32 and bfloat16, head dims 64, 128 (the AVX-512
                     path) and 80 (the portable one), groups of 1 to 8 query heads per key-value head
  causal_attention   each token of a chain bit for bit what decode_attention gives it over its prefix
  tree_attention     each node of a tree bit for bit what decode_attention gives it over its path
  blocked_linear     against float64 sums, and each row the same bit for bit whatever rows share the call
                     (float32 on every target; bfloat16 where the target has avx512_bf16)
  int8_linear        against float64 sums over the dequantized weight, float32 and bfloat16 inputs, and each
                     row the same bit for bit whatever rows share the call
  argmax_rows        torch's first maximum per row (ties, tails of every length), where the target has AVX-512;
                     elsewhere the build says it has none

haswell stands for the AVX2-only CPUs (the portable attention, the AVX2 product), skylake-avx512 for AVX-512
without bfloat16. Each build takes about 12 s on a 2-core Zen 5. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "mtptrain" / "runtime" / "csrc"
SOURCES = ["kernels.cpp"]  # the runtime's one translation unit (it includes the three sources)
TREE_PARENTS = [-1, -1, 0, 0, 2, 1, 4]  # a draft tree of 7 nodes: 8 tokens with the pending one
ATTENTION_SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 80), (16, 2, 64)]  # heads, kv heads, head dim


def build(march: str, directory: Path):
    from torch.utils.cpp_extension import load

    name = "mtptrain_check_" + march.replace("-", "_")
    return load(name, [str(CSRC / s) for s in SOURCES], extra_cflags=["-O3", f"-march={march}", "-fopenmp"],
                extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)


def check_attention(module, dtype) -> list[str]:
    from mtptrain.engine.tree import DraftTree
    from mtptrain.runtime.attention import tree_plan

    failures = []
    g = torch.Generator().manual_seed(0)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for heads, kv_heads, dim in ATTENTION_SHAPES:
        where = f"{str(dtype).removeprefix('torch.')} heads {heads}/{kv_heads} dim {dim}"
        rows, capacity = 6, 300
        q = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
        keys, values = (torch.randn(rows, kv_heads, capacity, dim, generator=g).to(dtype) for _ in range(2))
        lengths = torch.randint(1, capacity + 1, (rows,), generator=g)
        out = module.decode_attention(q, keys, values, lengths)
        for r, n in enumerate(lengths.tolist()):
            k = keys[r, :, :n].double().repeat_interleave(heads // kv_heads, 0)
            v = values[r, :, :n].double().repeat_interleave(heads // kv_heads, 0)
            exact = torch.softmax(q[r].double() @ k.transpose(-1, -2) * dim ** -0.5, -1) @ v
            error = float((out[r].double() - exact).abs().max())
            if error > bound:
                failures.append(f"decode_attention {where}: row {r} off by {error:.2e} (bound {bound:.0e})")
        # a chain of 6 tokens after 41 positions, and a tree of 8 after 37: each token as decoded alone
        chain = torch.randn(6, heads, dim, generator=g).to(dtype)
        k, v = keys[:1, :, :47], values[:1, :, :47]
        together = module.causal_attention(chain, k, v)
        for t in range(6):
            alone = module.decode_attention(chain[t][None, :, None], k, v, torch.tensor([42 + t]))
            if not torch.equal(together[t], alone[0, :, 0]):
                failures.append(f"causal_attention {where}: token {t} differs from its one-token step")
        past, seen = 37, DraftTree([0] * len(TREE_PARENTS), TREE_PARENTS).visibility()
        count = len(seen)
        mask = torch.cat([torch.ones(count, past, dtype=torch.bool), seen], dim=1)[None, None]  # as forward_tree
        nodes = torch.randn(count, heads, dim, generator=g).to(dtype)
        k, v = keys[:1, :, :past + count], values[:1, :, :past + count]
        tree = module.tree_attention(nodes, k, v, *tree_plan(mask))
        for node in range(count):
            path = mask[0, 0, node].nonzero().flatten().tolist()  # the cache, then the node's path
            alone = module.decode_attention(nodes[node][None, :, None], k[:, :, path].contiguous(),
                                            v[:, :, path].contiguous(), torch.tensor([len(path)]))
            if not torch.equal(tree[node], alone[0, :, 0]):
                failures.append(f"tree_attention {where}: node {node} differs from decoding its path")
    return failures


def check_product(module, dtype) -> list[str]:
    from mtptrain.runtime.products import blocked

    failures = []
    g = torch.Generator().manual_seed(1)
    where = str(dtype).removeprefix("torch.")
    for out_features, in_features in [(250, 576), (96, 1536), (33, 7)]:
        w = torch.randn(out_features, in_features, generator=g).to(dtype)
        x = torch.randn(40, in_features, generator=g).to(dtype)
        layout = blocked(w)
        together = module.blocked_linear(x, layout.blocks, None, out_features)
        exact = x.double() @ w.double().T
        scale = float((x.double().abs() @ w.double().abs().T).max())
        if dtype == torch.float32:
            ok = float((together.double() - exact).abs().max()) < 1e-6 * scale
        else:
            ok = bool(((together.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * scale).all())
        if not ok:
            failures.append(f"blocked_linear {where} {out_features}x{in_features}: off the float64 sums")
        for rows in (1, 2, 7, 8, 9, 12, 13, 17, 25):
            if not torch.equal(module.blocked_linear(x[:rows], layout.blocks, None, out_features), together[:rows]):
                failures.append(f"blocked_linear {where} {out_features}x{in_features}: {rows} rows differ from "
                                "the same rows among 40")
    return failures


def check_int8(module) -> list[str]:
    from mtptrain.runtime.products import int8_blocked, int8_dequantized

    failures = []
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        where = str(dtype).removeprefix("torch.")
        for out_features, in_features in [(250, 576), (33, 7)]:
            q = int8_blocked(torch.randn(out_features, in_features, generator=g))
            x = torch.randn(40, in_features, generator=g).to(dtype)
            together = module.int8_linear(x, q.blocks, q.scales, None, out_features)
            w = int8_dequantized(q).double()
            exact = x.double() @ w.T
            scale = float((x.double().abs() @ w.abs().T).max())
            if not bool(((together.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * scale).all()):
                failures.append(f"int8_linear {where} {out_features}x{in_features}: off the float64 sums")
            for rows in (1, 2, 9, 13):
                if not torch.equal(module.int8_linear(x[:rows], q.blocks, q.scales, None, out_features),
                                   together[:rows]):
                    failures.append(f"int8_linear {where} {out_features}x{in_features}: {rows} rows differ")
    return failures


def check_argmax(module) -> list[str]:
    failures = []
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for length in (1, 15, 16, 17, 49152):
            x = (torch.randn(4, length, generator=g) * 2).round().to(dtype)  # ties: the first maximum must win
            if module.argmax_rows(x) != x.float().argmax(-1).tolist():
                failures.append(f"argmax_rows {str(dtype).removeprefix('torch.')} length {length}: not torch's")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--march", default="haswell,skylake-avx512",
                        help="comma-separated GCC -march targets, each one this CPU can run")
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for march in args.march.split(","):
            directory = Path(tmp) / march
            directory.mkdir()
            print(f"{march}: building ...", flush=True)
            module = build(march, directory)
            failures = []
            for dtype in (torch.float32, torch.bfloat16):
                failures += check_attention(module, dtype)
            failures += check_product(module, torch.float32)
            if module.blocked_supports(True):
                failures += check_product(module, torch.bfloat16)
            failures += check_int8(module)
            if module.argmax_supported():
                failures += check_argmax(module)
            products = "float32 and bfloat16" if module.blocked_supports(True) else "float32 only"
            argmax = "argmax checked" if module.argmax_supported() else "no argmax in this build (torch's serves)"
            if failures:
                failed = True
                print(f"{march}: {len(failures)} checks FAILED")
                for failure in failures:
                    print(f"  {failure}")
            else:
                print(f"{march}: attention (float32, bfloat16; decode, chain, tree), products ({products}) and "
                      f"the int8 product checked; {argmax}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
