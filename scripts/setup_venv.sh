#!/usr/bin/env bash
# Make the project's virtual environment if it is missing and install punica_hf into it (editable) with the
# extras given as $1 ("" for the library alone, "test" for the test suite). Called by `make demo` / `make test`.
#
# torch comes first, chosen for the machine: PyPI's default build (with CUDA) where an NVIDIA GPU answers, else
# the CPU build, which a CPU never needs 4 GB of CUDA libraries for: from the PyTorch CPU index when it is
# reachable, else `torch==$TORCH_CPU_VERSION` (a CPU wheel the machine's pip configuration may provide, as on the
# project's CI machines). An environment that already has torch keeps it.
set -euo pipefail

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
extras="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "installing torch (an NVIDIA GPU is present: PyPI's build, with CUDA)"
        "${pip[@]}" install torch
    elif "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$TORCH_CPU_INDEX/torch/', timeout=5)" \
            >/dev/null 2>&1; then
        echo "installing torch (no GPU: the CPU build, from $TORCH_CPU_INDEX)"
        # --isolated: only that index, not an index or wheel folder the pip configuration adds (CUDA builds)
        "${pip[@]}" install --isolated --index-url "$TORCH_CPU_INDEX" torch
    else
        echo "installing torch==$TORCH_CPU_VERSION (no GPU, and $TORCH_CPU_INDEX is out of reach)"
        "${pip[@]}" install "torch==$TORCH_CPU_VERSION"
    fi
fi

if [ -n "$extras" ]; then
    "${pip[@]}" install -e ".[$extras]"
else
    "${pip[@]}" install -e .
fi
