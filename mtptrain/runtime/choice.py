"""What this machine computes fastest, measured once and remembered.

Two choices depend on the CPU more than on anything else, so they are measured rather than assumed:

- the compute dtype: bfloat16 halves the bytes every decoding step streams, and on CPUs with bf16 matrix
  or vector units (AMX, avx512_bf16) it also multiplies fast; elsewhere (AVX2 only) torch emulates it and a
  bf16 product costs several times a float32 one;
- the product for short inputs (the 1 to 9 rows of decoding and verification): torch's `F.linear`;
  `W @ x.T`, which on some BLAS builds keeps a product over a few rows near the cost of one row
  (see runtime/products.py); oneDNN with weights packed once in its own layout, which spares `F.linear`'s
  re-layout of the weight on every call; or the runtime's own
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
the CPU, torch's version, the thread count, the shapes and the runtime's C++ kernels as built (their
sources among what names the build), so each machine measures once, and again when a kernel changes. On a GPU nothing is
measured: bfloat16 and `F.linear`.

The cache is a file anyone can edit, and a measurement is only as good as the machine was quiet:
- every entry is checked before use (known kernels, positive timings); one that does not validate is dropped
  with one warning and measured again;
- a measurement taken while other processes kept more than MAX_OTHER_LOAD cores busy is used by that process
  only, never cached (a choice measured under load once made every later run three times slower);
- `mtptrain measure` measures again on demand;
- the ranks of a process group use rank 0's timings (`agree`): what a feature store or a checkpoint holds must
  not depend on which rank computed it, nor on how each rank's own measurement came out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.distributed as torch_dist

from mtptrain.io import cache_root, read_machine_cache, store_machine_cache
from mtptrain.machine import cpu_sample, describe_cpu, other_load
from mtptrain.runtime.attention import (ATTENTION, F32_CACHE, attention_kernels, batch_attention, batch_mask,
                                        causal_mask, row_attention, usable)
from mtptrain.runtime.native_kernels import extension_name, prefetching_from
from mtptrain.runtime.products import PRODUCTS, Product, products, usable_product

log = logging.getLogger(__name__)

ROWS = (1, 4, 8)
BATCH_PRODUCT_ROWS = 128  # rows of the batch product's timing (regenerate, precompute)
BATCH_ROWS = 32  # rows of the batched-decoding attention timing
VERSION = 7  # of what is measured: a cached answer from another version is measured again
MAX_OTHER_LOAD = 0.25  # cores other processes may keep busy during a measurement that is cached


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    product: str  # a key of runtime/products.py's PRODUCTS
    attention_one: str  # a key of ATTENTION, for a single new token
    attention_many: str  # for several (both read the same cache: both in F32_CACHE or neither)
    source: str  # "measured", "cached", "cuda" or "set" (target.dtype named the dtype)
    timings: dict | None = None  # dtype -> what was timed -> ms
    attention_batch: str = "sdpa"  # for one new token in each of many rows (batched decoding)
    product_batch: str = "linear"  # for batches of many rows (regenerate, precompute)
    fallback: str = ""  # what runs in place of a measured kernel that does not build here any more

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float32 if self.attention_one in F32_CACHE else self.dtype

    @property
    def batch_cache_dtype(self) -> torch.dtype:
        return torch.float32 if self.attention_batch in F32_CACHE else self.dtype

    def describe(self) -> str:
        fallback = f"; {self.fallback}" if self.fallback else ""
        return (f"{str(self.dtype).removeprefix('torch.')} ({self.source}), products {self.product} / "
                f"{self.product_batch} (batches), attention {self.attention_one} (1 token) / {self.attention_many} / "
                f"{self.attention_batch} (batches){fallback}")

    def record(self) -> dict:
        """What a store, a checkpoint or a head records of the runtime that computed it."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "product": self.product,
                "product_batch": self.product_batch, "attention_one": self.attention_one,
                "attention_many": self.attention_many, "attention_batch": self.attention_batch}

    @classmethod
    def from_record(cls, record: object) -> "Choice":
        """The choice a store, a checkpoint or a regeneration recorded (`record`), to compute with the same kernels
        again, each replaced where it does not build here (`runnable`). A record is read from a file: anything but
        known kernels and dtypes raises ValueError, naming what is wrong."""
        names = {"product": PRODUCTS, "product_batch": PRODUCTS, "attention_one": SECTIONS["attention_one"],
                 "attention_many": SECTIONS["attention_many"], "attention_batch": SECTIONS["attention_batch"]}
        if not isinstance(record, dict) or set(record) != {"dtype", *names}:
            raise ValueError(f"not a runtime record (dtype and {', '.join(names)})")
        if not isinstance(record["dtype"], str) or record["dtype"] not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {record['dtype']!r} is not float32, bfloat16 or float16")
        for name, known in names.items():
            if not isinstance(record[name], str) or record[name] not in known:
                raise ValueError(f"{name} {record[name]!r} is not one of {', '.join(known)}")
        if (record["attention_one"] in F32_CACHE) != (record["attention_many"] in F32_CACHE):
            raise ValueError("attention_one and attention_many read caches of different dtypes")
        kernels = {name: record[name] for name in names}
        return cls(getattr(torch, record["dtype"]), source="recorded", **kernels).runnable()

    def runnable(self) -> "Choice":
        """This choice with each kernel that does not build here (a cached choice names the runtime's own kernels,
        and the compiler may be gone since) replaced by what runs in its place, and `fallback` saying so: reports
        name what ran, not what was measured."""
        products = {name: usable_product(getattr(self, name), self.dtype) for name in ("product", "product_batch")}
        attention = {name: usable(getattr(self, name))
                     for name in ("attention_one", "attention_many", "attention_batch")}
        changed = {name: kernel for name, kernel in {**products, **attention}.items() if kernel != getattr(self, name)}
        if not changed:
            return self
        note = ("the runtime's C++ kernels did not build here: " +
                ", ".join(f"{name} {getattr(self, name)} runs as {kernel}" for name, kernel in changed.items()))
        return replace(self, **changed, fallback=note)


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
                  fastest(measured["attention_batch"]), fastest(measured["products_batch"])).runnable()


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


