"""CPU kernels of the runtime written in C++ (csrc/), built on first use with torch's JIT extension loader.

- `decode_attention_kernel()`, `causal_attention_kernel()`, `tree_attention_kernel()` and
  `step_attention_kernel()` (csrc/decode_attention.cpp): attention for
  batched decoding, where each row attends over its own number of cached positions. `attention.plain_attention`
  runs two `torch.matmul`s over the rows' rectangle with a mask, reading every row's masked tail too; the
  kernel reads only each row's live keys and values, once. Measured on a 2-core AMD EPYC (avx512_bf16) with
  SmolLM2-135M's heads, 128 rows of 60..384 positions in the runtime's length bands, one 30-layer step
  (benchmarks/decode_attention.py): bfloat16 64 ms -> 32 ms (20 GB/s of live keys and values), float32
  116 ms -> 54 ms (24 GB/s), against a copy at 34 GB/s; fetching each row's keys and values ahead of their
  use then took bfloat16 from 33.7 to 25.0 ms. The step kernel also writes the step's keys and
  values and takes the prompt chunks riding along with the step, so a band's whole attention is one call.
- `layer_ops()` (csrc/layer_ops.cpp): a decoder layer's elementwise steps (residual sum and RMSNorm, silu
  times up, the rotary embedding), one pass each.
- `blocked_linear_kernel(dtype)` (csrc/blocked_linear.cpp): a linear layer's product from its weight laid
  out in blocks of 32 output features (runtime/products.py), at the memory's speed for a few rows and near the
  CPU's peak for hundreds; each row's result is the same whatever rows it is computed with.
- `int8_linear_kernel()` (csrc/int8_linear.cpp): the same from int8 weights with a scale per output feature,
  for a draft head that opts in (half the bytes a drafting step reads).
- `prefetch_from_kernel()`: from how many rows both products prefetch their weights ahead (runtime/prefetch.py).

The first call builds them (about 12 s on a 2-core AMD EPYC Zen 5; one INFO line says so and where), later
processes load them from `<cache_root>/kernels/` once the .so is the very file its build recorded (size and
sha256): a damaged one (truncated, overwritten) is rebuilt after one warning instead of crashing the process that
loads it. Where the build fails (no compiler, no ninja) it logs one warning and every function returns None:
callers keep torch's operations.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import platform
import sysconfig
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch

from mtptrain.io import atomic_write_json, cache_root, load_json, sha256_file
from mtptrain.machine import cpu_flags, holding

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# One translation unit that includes the three sources (torch's headers parsed once: 28 s of compiling on a 2-core
# AMD EPYC against 73 s for three units, and only the headers of torch_api.h: 11.7 s against 21.8 on a Zen 5);
# decode_attention.cpp holds the module's bindings.
SOURCES = [CSRC / "kernels.cpp"]
# included by it: part of what the build's name hashes
HEADERS = [CSRC / "decode_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "blocked_linear.cpp", CSRC / "int8_linear.cpp",
           CSRC / "float_math.h", CSRC / "torch_api.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
BLOCK = 32  # output features per block of the blocked layout (csrc/blocked_linear.cpp, GROUP)


def extension_name(sources: list[Path] | None = None) -> str:
    """The extension's module name, unique to the files it is built from (SOURCES and HEADERS by default),
    torch's version, Python's ABI, the CPU and the flags: a -march=native binary built on one CPU may not run on
    another, a module built for one Python does not import in another, and the cache directory may be shared by
    machines and environments of each."""
    sources = SOURCES + HEADERS if sources is None else sources
    digest = hashlib.sha256()
    cpu = cpu_flags() or platform.processor()  # what -march=native sees
    abi = sysconfig.get_config_var("EXT_SUFFIX") or platform.python_version()  # .cpython-311-x86_64-linux-gnu.so
    parts = [source.read_bytes() for source in sources]
    for part in (*parts, torch.__version__.encode(), abi.encode(), cpu.encode(), " ".join(CFLAGS).encode()):
        digest.update(hashlib.sha256(part).digest())
    return f"mtptrain_{sources[0].stem}_{digest.hexdigest()[:12]}"


def _reason(error: Exception) -> str:
    """The compiler's error lines where a build failed (torch's message holds the whole build log), else the
    exception's message, in a few hundred characters."""
    text = str(error)
    errors = [line.strip() for line in text.splitlines() if "error:" in line]  # the compiler's own lines
    reason = " | ".join(errors[:3]) if errors else " ".join(text.split())
    return f"{type(error).__name__}: {reason[:500]}"


