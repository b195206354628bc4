"""The GPU check's environment part (scripts/gpu_check.py), and what every part asks of the machine: whether it
runs on CUDA, on the CPU as a dry run's substitute, or not at all."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False); --dry-run runs a CPU substitute"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_without_cuda(args) -> dict | None:
    """{"not_run": why} for a GPU run on a machine without CUDA; None when the part runs (on CUDA, or dry)."""
    return None if args.dry_run or gpu_count() else {"not_run": NO_CUDA}


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def check_environment(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    details = {
        "device": device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl_version(),
        "gpus": [gpu(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "flash_attn": module_version("flash_attn"),
        "transformers": module_version("transformers")["version"],
        "deepspeed": deepspeed_ops(),
        "nvcc": nvcc(),
    }
    details["checks"] = {"torch and DeepSpeed import": details["deepspeed"]["error"] is None}
    if cuda:
        details["checks"].update({"CUDA devices visible": bool(details["gpus"]),
                                  "NCCL present": details["nccl"][0].isdigit()})
    else:
        details["cpu_substitute"] = "none needed: the same checks, on a machine without CUDA" if args.dry_run else None
    gpus = ", ".join(f"{g['name']} {g['memory_gib']} GiB" for g in details["gpus"]) or "no GPU"
    details["headline"] = (f"torch {details['torch']} (CUDA {details['torch_cuda']}), {gpus}, flash-attn "
                           f"{details['flash_attn']['version'] or 'absent'}, DeepSpeed "
                           f"{details['deepspeed']['version']}, nvcc {'yes' if details['nvcc']['path'] else 'no'}")
    return details


def gpu(index: int) -> dict:
    import torch

    props = torch.cuda.get_device_properties(index)
    return {"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}


def nccl_version() -> str:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 -- a CPU build has no NCCL: say what it answered
        return f"unavailable ({type(exc).__name__}: {exc})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def module_version(name: str) -> dict:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 -- flash-attn built for another torch fails in many ways
        return {"importable": False, "version": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"importable": True, "version": getattr(module, "__version__", "unknown"), "error": None}


def deepspeed_ops() -> dict:
    """DeepSpeed's version, the ops its wheel was built with (installed_ops) and which of its op builders say
    they can be built here (is_compatible: headers, compiler and CUDA version), for this machine's accelerator."""
    try:
        import deepspeed
        from deepspeed.git_version_info import installed_ops, torch_info
        from deepspeed.ops.op_builder.all_ops import ALL_OPS, accelerator_name
    except Exception as exc:  # noqa: BLE001
        return {"version": None, "error": f"{type(exc).__name__}: {exc}", "installed_ops": {}, "compatible": {}}
    compatible = {}
    for name, builder in sorted(ALL_OPS.items()):
        try:
            compatible[name] = bool(builder.is_compatible(verbose=False))
        except Exception as exc:  # noqa: BLE001 -- a builder that cannot even ask is recorded as such
            compatible[name] = f"{type(exc).__name__}: {exc}"[:300]
    return {"version": deepspeed.__version__, "error": None, "accelerator": accelerator_name,
            "installed_ops": dict(installed_ops), "built_with": dict(torch_info), "compatible": compatible}


def nvcc() -> dict:
    from torch.utils.cpp_extension import CUDA_HOME

    path = shutil.which("nvcc")
    version = None
    if path:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (done.stdout.strip().splitlines() or [""])[-1]
    return {"path": path, "version": version, "CUDA_HOME": os.environ.get("CUDA_HOME"),
            "torch_cuda_home": CUDA_HOME}