def _kernels_build() -> str:
    """The runtime's C++ kernels as built here (their sources, torch, the CPU and the flags: `extension_name`),
    so that timings of other kernels are measured again; "none" where their sources are missing."""
    try:
        return extension_name()
    except OSError:
        return "none"


def machine_key(config) -> str:
    cpu = describe_cpu()
    return "|".join([f"v{VERSION}", cpu["model"], str(cpu["capability"]), ",".join(cpu["extensions"] or []),
                     torch.__version__,
                     f"threads={torch.get_num_threads()}", ";".join(f"{o}x{i}" for o, i in shapes(config)),
                     "heads=%dx%dx%d" % _heads(config), f"kernels={_kernels_build()}"])


SECTIONS = {"products": PRODUCTS, "products_batch": PRODUCTS, "attention_one": (*ATTENTION, "fused"),
            "attention_many": (*ATTENTION, "fused"), "attention_batch": (*ATTENTION, "fused")}
# (cache file, key) -> (timings, source) this process settled on outside the cache: agreed with rank 0, or
# measured under load
_SETTLED: dict[tuple[str, str], tuple[dict, str]] = {}


def cache_path():
    return cache_root() / "runtime-choice.json"


def invalid_timings(timings: object) -> str | None:
    """Why `timings` (one machine's entry: dtype name -> section -> kernel -> ms) cannot be used, or None."""
    if not isinstance(timings, dict) or set(timings) != {"float32", "bfloat16"}:
        return "not an object of float32 and bfloat16 timings"
    for dtype, sections in timings.items():
        if not isinstance(sections, dict) or set(sections) != set(SECTIONS):
            return f"{dtype}: not an object of the sections {', '.join(SECTIONS)}"
        for section, kernels in sections.items():
            if not isinstance(kernels, dict) or not kernels:
                return f"{dtype}.{section}: no kernels"
            for kernel, ms in kernels.items():
                if kernel not in SECTIONS[section]:
                    return f"{dtype}.{section}: unknown kernel {kernel!r}"
                if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
                    return f"{dtype}.{section}.{kernel}: {ms!r} is not a positive time"
    return None


def _entry_problem(entry: object) -> str | None:
    return invalid_timings(entry.get("timings") if isinstance(entry, dict) else None)


def _read_cache(path, quiet: bool = False) -> dict:
    """The cached entries of this VERSION that validate; the others dropped with one warning (measured again)."""
    return read_machine_cache(path, _entry_problem, "this machine's runtime choices are", log, quiet,
                              keep=lambda key: key.startswith(f"v{VERSION}|"))  # other versions: stale


def _cpu_timings(config) -> tuple[dict, str]:
    """dtype name -> {"products": {product: ms}, "attention_one" / "attention_many": {kernel: ms}, ...}; what
    this process settled on before, else from the cache when this machine measured them before, else measured."""
    key = machine_key(config)
    if (str(cache_path()), key) in _SETTLED:
        return _SETTLED[str(cache_path()), key]
    known = _read_cache(cache_path())
    if key in known:
        return known[key]["timings"], "cached"
    with measuring_alone():
        known = _read_cache(cache_path(), quiet=True)  # a process that held the lock before may have measured
        if key in known:
            return known[key]["timings"], "cached"
        return measure(config)