@contextlib.contextmanager
def _only_builder(build: Path) -> Iterator[None]:
    """Hold `build` alone while torch's loader builds or loads the extension there.

    The loader marks a build with a `lock` file and waits, without end, for it to vanish. A process killed
    mid-build (a job cancelled during the first call's compile) leaves it behind, and every later run would
    hang. So processes first take an flock on a file of their own, which the kernel releases when its holder
    dies; whoever holds it is the only one in the loader, and a `lock` it finds is stale: removed."""
    with open(build / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build of the decode attention kernel that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _record(library: Path) -> Path:
    """Where the size and sha256 of `library` are kept when its build made it: `<name>.sha256.json` beside it."""
    return library.with_suffix(".sha256.json")


def _fingerprint(library: Path) -> dict:
    return {"file": library.name, "size": library.stat().st_size, "sha256": sha256_file(library)}


def _mismatch(library: Path) -> str | None:
    """Why `library` is not the file its build recorded (its record missing or unreadable, its size or its
    sha256 other), or None when it is. The record may be damaged or hostile like the library: any content is
    read as a mismatch, never as an error."""
    record = _record(library)
    try:
        recorded = load_json(record.read_text())
    except FileNotFoundError:
        return f"it has no record of its build ({record.name})"
    except (OSError, ValueError):  # ValueError: bytes that are not UTF-8 or not JSON
        return f"the record of its build ({record.name}) is unreadable"
    if not isinstance(recorded, dict):
        return f"the record of its build ({record.name}) holds no object"
    size = library.stat().st_size
    if recorded.get("size") != size:
        return f"it holds {size} bytes, not the size its build recorded in {record.name}"
    if recorded.get("sha256") != sha256_file(library):
        return f"its sha256 is not the one its build recorded in {record.name}"
    return None


def _clear(build: Path, name: str) -> None:
    """Remove what a build left in `build`, so that the next one compiles every source again.

    ninja judges by times: a .so damaged after its build is newer than its sources and counts as up to date,
    and objects damaged with it would be linked again. The flock file and torch's `lock` stay."""
    outputs = [build / f"{name}.so", _record(build / f"{name}.so"), build / "build.ninja",
               build / ".ninja_log", build / ".ninja_deps", *build.glob("*.o")]
    for output in outputs:
        output.unlink(missing_ok=True)


def _import(name: str, library: Path):
    """The module in `library`, imported as torch's loader imports the extensions it builds."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, sources: list[Path], build: Path, cflags: list[str], ldflags: list[str]):
    """Compile the extension from scratch in `build`, record its .so's size and sha256, and return its module."""
    # torch.utils.cpp_extension takes 0.12 s to import (measured): only a build needs it
    from torch.utils.cpp_extension import load

    _clear(build, name)
    log.info("compiling %s for this CPU, once (the runtime's kernels take about 12 s on 2 cores), in %s",
             ", ".join(s.name for s in sources), build)
    module = load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags, extra_ldflags=ldflags,
                  build_directory=str(build), verbose=False)
    library = build / f"{name}.so"
    atomic_write_json(_record(library), _fingerprint(library))
    return module


