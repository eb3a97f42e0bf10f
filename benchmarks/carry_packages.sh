#!/bin/bash
# Install what benchmarks/carry_packages.py packed (run on the GPU machine, which has no network):
#   bash benchmarks/carry_packages.sh .carry /tmp/site && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
from=$1 target=$2
mkdir -p "$target"
if compgen -G "$from/*.whl" >/dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$from"/*.whl
fi
if [ -f "$from/ray.tar.xz" ]; then
    tar -xJf "$from/ray.tar.xz" -C "$target"
fi