@contextlib.contextmanager
def measuring_alone() -> Iterator[None]:
    """One process of this machine measures at a time (an flock beside the cache, released if its holder dies):
    ranks started together without a process group would otherwise each time the kernels while the others
    load the cores, cache nothing, and may choose differently. The others wait idle, then read its answer."""
    lock = cache_path().with_name("runtime-choice.lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        guard = open(lock, "a")
    except OSError:  # a read-only cache: each process measures, as nothing is cached anyway
        yield
        return
    with guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def measure(config) -> tuple[dict, str]:
    """Time every kernel on `config`'s shapes; cache the timings unless other processes kept more than
    MAX_OTHER_LOAD cores busy meanwhile (then they serve this process only, and one warning says so)."""
    key = machine_key(config)
    before = cpu_sample()
    timings = _measure_kernels(config)
    load = other_load(before, cpu_sample())
    log.info("measured this CPU's products (ms per layer, rows %s) and attention (ms, 512 positions): %s",
             "/".join(map(str, ROWS)), json.dumps(timings))
    if load is not None and load > MAX_OTHER_LOAD:
        log.warning("the runtime's kernels were timed while other processes kept %.2f cores busy: this choice "
                    "serves this run only and is not cached; run `mtptrain measure` on a quiet machine", load)
        _SETTLED[str(cache_path()), key] = timings, "measured under load"
        return timings, "measured under load"
    _SETTLED.pop((str(cache_path()), key), None)  # a quiet measurement replaces one taken under load
    _store(key, {"timings": timings, "other_load": load,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return timings, "measured"


def _store(key: str, entry: dict) -> None:
    store_machine_cache(cache_path(), key, entry, _entry_problem, "the runtime's measured choice", log,
                        keep=lambda known: known.startswith(f"v{VERSION}|"))  # other versions' entries dropped


def agree(config, device: torch.device) -> None:
    """Every rank of the process group (where one is up, on a CPU) takes rank 0's timings, so that all ranks run
    one dtype and one set of kernels: a store's shards, or a checkpoint's ranks, must not depend on which rank
    computed them. Collective: every rank calls it at the same point. The timings travel as JSON and are checked
    as the cache's are."""
    if device.type != "cpu" or not torch_dist.is_available() or not torch_dist.is_initialized() or \
            torch_dist.get_world_size() < 2:
        return
    rank = torch_dist.get_rank()
    data = json.dumps(_cpu_timings(config)).encode() if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    torch_dist.broadcast(size, src=0)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else \
        torch.empty(int(size), dtype=torch.uint8)
    torch_dist.broadcast(buffer, src=0)
    timings, source = json.loads(buffer.numpy().tobytes().decode())
    why = invalid_timings(timings)
    if why is not None:
        raise RuntimeError(f"rank 0 sent runtime timings that do not validate: {why}")
    _SETTLED[str(cache_path()), machine_key(config)] = timings, source if rank == 0 else f"{source} by rank 0"


def _measure_kernels(config) -> dict:
    with prefetching_from(2):  # the kernel's default, whatever a decoder of this process set (runtime/prefetch.py)
        return _measured_kernels(config)


def _measured_kernels(config) -> dict:
    timings = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        timings[name] = {
            "products": {p: _time_layer(shapes(config), dtype, PRODUCTS[p]) for p in products(dtype)},
            # over many rows "skinny" is F.linear ("linear"); the weights multiply from cache, as compute bounds it
            "products_batch": {p: _time_layer(shapes(config), dtype, PRODUCTS[p], (BATCH_PRODUCT_ROWS,), False)
                               for p in products(dtype) if p != "skinny"},
            "attention_one": {a: _time_attention(_heads(config), dtype, a, 1) for a in attention_kernels(dtype)},
            "attention_many": {a: _time_attention(_heads(config), dtype, a, 8) for a in attention_kernels(dtype)},
            "attention_batch": {a: _time_attention(_heads(config), dtype, a, 1, BATCH_ROWS)
                                for a in attention_kernels(dtype)},
        }
    return timings


STREAM_BYTES = 256 << 20  # float32 weights cycled through per timing: far more than any CPU cache holds
MAX_COPIES = 64  # a tiny model's layer is not copied thousands of times (its weights stay in cache anyway)


def _time_layer(layer_shapes, dtype: torch.dtype, product: Product, rows_timed: tuple[int, ...] = ROWS, stream: bool = True,
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
    weights = [[product.lay_out((torch.randn(o, i, generator=generator) * 0.02).to(dtype)) for o, i in layer_shapes]
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
