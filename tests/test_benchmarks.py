"""Every benchmark script, the kernels' cross-target check and the hostile tries still import and parse their
arguments: they run by hand, not in CI, so a renamed function they use would otherwise break them unnoticed."""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_found():
    assert len(BENCHMARKS) >= 10


SCRIPTS = [ROOT / "scripts" / "check_kernel_targets.py", ROOT / "scripts" / "hostile_tries.py"]


@pytest.mark.parametrize("script", BENCHMARKS + SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_imports_and_prints_its_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
