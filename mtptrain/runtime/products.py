"""The products x @ W.T (+ bias) the runtime multiplies with: each lays a plain [out, in] weight out once, in
the form it reads, and then multiplies inputs by it.

- "linear": torch's `F.linear` on the plain weight;
- "skinny": short inputs (up to SKINNY_ROWS rows) as `W @ x.T`, which on some BLAS builds keeps a product
  over a few rows near the cost of one row (measured with PyTorch 2.13 / MKL on an AVX2 machine: the
  49152 x 576 LM head of SmolLM2 takes 8.6 ms for one row, 19-28 ms for two to four rows, and 5 ms as
  `W @ x.T`);
- "packed": oneDNN's blocked layout, which spares the re-layout `F.linear` does on every call on CPU
  (measured on an AMD EPYC with avx512_bf16: a [3072, 576] bf16 product of one row in 60 us instead of
  171 us);
- "native": the runtime's own blocks of 32 output features (`Blocked`), which csrc/blocked_linear.cpp reads
  front to back, so each row gets the same result whatever rows it is computed with. A float32 weight whose
  values are all bfloat16 (a bfloat16 checkpoint, or a head saved in bfloat16, run in float32) is held in
  bfloat16 blocks and widened as it is read: the same sums bit for bit from half the bytes (measured on a
  2-core AMD EPYC Zen 3, AVX2 only, SmolLM2-135M's 121 products: 13.4 ms against 24.8 ms for one row, 17.9
  against 30.7 ms for four; benchmarks/products.py).

Which one runs is measured per machine (runtime/choice.py). The decoder's layers (runtime/weights.py), a draft
head's layer (heads/fast.py) and the linear layers of modules the runtime does not run (runtime/linears.py)
all multiply through these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mtptrain.runtime.native_kernels import BLOCK, blocked_linear_kernel, int8_linear_kernel

SKINNY_ROWS = 32  # above this many rows (a prefill) the skinny product is F.linear


@dataclass(frozen=True)
class Blocked:
    """A weight [out_features, in_features] of `dtype` in the runtime's blocked layout: blocks [G, KP, 32, P]
    with blocks[g, p, i, e] = W[32 g + i, P p + e] (zero past the weight), P = 2 inputs per step where the
    blocks hold bfloat16 and 1 where they hold float32 (csrc/blocked_linear.cpp says why). A float32 weight
    whose every value is a bfloat16 (a bfloat16 checkpoint run in float32) is held in bfloat16 blocks: the
    kernel widens them as it reads them, giving the float32 product bit for bit from half the bytes."""
    blocks: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype  # the weight's, and the inputs' it multiplies


def holds_bfloat16(weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether every value of the float32 `weight` [out, in] is a bfloat16 (so rounding it changes nothing),
    checked a run of `rows` rows at a time (no copy of the whole weight)."""
    if weight.dtype != torch.float32:
        return False
    return all(torch.equal(part, part.to(torch.bfloat16).float()) for part in weight.detach().split(rows))


