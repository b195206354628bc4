"""From how many rows the runtime's products prefetch their weights ahead: measured once per machine on the loaded
model's own verification steps, and remembered.

The blocked and int8 products (csrc/blocked_linear.cpp) can ask for a group's weights a few KB ahead of what a
pass over several rows reads. Whether that pays depends on the CPU: on a 2-core AMD EPYC Zen 5 it took SmolLM2-135M's
products over 4 rows from 5.30 to 4.84 ms; on a Zen 4 the same model's whole verification forwards of 2 to 8 tokens
ran 2-12% faster without it, and forwards of 12 or more alike. Timing the products alone (copies of a layer
streamed from memory, as runtime/choice.py times them) put the two ways within 1-5% of each other in either order
on that Zen 4, so the choice is measured where it matters: the decoder's own forwards of VERIFY_ROWS new tokens
after CONTEXT cached positions (the logits of every token, as a verification computes them), the two ways
alternating call by call (the first of each pair alternating too, so that neither way always runs after the
other), each pair giving the ratio of its two times. A control times one-token forwards the same way, where the
two ways run the very same instructions (one-row passes never prefetch): its median ratio must come out within
CONTROL_TOLERANCE of 1, else the machine was too noisy to choose and the default stays.

The rule: passes of up to 4 rows stop prefetching where the 4-token forwards ran at most NO_PREFETCH_BELOW of
their time without it, and then passes of up to 8 rows too where the 8-token forwards did; passes of more rows
(a batch's 12-row passes, the 11 rows of a 10-node tree) keep it; a draft head's products run with the setting
its target's forward left. The answer is `prefetch_from`, the fewest rows of a pass that prefetches: 2
(every pass of several rows, the kernel's default), 5 or 9. It changes no product's result, only its speed.

Cached in `<cache_root>/runtime-prefetch.json` under runtime/choice.py's machine key and the model's dtype and
product, checked before use as that cache is; a measurement while other processes kept more than MAX_OTHER_LOAD
cores busy serves its process only, and where they were busy before it began (LOAD_PROBE_S) nothing is timed: the
default serves that process. Models whose weights are under MIN_WEIGHT_BYTES sit in the caches (nothing
streams from memory): they keep the default without a measurement. A first load measures within LOAD_BUDGET_S
seconds of forwards (about 4.5 s for SmolLM2-135M); a model too slow for MIN_PAIRS pairs in that time keeps the
default until `mtptrain measure` times it with a longer budget. A measurement that fails (a model whose forwards
refuse the timed context) keeps the default, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from typing import Iterator

import torch

from mtptrain.io import cache_root, read_machine_cache, store_machine_cache
from mtptrain.machine import cpu_sample, other_load
from mtptrain.runtime.cache import KVCache, NoCache
from mtptrain.runtime.choice import MAX_OTHER_LOAD, machine_key, measuring_alone
from mtptrain.runtime.native_kernels import prefetch_from_kernel, prefetching_from

log = logging.getLogger(__name__)

DEFAULT_FROM = 2  # the kernel's own default: every pass of several rows prefetches
NEVER = 13  # above the kernel's largest pass (12 rows): no pass prefetches
CHOICES = (2, 5, 9)  # what the rule can answer
CONTROL_ROWS = 1
VERIFY_ROWS = (4, 8)  # a chain of 3's verification; a tree's (or a longer chain's)
NO_PREFETCH_BELOW = 0.98  # none / ahead at most this: the rows stop prefetching
CONTROL_TOLERANCE = 0.03
CONTEXT = 256  # cached positions before the timed forwards
PAIRS = 40  # per row count, at most
WARM_UP = 3  # pairs of each row count before those timed
MIN_PAIRS = 12
LOAD_BUDGET_S = 6.0
MEASURE_BUDGET_S = 120.0  # `mtptrain measure`
MIN_WEIGHT_BYTES = 64 << 20
LOAD_PROBE_S = 0.3  # how long the cores are watched before timing: a busy machine is not timed at all
VERSION = 1  # of the timing and the rule: a cached answer of another version is measured again

# key -> the rows this process settled on outside the cache (measured under load, or too noisy to choose)
_SETTLED: dict[tuple[str, str], int] = {}


def cache_path():
    return cache_root() / "runtime-prefetch.json"


def _slot(key: str) -> tuple[str, str]:
    """Where `_SETTLED` keeps this process's answer for `key` (per cache file: a test or a run may move it)."""
    return str(cache_path()), key


def decoder_key(decoder) -> str:
    return "|".join([machine_key(decoder.config), str(decoder.dtype).removeprefix("torch."), decoder.product,
                     f"prefetch-v{VERSION}"])


def weight_bytes(decoder) -> int:
    tensors = [decoder.lm_head, *(t for layer in decoder.layers for t in vars(layer).values())]
    return sum(_bytes(t) for t in tensors)


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if hasattr(value, "__dict__"):  # a laid-out weight (products.Blocked): its tensors
        return sum(_bytes(v) for v in vars(value).values())
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    return 0


