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
from mtptrain.runtime.native_kernels import (blocked_linear_kernel, causal_attention_kernel, decode_attention_kernel,
                                             tree_attention_kernel)
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


def causal_mask(count: int, past: int = 0, device=None) -> torch.Tensor:
    """[count, past + count], True where new token i may look: everything before it and new tokens 0..i."""
    return torch.ones(count, past + count, dtype=torch.bool, device=device).tril(past)


def sdpa_attention(q, k, v, mask, causal: bool):
    """q [B, H, T, D], k and v [B, Hkv, S, D]; mask [B, 1, T, S] (True = seen) or None."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def plain_attention(q, k, v, mask, causal: bool):
    """The same as two products with a float32 softmax between them; each key-value head serves its group of
    query heads (head h reads kv head h // group), without repeating the keys. `mask` is boolean (True = seen)
    or float32 and added to the scores (0 = seen, -inf = not: `batch_mask`)."""
    batch, heads, count, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group * count, dim), k.transpose(-1, -2)).float()
    scores = scores.mul_(dim ** -0.5).view(batch, kv_heads, group, count, length)
    if causal:
        mask = causal_mask(count, length - count, q.device)[None, None]
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    elif mask is not None:
        scores = scores.add_(mask[:, :, None])
    weights = torch.softmax(scores.view(batch, kv_heads, group * count, length), dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(batch, heads, count, dim)


def _in_float32(attention):
    """The kernel over a float32 KV cache: queries (and keys and values not yet float32) cast up, the output
    cast back. In bfloat16 this keeps the cache twice as large and the attention products in float32, which
    some CPUs run several times faster for the few rows of a decoding step."""
    def attend(q, k, v, mask, causal: bool):
        return attention(q.float(), k.float(), v.float(), mask, causal).to(q.dtype)
    return attend


def batch_mask(seen: torch.Tensor, kernel: str | None, dtype: torch.dtype) -> torch.Tensor:
    """A batched step's boolean mask [B, 1, 1, S] (True = seen; each row sees a prefix of the positions) as
    `kernel` reads it fastest when one mask serves every layer of a step:
    - the fused kernel takes each row's number of seen positions (an int64 tensor [B]) and reads nothing else;
    - plain products add a float32 mask to their float32 scores in place (measured on an AMD EPYC, 64 rows of
      320 positions over 30 layers: 29.9 ms against 33.6 ms for a boolean mask filled in on every layer);
    - SDPA takes it in its queries' dtype (float32 for the kernels over a float32 cache)."""
    if kernel is None:
        return seen
    if usable(kernel) == "fused":
        return seen.reshape(seen.shape[0], -1).sum(-1)
    dtype = dtype if kernel == "sdpa" else torch.float32
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def fused_attention(q, k, v, lengths, causal: bool):
    """Batched decoding's attention in one C++ kernel (runtime/native_kernels.py): q [R, H, 1, D], k and v
    [>= R, Hkv, C, D] contiguous, row r attending over its first lengths[r] positions only."""
    return decode_attention_kernel()(q, k, v, lengths)


def _fits_kernel(q, k, v) -> bool:
    """q [1, H, T, D] and k, v [1, Hkv, S, D] as the fused row kernels read them: one row on the CPU, float32 or
    bfloat16 throughout, each head's positions D apart."""
    return q.shape[0] == 1 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and \
        k.dtype == q.dtype == v.dtype and k.stride(3) == 1 and k.stride(2) == q.shape[-1] and k.stride() == v.stride()


def fused_row(q, k, v, mask, causal: bool):
    """A row's new tokens, q [1, H, T, D], over k and v [1, Hkv, S, D] (the cache's first S positions, the T new
    ones last, as the cache hands them out) in the fused C++ kernel, which reads them in place; token t attends
    positions 0 .. S - T + t. Every token is computed as one decoded alone is, so a chain's verification gives
    each token the output a one-token step gives it. Anything else (a mask, unless `for_mask` made a tree of it;
    several rows: a batched prefill; keys laid out otherwise; another dtype or device) goes to torch's kernels:
    two plain products for one token, SDPA for several (its flash kernel for a long prefill)."""
    kernel = causal_attention_kernel()
    count, length = q.shape[2], k.shape[2]
    if kernel is None or mask is not None or (count > 1 and not causal) or not _fits_kernel(q, k, v):
        if count == 1:
            return plain_attention(q, k, v, mask, causal)
        if causal and length > count:  # SDPA's is_causal aligns the queries with the first keys, not the last
            mask, causal = causal_mask(count, length - count, q.device)[None, None], False
        return sdpa_attention(q, k, v, mask, causal)
    return kernel(q[0].transpose(0, 1), k, v).transpose(0, 1)[None]


fused_row.causal_after_cache = True  # `causal` holds with cached positions before the new tokens too


def tree_plan(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The tree kernel's (lengths [T], gather [T + 1], gathered) for a mask [1, 1, T, S] (True = seen) whose
    rows see every cached position (the first S - T) and some of the T new ones: each new token's sequence is
    the cache, then the new positions it sees in their order, those right after the cache folded into it
    (a chain's are all). None for any other mask."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return None
    count, length = mask.shape[2], mask.shape[3]
    past = length - count
    if past < 0 or not bool(mask[0, 0, :, :past].all()):
        return None
    seen = mask[0, 0, :, past:].cpu()
    sizes = seen.sum(1)
    if past == 0 and bool((sizes == 0).any()):
        return None
    lead = seen.cumprod(1).sum(1)  # new positions seen right after the cache: part of the contiguous run
    rest = seen.clone()
    rest[torch.arange(count)[None, :] < lead[:, None]] = False
    rows, columns = rest.nonzero(as_tuple=True)
    gather = torch.zeros(count + 1, dtype=torch.int64)
    gather[1:] = torch.bincount(rows, minlength=count).cumsum(0)
    return (past + sizes).to(torch.int64), gather, (columns + past).to(torch.int64)


def for_mask(attention, mask: torch.Tensor | None):
    """`attention` for one forward under `mask`: the fused row kernel turns a tree's mask into each node's
    ancestors once (`tree_plan`) and attends each node over the cache and them as a token decoded after that
    path is computed (bit for bit the same), rather than through SDPA under the mask; anything else as it was."""
    if attention is not fused_row or mask is None:
        return attention
    kernel = tree_attention_kernel()
    plan = None if kernel is None else tree_plan(mask)
    if plan is None:
        return attention

    def tree_row(q, k, v, mask, causal: bool):
        if q.shape[2] != plan[0].shape[0] or k.shape[2] != mask.shape[-1] or not _fits_kernel(q, k, v):
            return fused_row(q, k, v, mask, causal)
        return kernel(q[0].transpose(0, 1), k, v, *plan).transpose(0, 1)[None]

    return tree_row


ATTENTION = {"sdpa": sdpa_attention, "plain": plain_attention,
             "sdpa-f32": _in_float32(sdpa_attention), "plain-f32": _in_float32(plain_attention)}
F32_CACHE = ("sdpa-f32", "plain-f32")  # kernels that read a float32 cache


def row_attention(kernel: str):
    """The kernel named `kernel` for a row's new tokens: a key of ATTENTION, or "fused" (whose work falls to the
    plain products where the fused kernel no longer builds: a measured choice is cached, and the compiler may be
    gone since)."""
    return fused_row if kernel == "fused" else ATTENTION[kernel]


def attention_kernels(dtype: torch.dtype) -> list[str]:
    """The attention kernels measured in `dtype`, for a row's new tokens and for batched decoding alike: torch's
    (those of a float32 cache only below float32), and the fused ones where the runtime's extension builds here,
    for float32 and bfloat16 (the plain kernels serve float64)."""
    kernels = [a for a in ATTENTION if dtype != torch.float32 or a not in F32_CACHE]
    if dtype in (torch.float32, torch.bfloat16) and decode_attention_kernel() is not None:
        kernels.append("fused")
    return kernels


def usable(kernel: str) -> str:
    """`kernel`, or "plain" for "fused" where the fused kernel does not build (a machine's measured choice is
    cached, and its compiler may be gone since)."""
    return "plain" if kernel == "fused" and decode_attention_kernel() is None else kernel


def batch_attention(kernel: str):
    """The batch kernel named `kernel` (a key of ATTENTION, or "fused"), as `usable` allows."""
    kernel = usable(kernel)
    return fused_attention if kernel == "fused" else ATTENTION[kernel]


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