def blocked(weight: torch.Tensor, narrow: bool = True) -> Blocked:
    """`weight` [out, in] laid out in blocks of BLOCK output features (a new tensor; the weight is not kept),
    in bfloat16 where it is bfloat16 or (with `narrow`) a float32 that `holds_bfloat16`."""
    out_features, in_features = weight.shape
    values = weight.detach()
    if narrow and holds_bfloat16(values):
        values = values.to(torch.bfloat16)
    step = 2 if values.dtype == torch.bfloat16 else 1
    groups, steps = -(-out_features // BLOCK), -(-in_features // step)
    padded = values.new_zeros(groups * BLOCK, steps * step)
    padded[:out_features, :in_features] = values
    blocks = padded.view(groups, BLOCK, steps, step).permute(0, 2, 1, 3).contiguous()
    return Blocked(blocks, out_features, in_features, weight.dtype)


def unblocked(weight: Blocked) -> torch.Tensor:
    """The plain [out, in] weight back from its blocks, exactly (the same values, put back in place)."""
    groups, steps, block, step = weight.blocks.shape
    plain = weight.blocks.permute(0, 2, 1, 3).reshape(groups * block, steps * step)
    return plain[: weight.out_features, : weight.in_features].to(weight.dtype).contiguous()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T computed as (W @ x.T).T for short inputs."""
    rows = x.numel() // x.shape[-1]
    if rows > SKINNY_ROWS:
        return F.linear(x, weight, bias)
    out = torch.matmul(weight, x.reshape(rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W in oneDNN's packed layout."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
    return out.reshape(*shape[:-1], out.shape[-1])


def blocked_product(x: torch.Tensor, weight: Blocked, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W in the blocked layout, by csrc/blocked_linear.cpp; where that kernel has no
    product for x (another dtype than the weight's, a GPU, a CPU without the instructions), by `F.linear` on the
    weight put back (slow: the runtime lays weights out this way only where the kernel runs)."""
    kernel = blocked_linear_kernel(x.dtype) if x.device.type == "cpu" and x.dtype == weight.dtype else None
    if kernel is None:
        return F.linear(x, unblocked(weight).to(x.dtype), bias)
    return kernel(x, weight.blocks, bias, weight.out_features)


@dataclass(frozen=True)
class Product:
    """One way to multiply: `lay_out(weight)` once, then `product(x, laid_out, bias)` per call."""
    name: str
    multiply: Callable  # (x [..., in], laid-out weight, bias or None) -> [..., out]
    lay_out: Callable = lambda weight: weight  # plain [out, in] -> the form `multiply` reads (a copy, or itself)

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        return self.multiply(x, weight, bias)


PRODUCTS = {product.name: product for product in (
    Product("linear", _linear),
    Product("skinny", _skinny),
    Product("packed", packed_product, _pack),
    Product("native", blocked_product, blocked),
)}


@dataclass(frozen=True)
class Int8Blocked:
    """A weight [out_features, in_features] quantized to int8, symmetric per output feature (W[o] ~ scales[o] q[o],
    q in [-127, 127]), in blocks [G, in_features, 32]: blocks[g, k, i] = q[32 g + i, k], zero past the weight
    (csrc/int8_linear.cpp reads them). `dtype`: the inputs' and outputs'."""
    blocks: torch.Tensor
    scales: torch.Tensor  # float32 [out_features]
    out_features: int
    in_features: int
    dtype: torch.dtype


def int8_blocked(weight: torch.Tensor) -> Int8Blocked:
    """`weight` [out, in] quantized to int8 per output feature and laid out in blocks of BLOCK features."""
    out_features, in_features = weight.shape
    values = weight.detach().float()
    largest = values.abs().amax(dim=1)
    scales = torch.where(largest > 0, largest / 127, torch.ones_like(largest))  # an all-zero row stays zero
    q = torch.round(values / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    groups = -(-out_features // BLOCK)
    padded = q.new_zeros(groups * BLOCK, in_features)
    padded[:out_features] = q
    blocks = padded.view(groups, BLOCK, in_features).permute(0, 2, 1).contiguous()
    return Int8Blocked(blocks, scales.contiguous(), out_features, in_features, weight.dtype)


def int8_dequantized(weight: Int8Blocked) -> torch.Tensor:
    """The float32 weight [out, in] an `Int8Blocked` stands for: scales[o] * q[o, k]."""
    groups, in_features, block = weight.blocks.shape
    q = weight.blocks.permute(0, 2, 1).reshape(groups * block, in_features)[: weight.out_features]
    return q.float() * weight.scales[:, None]


INT8_DTYPES = (torch.float32, torch.bfloat16)  # the inputs csrc/int8_linear.cpp multiplies


def int8_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the int8 kernel multiplies inputs of `dtype` on `device` here; where not, `int8_product` falls back
    to dequantizing the weight at every call."""
    return device.type == "cpu" and dtype in INT8_DTYPES and int8_linear_kernel() is not None


def int8_product(x: torch.Tensor, weight: Int8Blocked, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) for an int8 weight, by csrc/int8_linear.cpp; where that kernel cannot run (a GPU, a
    dtype other than float32 or bfloat16, a CPU without the instructions), by `F.linear` on the weight
    dequantized (slow: for correctness only)."""
    if not int8_native(x.device, x.dtype):
        return F.linear(x, int8_dequantized(weight).to(x.device, x.dtype), bias)
    return int8_linear_kernel()(x, weight.blocks, weight.scales, bias, weight.out_features)


# Not among PRODUCTS, which the runtime measures and picks from per machine and a cached choice may name: the
# int8 product changes the values a weight multiplies by, so only a draft head runs on it, where it is asked
# for (heads/fast.py, `HeadStepper(int8=True)`): the target's outputs, and so the tokens decoding emits, stay
# the same.
INT8 = Product("int8", int8_product, int8_blocked)

PACKABLE = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes oneDNN packs


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: float32 wherever torch has oneDNN, bfloat16 and
    float16 only where the CPU has the instructions its reduced-precision products need (AVX-512 or
    AVX-NE-CONVERT; an AVX2-only CPU refuses to pack them)."""
    if dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def products(dtype: torch.dtype) -> list[str]:
    """The products this machine can run in `dtype`: oneDNN's packed one where torch has oneDNN, the runtime's
    own ("native") where its kernels build with a product for `dtype` on this CPU."""
    names = ["linear", "skinny"]
    if packs(dtype):
        names.append("packed")
    if blocked_linear_kernel(dtype) is not None:
        names.append("native")
    return names


def usable_product(product: str, dtype: torch.dtype) -> str:
    """`product`, or for "native" where its kernel has no product for `dtype` here (a measured choice is cached,
    and the compiler may be gone since; or a dtype the choice did not measure it for) oneDNN's packed product
    (F.linear without oneDNN)."""
    if product == "native" and blocked_linear_kernel(dtype) is None:
        product = "packed"
    if product == "packed" and not packs(dtype):
        return "linear"
    return product


def runs_on(product: str, weight: torch.Tensor) -> bool:
    """`product` can multiply by `weight` where it lies: a laid-out product needs a CPU weight of a dtype it
    lays out (oneDNN's PACKABLE, the native kernel's own)."""
    if product in ("linear", "skinny"):
        return True
    if weight.device.type != "cpu":
        return False
    if product == "packed":
        return packs(weight.dtype)
    return blocked_linear_kernel(weight.dtype) is not None
