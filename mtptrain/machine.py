"""The machine a measurement ran on: which CPU, with which vector and matrix extensions, and how busy other
processes kept it.

A speedup measured on one CPU says little about another: the kernels torch picks (AVX2, AVX-512, AMX, NEON,
SVE) change what a short verification forward costs. And a timing taken while other processes compete for the
cores is not a property of the method at all. Both are recorded next to the numbers.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

# Extensions that change which CPU kernels torch can use, as /proc/cpuinfo spells them (x86 "flags", ARM
# "Features"; ARM calls NEON asimd).
EXTENSIONS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
              "asimd", "sve", "sve2", "bf16", "i8mm")
PROC = Path("/proc")


def describe_cpu(proc: Path = PROC) -> dict:
    """The CPU's model name (with its x86 family and model numbers where /proc/cpuinfo gives them: a cloud VM
    may name two CPU generations alike, e.g. "AMD EPYC" for family 25 and 26), torch's kernel level for it, the
    extensions of EXTENSIONS it has (None where /proc/cpuinfo cannot say) and its logical core count."""
    fields = _first_processor(proc / "cpuinfo")
    flags = _flags(fields)
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        model = f"{model} (family {fields['cpu family']}, model {fields['model']})"
    return {
        "model": model,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "extensions": None if flags is None else [e for e in EXTENSIONS if e in set(flags.split())],
        "logical_cores": os.cpu_count(),
    }


def cpu_line(cpu: dict | None = None) -> str:
    """The CPU as a benchmark names it beside its numbers: model, logical cores, torch's kernel level and the
    extensions that decide the runtime's choices."""
    cpu = cpu or describe_cpu()
    return (f"CPU {cpu['model']} ({cpu['logical_cores']} logical cores, torch kernels {cpu['capability']}, "
            f"{' '.join(cpu['extensions'] or [])})")


def memory_bandwidth(device: torch.device = torch.device("cpu"), repeats: int = 9) -> tuple[float, float]:
    """GB/s of `device`'s memory, the best of `repeats` (the most each gave): a copy of 256 MiB (bytes read plus
    bytes written) and a sum over the same 256 MiB (bytes read, as a decoding step reads its weights)."""
    src = torch.ones(64 << 20, device=device)  # float32
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / best(lambda: dst.copy_(src)) / 1e9, nbytes / best(src.sum) / 1e9


def cpu_flags(proc: Path = PROC) -> str | None:
    """The CPU's whole flags line of /proc/cpuinfo (x86 "flags", ARM "Features"); None where it cannot say."""
    return _flags(_first_processor(proc / "cpuinfo"))


def _flags(fields: dict[str, str]) -> str | None:
    return fields.get("flags", fields.get("features"))


def _first_processor(path: Path) -> dict[str, str]:
    """'key: value' lines of the first processor block of /proc/cpuinfo, keys lower-cased ({} if absent)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.perf_counter()
    busy: float | None  # CPU seconds every core of the machine spent busy since boot; None without /proc/stat
    own: float  # CPU seconds of this process, its reaped children and its live descendants


def cpu_sample(proc: Path = PROC) -> CpuSample:
    return CpuSample(time.perf_counter(), _machine_busy(proc), _own_cpu(proc))


def other_load(start: CpuSample, end: CpuSample) -> float | None:
    """Cores that other processes (and the hypervisor, as steal time) kept busy on average between two samples;
    None where the machine's busy time is unknown."""
    if start.busy is None or end.busy is None or end.wall <= start.wall:
        return None
    # /proc/stat counts in clock ticks (10 ms): a quiet machine can come out a hair below zero.
    return max(0.0, ((end.busy - start.busy) - (end.own - start.own)) / (end.wall - start.wall))


def _machine_busy(proc: Path) -> float | None:
    """user + nice + system + irq + softirq + steal of the 'cpu' line of /proc/stat, in seconds. Guest time is
    already inside user, and steal is included because it is time the cores were not ours."""
    try:
        first = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu" or len(first) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu(proc: Path) -> float:
    """RUSAGE_CHILDREN counts a child only once it has been reaped, so live descendants (an ssd drafter's
    worker) are read from /proc."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total + sum(_process_cpu(proc, pid) for pid in _descendants(proc, os.getpid()))


def _descendants(proc: Path, root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in proc.glob("[0-9]*/stat"):
        try:
            ppid = int(entry.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while the directory was read
        parents.setdefault(ppid, []).append(int(entry.parent.name))
    found, queue = [], [root]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found


def _process_cpu(proc: Path, pid: int) -> float:
    """utime + stime of a process and of the children it has reaped, in seconds (0 once it is gone)."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # After the command name comes field 3 of proc(5), state; utime, stime, cutime and cstime are fields 14-17.
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


T = TypeVar("T")


@contextmanager
def holding(get: Callable[[], T], put: Callable[[T], None], value: T | None) -> Iterator[None]:
    """A process-wide setting (read by `get`, written by `put`: torch's CPU threads, the products' prefetch) at
    `value` within the block, and as it was found after; None leaves it as it is."""
    if value is None:
        yield
        return
    found = get()
    put(value)
    try:
        yield
    finally:
        put(found)
