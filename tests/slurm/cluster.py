"""A real single-node Slurm cluster for the tests: Debian's munge, slurmctld and slurmd, started in a temporary
directory with a generated slurm.conf, and stopped afterwards.

Installed with apt-get when missing (seconds); where that is impossible the tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def install() -> str | None:
    """None when the daemons are there (installing them if needed), else why they cannot be."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed, and apt-get cannot install it here (needs root and apt-get)"
    done = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], capture_output=True, text=True,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if done.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 2
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "LocalSlurm":
        munge = self.root / "munge"
        for d in (munge, self.root / "state", self.root / "spool", self.root / "log"):
            d.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)  # munged refuses a socket directory others can write to
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.socket"
        self._spawn(["munged", "-F", "--force", f"--key-file={key}", f"--socket={socket_path}",
                     f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                     f"--seed-file={munge / 'seed'}"], "munged")
        self._wait(lambda: socket_path.exists(), "munged to create its socket")
        host = socket.gethostname().split(".")[0]
        memory = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 - 1024
        self.conf.write_text("\n".join([
            "ClusterName=mtptrain-test", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: how long a revoked job credential is kept, and so how long a requeued job waits
            # before it may start again (default 120 s).
            f"AuthInfo=socket={socket_path},cred_expire=10",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill", "ReturnToService=2", "MpiDefault=none",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "JobRequeue=1", "MinJobAge=3600", "KillWait=10",
            "InactiveLimit=0", "SchedulerParameters=sched_interval=1",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], "slurmd")
        self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False), "the node to be idle")
        return self

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not ready():
            if time.time() > deadline:
                logs = {p.name: p.read_text()[-800:] for p in (self.root / "log").glob("*")}
                raise RuntimeError(f"timed out waiting for {what}; logs: {logs}")
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job, e.g. job(...)['JobState'], ['Restarts']."""
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    def wait(self, job_id: str, timeout: float) -> dict:
        """Wait until the job ends (a requeued job starts again after cred_expire); returns its fields."""
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in FINAL:
                return info
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout} s: {info}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
