"""mtptrain.machine: the CPU named with its extensions, and the CPU other processes used during a measurement."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtptrain.machine import EXTENSIONS, cpu_sample, describe_cpu, other_load

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def test_describe_cpu_names_this_machines_cpu_and_torchs_kernel_level():
    cpu = describe_cpu()
    assert cpu["model"].strip() and cpu["capability"].strip()
    assert cpu["logical_cores"] == os.cpu_count() >= 1
    if Path("/proc/cpuinfo").is_file():
        assert set(cpu["extensions"]) <= set(EXTENSIONS)


def test_describe_cpu_reads_arm_features_and_says_unknown_without_cpuinfo(tmp_path):
    arm = tmp_path / "arm"
    arm.mkdir()
    (arm / "cpuinfo").write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm sve i8mm bf16\n\n"
                                 "processor\t: 1\nFeatures\t: fp\n")
    cpu = describe_cpu(arm)
    assert cpu["extensions"] == ["asimd", "sve", "bf16", "i8mm"]
    assert cpu["model"]  # no "model name" line: the platform's name instead
    (tmp_path / "x86").mkdir()
    (tmp_path / "x86" / "cpuinfo").write_text("model name\t: Example Xeon\nflags\t\t: fpu avx2 avx512f amx_tile\n")
    assert describe_cpu(tmp_path / "x86")["model"] == "Example Xeon"
    assert describe_cpu(tmp_path / "x86")["extensions"] == ["avx2", "avx512f", "amx_tile"]
    (tmp_path / "epyc").mkdir()
    (tmp_path / "epyc" / "cpuinfo").write_text("cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n")
    assert describe_cpu(tmp_path / "epyc")["model"] == "AMD EPYC (family 25, model 17)"
    assert describe_cpu(tmp_path / "none")["extensions"] is None


def orphan_spinner(seconds: float) -> int:
    """A process spinning on one core that is not a descendant of this one (its parent exits at once)."""
    launch = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {SPIN.format(seconds=seconds)!r}], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint(p.pid)")
    return int(subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the machine's busy time is read from /proc/stat")
def test_other_load_counts_a_process_spinning_beside_a_sleeping_measurement():
    pid = orphan_spinner(6.0)
    try:
        time.sleep(0.5)  # the spinner's interpreter starting up
        start = cpu_sample()
        time.sleep(1.5)
        load = other_load(start, cpu_sample())
    finally:
        os.kill(pid, signal.SIGTERM)
    assert load is not None and load > 0.5


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="live descendants are read from /proc")
def test_a_live_child_process_counts_as_this_process_cpu_not_as_other_load():
    start = cpu_sample()
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nwhile time.process_time() < 1.0:\n    pass\n"
                              "print('spun', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        alive = cpu_sample()
    finally:
        child.stdin.close()
        child.wait()
    reaped = cpu_sample()
    assert alive.own - start.own >= 0.95
    assert alive.own - start.own <= reaped.own - start.own < alive.own - start.own + 0.5  # not counted twice


def test_without_proc_stat_the_load_is_unknown(tmp_path):
    start = cpu_sample(tmp_path)
    assert start.busy is None and start.own >= 0
    assert other_load(start, cpu_sample(tmp_path)) is None