def applies(decoder) -> bool:
    """Whether `decoder`'s forwards run the product whose prefetch this module sets: the runtime's own, on a CPU
    (a target never runs the int8 product)."""
    return decoder.device.type == "cpu" and decoder.product == "native" and prefetch_from_kernel() is not None


def prefetch_from(decoder) -> int:
    """The fewest rows of a pass that prefetches for `decoder`'s batch-1 forwards (decoding and verification):
    what this process settled on, else cached, else measured now (DEFAULT_FROM for a model in the caches or too
    slow to time at load)."""
    if not applies(decoder) or weight_bytes(decoder) < MIN_WEIGHT_BYTES:
        return DEFAULT_FROM
    key = decoder_key(decoder)
    if _slot(key) in _SETTLED:
        return _SETTLED[_slot(key)]
    known = _read_cache(cache_path())
    if key in known:
        return known[key]["from"]
    with measuring_alone():
        known = _read_cache(cache_path(), quiet=True)
        if key in known:
            return known[key]["from"]
        try:
            return measure(decoder, LOAD_BUDGET_S)[0]
        except Exception as exc:  # speed only: the default serves where it cannot be timed
            log.warning("the products' prefetch keeps its default (from %d rows): timing it failed (%s: %s)",
                        DEFAULT_FROM, type(exc).__name__, exc)
            _SETTLED[_slot(key)] = DEFAULT_FROM
            return DEFAULT_FROM


def invalid_entry(entry: object) -> str | None:
    """Why a cached entry cannot be used, or None."""
    if not isinstance(entry, dict):
        return "not an object"
    rows = entry.get("from")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows not in CHOICES:
        return f"from {rows!r} is not one of {', '.join(map(str, CHOICES))}"
    ratios = entry.get("ratios")
    if not isinstance(ratios, dict) or set(ratios) != {str(r) for r in (CONTROL_ROWS, *VERIFY_ROWS)}:
        return "ratios are not an object of the timed row counts"
    for value in ratios.values():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return f"ratio {value!r} is not a positive number"
    return None


def _read_cache(path, quiet: bool = False) -> dict:
    """The entries that validate; the others dropped with one warning (measured again)."""
    return read_machine_cache(path, invalid_entry, "the products' prefetch is", log, quiet)


def rule(ratios: dict[int, float]) -> int | None:
    """The fewest rows of a pass that prefetches, from each timed row count's median ratio (none / ahead); None
    where the control says the timings cannot be trusted."""
    if abs(ratios[CONTROL_ROWS] - 1) > CONTROL_TOLERANCE:
        return None
    start = DEFAULT_FROM
    for rows in VERIFY_ROWS:
        if ratios[rows] > NO_PREFETCH_BELOW:
            break
        start = rows + 1
    return start


@torch.inference_mode()
def time_pairs(decoder, rows_timed, pairs: int) -> dict[int, dict[str, list[float]]]:
    """rows -> {"ahead", "none": seconds, "ratios": none / ahead} of each of `pairs` pairs of `decoder`'s forwards
    of that many new tokens after CONTEXT cached positions, prefetching from 2 rows (ahead) and never (NEVER); the
    pairs of all row counts interleaved, and each pair's first way alternating."""
    with prefetching_from(DEFAULT_FROM), decoder_prefetching(decoder, decoder.prefetch_from):  # both as found after
        return _pairs(decoder, rows_timed, pairs)


def _pairs(decoder, rows_timed, pairs: int) -> dict[int, dict[str, list[float]]]:
    vocab = decoder.embed.shape[0]
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(decoder.num_layers, 1, decoder.kv_heads, decoder.head_dim, CONTEXT + max(rows_timed),
                    decoder.cache_dtype, decoder.device)
    decoder.forward(torch.randint(vocab, (1, CONTEXT), generator=generator), torch.arange(CONTEXT)[None], cache, 0,
                    None, logits=False)
    cache.length = CONTEXT
    tokens = {rows: torch.randint(vocab, (1, rows), generator=generator) for rows in rows_timed}
    positions = {rows: torch.arange(CONTEXT, CONTEXT + rows)[None] for rows in rows_timed}

    def forward(rows: int, start: int) -> float:
        decoder.prefetch_from = start
        began = time.perf_counter()
        decoder.forward(tokens[rows], positions[rows], cache, CONTEXT, None)
        return time.perf_counter() - began

    timed = {rows: {"ahead": [], "none": [], "ratios": []} for rows in rows_timed}
    for _ in range(WARM_UP):  # first calls: allocations, and the caches and the clock settling
        for rows in rows_timed:
            forward(rows, DEFAULT_FROM), forward(rows, NEVER)
    for pair in range(pairs):
        for rows in rows_timed:
            if pair % 2 == 0:
                ahead, none = forward(rows, DEFAULT_FROM), forward(rows, NEVER)
            else:
                none, ahead = forward(rows, NEVER), forward(rows, DEFAULT_FROM)
            for name, value in (("ahead", ahead), ("none", none), ("ratios", none / ahead)):
                timed[rows][name].append(value)
    return timed