def _load_verified(name: str, sources: list[Path], build: Path, cflags: list[str], ldflags: list[str]):
    """The extension `name` from `sources`: its .so in `build` where that is the very file its build recorded,
    else built there afresh, after one warning saying why where a .so was there.

    A truncated .so makes the process that loads it die of a bus error, one overwritten of a segmentation
    fault: nothing that can be caught, and torch's loader would load it (ninja sees it newer than its sources).
    So the check comes before anything opens the file, and a verified file is imported without ninja, which
    could otherwise rebuild it unannounced (sources touched, another environment's paths in build.ninja)."""
    library = build / f"{name}.so"
    with _only_builder(build):
        if library.is_file():
            problem = _mismatch(library)
            if problem is None:
                return _import(name, library)
            log.warning("%s is not loaded: %s, and a truncated or overwritten library crashes the process that "
                        "loads it. It is rebuilt from its sources now (about 12 s for the runtime's kernels on 2 "
                        "cores)", library, problem)
        return _build(name, sources, build, cflags, ldflags)


def _built(hashed: list[Path], sources: list[Path]):
    """The extension compiled from `sources`, named after the files `hashed` (`extension_name`), loaded from
    `<cache_root>/kernels/<name>` where verified, else built there."""
    name = extension_name(hashed)  # reads the files: a wheel built without csrc/ fails here, not at import
    build = cache_root() / "kernels" / name
    build.mkdir(parents=True, exist_ok=True)
    return _load_verified(name, sources, build, CFLAGS, ["-fopenmp"])


@functools.cache
def extension():
    """The built extension, or None (one warning logged) when it does not build."""
    try:
        return _built(SOURCES + HEADERS, SOURCES)
    except Exception as error:  # no source, compiler, ninja, or an import failure: the caller falls back
        log.warning("the runtime's CPU kernels (%s) did not build, torch's operations stay in use: %s",
                    ", ".join(s.name for s in SOURCES), _reason(error))
        return None


def extension_at(csrc: Path):
    """The kernels built from another copy of csrc/ (`benchmarks/products.py --kernels-at`: a change's before and
    after in one process), built and verified like the project's own, by the name of their own files' contents
    (the project's own name where the files are the same); None (one warning logged) where they do not build."""
    sources = [csrc / source.name for source in SOURCES]
    named = [csrc / header.name for header in HEADERS if (csrc / header.name).is_file()]
    others = sorted(p for p in csrc.iterdir() if p.is_file() and p not in sources + named)
    try:
        return _built(sources + named + others, sources)
    except Exception as error:  # as extension(): the caller says what it cannot time
        log.warning("the kernels in %s did not build: %s", csrc, _reason(error))
        return None


def decode_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`attend(q, keys, values, lengths) -> out`, or None when the extension does not build.

    q [R, H, 1, D] (any strides), keys and values [Rcap >= R, Hkv, C, D] in q's dtype (float32 or bfloat16) with
    strides [*, *, D, 1], the same for both (a cache, or a view of its first C positions), lengths an int64 CPU
    tensor [R] with 1 <= lengths[r] <= C: row r's query head h attends over positions 0 .. lengths[r]-1 of kv
    head h // (H // Hkv) with softmax(q.k * D**-0.5), accumulated in float32.
    Returns [R, H, 1, D] contiguous in q's dtype. Built once per process (and per machine: cached under
    `<cache_root>/kernels/`)."""
    module = extension()
    return None if module is None else module.decode_attention


def causal_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`causal(q, keys, values) -> out`, or None when the extension does not build: one row's T new tokens q
    [T, H, D] (any strides) over keys and values [1, Hkv, S, D] (strides [*, *, D, 1]: the cache's first S
    positions, the new ones last), token t attending positions 0 .. S - T + t; out [T, H, D]. Each token is
    computed exactly as `decode_attention_kernel` computes a row alone."""
    module = extension()
    return None if module is None else module.causal_attention


def tree_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """`tree(q, keys, values, lengths, gather, gathered) -> out`, or None when the extension does not build: a
    verified tree's T nodes q [T, H, D] (any strides) over keys and values [1, Hkv, S, D] (strides [*, *, D, 1]:
    the cache's first S - T positions, then the nodes). Node t attends over the first lengths[t] - c positions
    and then the c positions gathered[gather[t] : gather[t + 1]] (int64 CPU tensors: lengths [T], gather
    [T + 1] from 0, gathered its ancestors and itself in order of depth); out [T, H, D]. Each node is computed
    exactly as `decode_attention_kernel` computes a row holding that sequence."""
    module = extension()
    return None if module is None else module.tree_attention


