"""A helper of the micro benchmarks (argmax.py, rms_norm.py), not a benchmark: ways of one operation timed call
by call, interleaved, warm and cold."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def warm_and_cold(ways: dict[str, Callable[[], object]], inputs: torch.Tensor, flush: torch.Tensor,
                  repeats: int) -> dict[tuple[str, bool], float]:
    """(way, cold) -> the median µs of `repeats` calls of each way, the ways taking turns: warm (the inputs just
    used) and cold (after `flush`, far more memory than the caches hold, was written, as after a target forward,
    and then `inputs` written again, as the operation before writes them)."""
    times: dict[tuple[str, bool], list[float]] = {(name, cold): [] for name in ways for cold in (False, True)}
    for _ in range(repeats):
        for cold in (False, True):
            for name, way in ways.items():
                if cold:
                    flush.add_(1.0)
                    inputs.add_(0)
                start = time.perf_counter()
                way()
                times[(name, cold)].append(time.perf_counter() - start)
    return {key: statistics.median(values) * 1e6 for key, values in times.items()}


def table_row(label: object, us: dict[tuple[str, bool], float], digits: int, ratio_digits: int) -> str:
    """| label | torch, warm | kernel, warm | ratio | torch, cold | kernel, cold | ratio | of `warm_and_cold`'s
    timings of the ways "torch" and "kernel"."""
    cells = []
    for cold in (False, True):
        torch_us, kernel_us = us[("torch", cold)], us[("kernel", cold)]
        ratio = torch_us / kernel_us
        cells += [f"{torch_us:.{digits}f} µs", f"{kernel_us:.{digits}f} µs", f"{ratio:.{ratio_digits}f}x"]
    return f"| {label} | " + " | ".join(cells) + " |"