@contextlib.contextmanager
def decoder_prefetching(decoder, start: int | None) -> Iterator[None]:
    """`decoder`'s forwards prefetch from `start` rows within the block (None: they leave the kernel's setting
    alone), and as they did after."""
    kept = decoder.prefetch_from
    decoder.prefetch_from = start
    try:
        yield
    finally:
        decoder.prefetch_from = kept


def measure(decoder, budget_s: float = MEASURE_BUDGET_S) -> tuple[int, str]:
    """Time `decoder`'s forwards both ways (`time_pairs`) within about `budget_s` seconds and choose (`rule`);
    cached unless other processes kept the cores busy meanwhile. Returns the rows and how they were settled:
    "measured", "measured under load", "busy" (other processes kept the cores busy before it began: the default,
    not timed), "noisy" (the control's ratio off 1: the default, not cached), "too slow" (fewer than MIN_PAIRS
    pairs fit the budget: the default, not cached) or "not measured: <why>" (nothing to choose: the default)."""
    if not applies(decoder):
        return DEFAULT_FROM, "not measured: the model's products are not the runtime's own on a CPU"
    if weight_bytes(decoder) < MIN_WEIGHT_BYTES:
        return DEFAULT_FROM, "not measured: the model's weights sit in the CPU's caches"
    key = decoder_key(decoder)
    rows_timed = (CONTROL_ROWS, *VERIFY_ROWS)
    per_pair = 2 * len(rows_timed) * 1.25 * _one_token_seconds(decoder)  # a few tokens cost a little more than one
    pairs = min(PAIRS, int(budget_s / per_pair) - WARM_UP)
    if pairs < MIN_PAIRS:
        log.info("the products' prefetch keeps its default (from %d rows): %d pairs of forwards would take %.0f s; "
                 "`mtptrain measure` times them with a longer budget", DEFAULT_FROM, MIN_PAIRS, MIN_PAIRS * per_pair)
        _SETTLED[_slot(key)] = DEFAULT_FROM
        return DEFAULT_FROM, "too slow"
    busy = _busy()
    if busy is not None and busy > MAX_OTHER_LOAD:
        log.info("the products' prefetch keeps its default (from %d rows) in this process: other processes keep "
                 "%.2f cores busy, and it is timed when the target loads on a quiet machine", DEFAULT_FROM, busy)
        _SETTLED[_slot(key)] = DEFAULT_FROM
        return DEFAULT_FROM, "busy"
    before = cpu_sample()
    ratios = {rows: statistics.median(t["ratios"]) for rows, t in time_pairs(decoder, rows_timed, pairs).items()}
    load = other_load(before, cpu_sample())
    chosen = rule(ratios)
    shown = ", ".join(f"{rows} rows {ratio:.3f}" for rows, ratio in ratios.items())
    if chosen is None:
        log.warning("the products' prefetch keeps its default (from %d rows): forwards that run the same "
                    "instructions both ways differed by %.1f%% (none / ahead: %s); run `mtptrain measure` on a quiet "
                    "machine", DEFAULT_FROM, 100 * abs(ratios[CONTROL_ROWS] - 1), shown)
        _SETTLED[_slot(key)] = DEFAULT_FROM
        return DEFAULT_FROM, "noisy"
    log.info("measured the products' prefetch on the model's forwards (none / ahead, medians of %d pairs: %s): "
             "passes of %s prefetch", pairs, shown, describe(chosen))
    if load is not None and load > MAX_OTHER_LOAD:
        log.warning("the products' prefetch was timed while other processes kept %.2f cores busy: this choice serves "
                    "this run only and is not cached", load)
        _SETTLED[_slot(key)] = chosen
        return chosen, "measured under load"
    _SETTLED.pop(_slot(key), None)
    _store(key, {"from": chosen, "ratios": {str(rows): round(r, 4) for rows, r in ratios.items()}, "pairs": pairs,
                 "other_load": load, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return chosen, "measured"


def _busy() -> float | None:
    """Cores other processes keep busy over LOAD_PROBE_S (None where /proc/stat is not there)."""
    before = cpu_sample()
    time.sleep(LOAD_PROBE_S)
    return other_load(before, cpu_sample())


@torch.inference_mode()
def _one_token_seconds(decoder) -> float:
    """A one-token forward's seconds (the second of two), which streams every weight once."""
    ids, positions = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    with prefetching_from(DEFAULT_FROM):  # as found after
        for _ in range(2):
            began = time.perf_counter()
            decoder.forward(ids, positions, NoCache(), 0, None)
        return time.perf_counter() - began


def describe(rows: int) -> str:
    return "2 or more rows" if rows == DEFAULT_FROM else f"{rows} or more rows"


def _store(key: str, entry: dict) -> None:
    store_machine_cache(cache_path(), key, entry, invalid_entry, "the products' measured prefetch", log)