def step_attention_kernel() -> Callable[..., None] | None:
    """`step(q, k_new, v_new, keys, values, tokens, rows, positions, out)`, or None when the extension does not
    build: one length band's part of a batched decoding step (runtime/batch.py), in one call.

    The step's N tokens come as q [N, H, D], k_new and v_new [N, Hkv, D] (any strides); the band's entries m
    (int64 CPU tensors of M entries) name a token, the band's cache row it belongs to, and its position there.
    Each entry's key and value are written into keys and values [Rcap, Hkv, C, D] (contiguous) at that row and
    position; then each attends over its row's positions 0 .. positions[m], as `decode_attention_kernel` does,
    into out[tokens[m]] (out [N, H, D], unit stride along D). A row's several entries at consecutive positions
    (a prompt chunk) thus attend causally among themselves."""
    module = extension()
    return None if module is None else module.step_attention


@functools.cache  # asked on every product call: the answer does not change within a process
def blocked_linear_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """`blocked_linear(x, blocks, bias, out_features) -> x @ W.T + bias` for x of `dtype`, or None where the
    extension does not build or has no product for `dtype` on this CPU (bfloat16 needs avx512_bf16, float32
    AVX-512 or AVX2 with FMA).

    blocks is W [out_features, in] in the blocked layout of `products.blocked`, x [..., in] of any number of
    rows, bias [out_features] or None. Each output element is one float32 sum over the inputs in order, rounded
    once to x's dtype: a row's result does not depend on the other rows computed with it."""
    module = extension()
    if module is None or dtype not in (torch.float32, torch.bfloat16) or \
            not module.blocked_supports(dtype == torch.bfloat16):
        return None
    return module.blocked_linear


def prefetch_from_kernel() -> Callable[[int], None] | None:
    """`blocked_prefetch_from(rows)`: the blocked and int8 products' passes over at least `rows` (>= 2) rows
    prefetch their weights ahead, fewer do not (csrc/blocked_linear.cpp says why it depends on the CPU;
    runtime/prefetch.py measures it); None where the extension does not build. Process-wide: it changes no
    product's result, only its speed."""
    module = extension()
    return None if module is None else module.blocked_prefetch_from


def prefetching_from(rows: int) -> ContextManager[None]:
    """Passes of at least `rows` rows prefetch within the block (`prefetch_from_kernel`), whatever a decoder set
    before; the setting found is restored after. Nothing where the extension does not build."""
    module = extension()
    if module is None:
        return contextlib.nullcontext()
    return holding(module.blocked_prefetching_from, module.blocked_prefetch_from, rows)


@functools.cache
def int8_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """`int8_linear(x, blocks, scales, bias, out_features) -> x @ (scales[:, None] * q).T + bias` for x of float32
    or bfloat16, or None where the extension does not build or has no int8 product on this CPU (it needs AVX-512,
    or AVX2 with FMA).

    blocks are int8 weights q [out_features, in] in the layout of `products.int8_blocked`, scales float32
    [out_features]. Each output element is one float32 sum over the inputs in order, times its scale, + bias,
    rounded once to x's dtype."""
    module = extension()
    return None if module is None or not module.int8_supports() else module.int8_linear


@functools.cache
def argmax_kernel() -> Callable[[torch.Tensor], list[int]] | None:
    """`argmax_rows(x) -> [index per row]` for x [..., V] of float32 or bfloat16 on the CPU: each row's first
    maximum, -1 for a row holding a NaN (where torch's argmax takes the NaN); None where the extension does not
    build or has no argmax here (it needs AVX-512)."""
    module = extension()
    return None if module is None or not module.argmax_supported() else module.argmax_rows


def layer_ops():
    """The module whose `add_rms_norm`, `silu_mul` and `rope` fuse a decoder layer's elementwise steps
    (csrc/layer_ops.cpp; runtime/model.py says when they run), or None when the extension does not build."""
    return extension()
