"""Distributed state in one place: who am I, how many are we.

Read from the launcher's environment (torchrun / the deepspeed launcher set
RANK, WORLD_SIZE, LOCAL_RANK; srun sets SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_LOCALID). Only a job step started by srun counts as several ranks: the
batch script itself also sees SLURM_NTASKS and SLURM_PROCID=0, and a command
run there directly is one process, not rank 0 of many. Passed down
explicitly as a frozen `DistInfo`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "DistInfo":
        env = dict(os.environ if env is None else env)
        if "WORLD_SIZE" in env:
            return cls(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
        if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
            return cls(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", 0)))
        return cls()


def slurm_rendezvous(env: dict[str, str]) -> tuple[str, str] | None:
    """(MASTER_ADDR, MASTER_PORT) for the tasks of an srun step, which sets neither.

    The address is the step's first node (`scontrol show hostnames`, where task 0
    runs under Slurm's default block distribution), or the node that launched
    srun when scontrol is not on the PATH; the port is derived from the job id,
    so every task of the step computes the same one.
    """
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_JOB_ID" not in env:
        return None
    address = None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist and shutil.which("scontrol"):
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        address = hosts.stdout.split()[0] if hosts.returncode == 0 and hosts.stdout.split() else None
    address = address or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not address:
        return None
    return address, str(15000 + int(env["SLURM_JOB_ID"]) % 20000)


def init_process_group(dist: DistInfo) -> bool:
    """Join the process group when several ranks run and a rendezvous address is set.

    Returns True when a group is active. gloo serves the CPU and the small
    control messages precompute needs; callers that move tensors on GPUs pick
    their own backend.
    """
    if dist.world_size <= 1 or "MASTER_ADDR" not in os.environ:
        return False
    if not torch_dist.is_initialized():
        # Ranks wait at the barrier for the slowest one's shards: allow for long runs.
        torch_dist.init_process_group("gloo", rank=dist.rank, world_size=dist.world_size,
                                      timeout=timedelta(hours=12))
    return True


def barrier() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()


def all_reduce_sum(value: float) -> float:
    """`value` summed over the ranks of the process group (a CPU tensor: precompute's group is gloo)."""
    tensor = torch.tensor([float(value)])
    torch_dist.all_reduce(tensor)
    return float(tensor.item())


SHARED_TEXT_BYTES = 255


def from_main(compute, dist: DistInfo, device: torch.device):
    """`compute()` (a short text or None) run on the main rank only and handed to every rank: what each rank would
    otherwise compute alike at a high cost (a checkpoint's fingerprint reads all its weights: 141 GB for 70B, once
    instead of once per rank). Sent as bytes in a tensor on `device` (NCCL sends only GPU tensors), nothing
    pickled. Without a process group every caller computes its own."""
    if dist.world_size <= 1 or not (torch_dist.is_available() and torch_dist.is_initialized()):
        return compute()
    buffer = torch.zeros(SHARED_TEXT_BYTES + 1, dtype=torch.uint8, device=device)
    if dist.is_main:
        text = compute()
        if text is not None:
            data = text.encode()
            if len(data) > SHARED_TEXT_BYTES:
                raise ValueError(f"from_main hands on at most {SHARED_TEXT_BYTES} bytes, not {len(data)}")
            buffer[0] = 1
            buffer[1 : 1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    torch_dist.broadcast(buffer, src=0)
    if dist.is_main:
        return text
    shared = buffer.cpu()
    return bytes(shared[1:].tolist()).rstrip(b"\0").decode() if int(shared[0]) else None


def destroy_process_group() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def pick_device(requested: str, dist: DistInfo) -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", dist.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# The package whose INFO lines a command shows; other libraries (transformers, DeepSpeed, httpx) log warnings only.
LOGGED_PACKAGE = "mtptrain"


def setup_logging(dist: DistInfo, level: int = logging.INFO) -> None:
    """One logging set-up for a whole command (the CLI calls it): this project's package logs at `level` on
    rank 0, other ranks log warnings tagged with their rank, every other library logs warnings."""
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if dist.world_size > 1:
        fmt = f"[rank {dist.rank}] " + fmt
    logging.basicConfig(level=logging.WARNING, format=fmt, datefmt="%H:%M:%S", force=True)
    logging.getLogger(LOGGED_PACKAGE).setLevel(level if dist.is_main else logging.WARNING)
