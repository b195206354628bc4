"""What this machine computes fastest, measured once and remembered.

Two choices depend on the CPU more than on anything else, so they are measured rather than assumed:

- the compute dtype: bfloat16 halves the bytes every decoding step streams, and on CPUs with bf16 matrix
  or vector units (AMX, avx512_bf16) it also multiplies fast; elsewhere (AVX2 only) torch emulates it and a
  bf16 product costs several times a float32 one;
- the product for short inputs (the 1 to 9 rows of decoding and verification): torch's `F.linear`;
  `W @ x.T`, which on some BLAS builds keeps a product over a few rows near the cost of one row
  (see mtptrain/runtime/linears.py); oneDNN with weights packed once in its own layout
  (runtime/weights.py), which spares `F.linear`'s re-layout of the weight on every call; or the runtime's own
  product ("native", csrc/blocked_linear.cpp) on weights laid out once in blocks it reads front to back,
  which gives each row the same result whatever rows it is computed with;
- the product for batches of many rows (regenerate, precompute), timed apart over 128 rows: a product that
  streams the weights best for a few rows need not multiply fastest for many (oneDNN on a CPU with AMX);
- the attention kernel for one new token and for several: torch's SDPA, or two plain products with a
  float32 softmax between them, which on some CPUs costs a third of SDPA's bf16 kernel for one query, or the
  runtime's fused kernel, reading the cache where it lies and computing each token as it computes one decoded
  alone (a tree's nodes too, each over its own ancestors: `for_mask`);
- the attention kernel of a batch of rows decoding together (regenerate): there the KV cache, not the
  weights, is most of what a step reads, and the kernel (with its cache dtype) that wins for one row can
  lose several times over for 32 (measured on an AMD EPYC: SDPA over a float32 cache 1.1 ms, two plain
  products over a bfloat16 cache 0.44 ms, for 64 rows of 256 positions).

The products are timed on the model's own shapes (its attention and MLP projections) over 1, 4 and 8
rows (and over BATCH_PRODUCT_ROWS for batches), the attention on its heads over 512 cached positions (and
over 256 for BATCH_ROWS rows); the answer is cached in `<cache_root>/runtime-choice.json` under a key naming
the CPU, torch's version, the thread count and the shapes, so each machine measures once. On a GPU nothing is measured: bfloat16 and
`F.linear`.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtptrain.io import atomic_write_json, cache_root
from mtptrain.machine import describe_cpu
from mtptrain.runtime.attention import (F32_CACHE, attention_kernels, batch_attention, batch_mask, causal_mask,
                                        row_attention)
from mtptrain.runtime.native_kernels import blocked_linear_kernel
from mtptrain.runtime.weights import LAYOUT, blocked_product, packed_product

log = logging.getLogger(__name__)

ROWS = (1, 4, 8)
BATCH_PRODUCT_ROWS = 128  # rows of the batch product's timing (regenerate, precompute)
SKINNY_ROWS = 32  # above this many rows (a prefill) every product is F.linear
BATCH_ROWS = 32  # rows of the batched-decoding attention timing
VERSION = 6  # of what is measured: a cached answer from another version is measured again


def products(dtype: torch.dtype) -> list[str]:
    """The products this machine can run in `dtype`: oneDNN's packed one where torch has oneDNN, the runtime's
    own ("native") where its kernels build with a product for `dtype` on this CPU."""
    names = ["linear", "skinny"]
    if torch.backends.mkldnn.is_available():
        names.append("packed")
    if blocked_linear_kernel(dtype) is not None:
        names.append("native")
    return names


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T computed as (W @ x.T).T for short inputs."""
    rows = x.numel() // x.shape[-1]
    if rows > SKINNY_ROWS:
        return F.linear(x, weight, bias)
    out = torch.matmul(weight, x.reshape(rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


PRODUCT = {"linear": linear, "skinny": skinny, "packed": packed_product, "native": blocked_product}


def usable_product(product: str, dtype: torch.dtype) -> str:
    """`product`, or for "native" where its kernel has no product for `dtype` here (a measured choice is cached,
    and the compiler may be gone since; or a dtype the choice did not measure it for) oneDNN's packed product
    (F.linear without oneDNN)."""
    if product == "native" and blocked_linear_kernel(dtype) is None:
        return "packed" if torch.backends.mkldnn.is_available() else "linear"
    return product


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    product: str  # a key of PRODUCT
    attention_one: str  # a key of ATTENTION, for a single new token
    attention_many: str  # for several (both read the same cache: both in F32_CACHE or neither)
    source: str  # "measured", "cached", "cuda" or "set" (target.dtype named the dtype)
    timings: dict | None = None  # dtype -> what was timed -> ms
    attention_batch: str = "sdpa"  # for one new token in each of many rows (batched decoding)
    product_batch: str = "linear"  # for batches of many rows (regenerate, precompute)

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float32 if self.attention_one in F32_CACHE else self.dtype

    @property
    def batch_cache_dtype(self) -> torch.dtype:
        return torch.float32 if self.attention_batch in F32_CACHE else self.dtype

    def describe(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')} ({self.source}), products {self.product} / "
                f"{self.product_batch} (batches), attention {self.attention_one} (1 token) / {self.attention_many} / "
                f"{self.attention_batch} (batches)")


def shapes(config) -> list[tuple[int, int]]:
    """[out, in] of one decoder layer's fused products: qkv, out, gate/up, down."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def choose(config, device: torch.device, requested: str = "auto") -> Choice:
    """The compute dtype (requested, or measured when "auto") and the short-input product for it."""
    if device.type != "cpu":
        dtype = torch.bfloat16 if requested == "auto" else getattr(torch, requested)
        return Choice(dtype, "linear", "sdpa", "sdpa", "cuda" if requested == "auto" else "set")
    timings, source = _cpu_timings(config)
    if requested == "auto":
        dtype = _faster_dtype(timings)
    else:
        dtype, source = getattr(torch, requested), "set"
    measured = timings.get(str(dtype).removeprefix("torch."))
    if measured is None:  # float16 on a CPU: not measured, torch's defaults
        return Choice(dtype, "linear", "sdpa", "sdpa", source, timings)
    fastest = lambda times: min(times, key=times.get)  # noqa: E731
    one, many = _attention_pair(measured["attention_one"], measured["attention_many"])
    return Choice(dtype, fastest(measured["products"]), one, many, source, timings,
                  fastest(measured["attention_batch"]), fastest(measured["products_batch"]))


BFLOAT16_MARGIN = 0.9  # bfloat16 is chosen where its products take at most this share of float32's time


def _faster_dtype(timings: dict) -> torch.dtype:
    """bfloat16 where its fastest product is clearly faster than float32's (by BFLOAT16_MARGIN), else float32:
    float32 rounds 2^16 times finer, so a near tie (a tiny model, whose weights sit in cache) goes to it."""
    fastest = {name: min(measured["products"].values()) for name, measured in timings.items()}
    if fastest.get("bfloat16", float("inf")) <= BFLOAT16_MARGIN * fastest["float32"]:
        return torch.bfloat16
    return torch.float32


def _attention_pair(one: dict, many: dict) -> tuple[str, str]:
    """The fastest kernels for one and for several tokens that read the same cache (float32 or the model's
    dtype), the cache chosen by their summed time."""
    pairs = []
    for f32 in (False, True):
        ones = {k: v for k, v in one.items() if (k in F32_CACHE) == f32}
        manys = {k: v for k, v in many.items() if (k in F32_CACHE) == f32}
        if ones and manys:
            a, b = min(ones, key=ones.get), min(manys, key=manys.get)
            pairs.append((ones[a] + manys[b], a, b))
    _, a, b = min(pairs)
    return a, b


def _heads(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _key(config) -> str:
    cpu = describe_cpu()
    return "|".join([f"v{VERSION}", cpu["model"], str(cpu["capability"]), ",".join(cpu["extensions"] or []),
                     torch.__version__,
                     f"threads={torch.get_num_threads()}", ";".join(f"{o}x{i}" for o, i in shapes(config)),
                     "heads=%dx%dx%d" % _heads(config)])


def _cpu_timings(config) -> tuple[dict, str]:
    """dtype name -> {"products": {product: ms}, "attention_one" / "attention_many": {kernel: ms}}; from the
    cache when this machine measured them before."""
    path = cache_root() / "runtime-choice.json"
    key = _key(config)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key], "cached"
    timings = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        timings[name] = {
            "products": {p: _time_layer(shapes(config), dtype, PRODUCT[p]) for p in products(dtype)},
            # over many rows "skinny" is F.linear ("linear"); the weights multiply from cache, as compute bounds it
            "products_batch": {p: _time_layer(shapes(config), dtype, PRODUCT[p], (BATCH_PRODUCT_ROWS,), False)
                               for p in products(dtype) if p != "skinny"},
            "attention_one": {a: _time_attention(_heads(config), dtype, a, 1) for a in attention_kernels(dtype)},
            "attention_many": {a: _time_attention(_heads(config), dtype, a, 8) for a in attention_kernels(dtype)},
            "attention_batch": {a: _time_attention(_heads(config), dtype, a, 1, BATCH_ROWS)
                                for a in attention_kernels(dtype)},
        }
    known[key] = timings
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    except OSError as exc:  # a read-only home: measured again next time
        log.warning("could not cache the runtime's measured choice in %s: %s", path, exc)
    log.info("measured this CPU's products (ms per layer, rows %s) and attention (ms, 512 positions): %s",
             "/".join(map(str, ROWS)), json.dumps(timings))
    return timings, "measured"


STREAM_BYTES = 256 << 20  # float32 weights cycled through per timing: far more than any CPU cache holds
MAX_COPIES = 64  # a tiny model's layer is not copied thousands of times (its weights stay in cache anyway)


def _time_layer(layer_shapes, dtype: torch.dtype, product, rows_timed: tuple[int, ...] = ROWS, stream: bool = True,
                repeats: int = 5) -> float:
    """Median ms of one layer's products over inputs of each of `rows_timed` rows. With `stream`, the weights
    are several copies of the layer, cycled through, so that they stream from memory as a whole model's do rather
    than sit in cache."""
    generator = torch.Generator().manual_seed(0)
    layer_bytes = 4 * sum(o * i for o, i in layer_shapes)
    if layer_bytes > STREAM_BYTES:  # a large model's layer: fewer output rows, the same inner sizes
        scale = STREAM_BYTES / layer_bytes
        layer_shapes = [(max(64, int(o * scale)), i) for o, i in layer_shapes]
        layer_bytes = 4 * sum(o * i for o, i in layer_shapes)
    copies = min(MAX_COPIES, max(1, -(-STREAM_BYTES // layer_bytes))) if stream else 1
    layouts = {packed_product: LAYOUT["packed"], blocked_product: LAYOUT["native"]}
    prepare = layouts.get(product, lambda w: w)
    weights = [[prepare((torch.randn(o, i, generator=generator) * 0.02).to(dtype)) for o, i in layer_shapes]
               for _ in range(copies)]
    inputs = {rows: [torch.randn(rows, i, generator=generator).to(dtype) for _, i in layer_shapes]
              for rows in rows_timed}

    def once() -> float:
        started = time.perf_counter()
        for rows in rows_timed:
            for layer in weights:
                for w, x in zip(layer, inputs[rows]):
                    product(x, w, None)
        return (time.perf_counter() - started) / copies

    once()  # first-call allocations, kernel selection
    return round(1000 * statistics.median(once() for _ in range(repeats)), 4)


def _time_attention(heads: tuple[int, int, int], dtype: torch.dtype, kernel: str, count: int, rows: int = 1,
                    repeats: int = 5) -> float:
    """Median ms of 20 attention calls of `count` new tokens over 512 cached positions (a cache of the kernel's
    dtype); for several rows, one token each over the first 128 to 256 of 256 positions, as batched decoding
    has them (its mask in the form the kernel reads)."""
    generator = torch.Generator().manual_seed(0)
    query_heads, kv_heads, dim = heads
    length = 512 if rows == 1 else 256
    attention = batch_attention(kernel) if rows > 1 else row_attention(kernel)
    cache = torch.float32 if kernel in F32_CACHE else dtype
    q = torch.randn(rows, query_heads, count, dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, kv_heads, length, dim, generator=generator).to(cache) for _ in range(2))
    mask, causal = None, False
    if count > 1 and kernel == "fused":  # causal after the cached positions, as the fused kernel takes it
        causal = True
    elif count > 1:
        mask = causal_mask(count, length - count)[None, None]
    elif rows > 1:  # each row sees its own first positions
        seen = torch.arange(length) < torch.randint(length // 2, length + 1, (rows, 1), generator=generator)
        mask = batch_mask(seen[:, None, None], kernel, dtype)

    def once() -> float:
        started = time.perf_counter()
        for _ in range(20):
            attention(q, k, v, mask, causal)
        return (time.perf_counter() - started) / 20

    once()
    return round(1000 * statistics.median(once() for _ in range(repeats)), 4)
