"""The sentences that say how an eval run was measured (target, machine, CPU, prompts, sampling): eval's report
and an export's README both print them."""

from __future__ import annotations


def run_line(results: dict) -> str:
    """Two sentences: target and machine (the CPU named with its extensions), then prompts and sampling."""
    s, machine = results["settings"], results["machine"]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}"
    gpu = f"{machine['gpu']}, " if machine.get("gpu") else ""
    runtime = f", {machine['runtime']}" if machine.get("runtime") else ""
    return (f"Target `{results['target']}` on {machine['device']} ({gpu}{machine['dtype']}, {machine['threads']} "
            f"threads{runtime}), CPU {cpu_text(machine)}. Prompts: `{s['prompts']}`, {s['prompt_count']} prompts, "
            f"{s['requests']} requests, up to {s['max_new_tokens']} new tokens each, {sampling}, batch size 1.")


def cpu_text(machine: dict) -> str:
    """'AMD EPYC (2 logical cores; torch kernels AVX512; avx2 avx512f)'; results written before the CPU was
    described carry only platform.processor()."""
    details = []
    if machine.get("logical_cores"):
        details.append(f"{machine['logical_cores']} logical cores")
    if machine.get("cpu_capability"):
        details.append(f"torch kernels {machine['cpu_capability']}")
    if "cpu_extensions" in machine:
        extensions = machine["cpu_extensions"]
        details.append("extensions unknown" if extensions is None else
                       " ".join(extensions) if extensions else "none of AVX2/AVX-512/AMX/NEON/SVE")
    return machine["cpu"] + (f" ({'; '.join(details)})" if details else "")
