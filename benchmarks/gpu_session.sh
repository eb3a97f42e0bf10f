#!/bin/bash
# One device-machine session: build the kernels, run the GPU tests, benchmark; MEMCHECK=1 adds a memcheck of both paths.
# Usage (repo root, on the GPU machine): OUT=<dir> bash benchmarks/gpu_session.sh [pytest -k expression]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PUNICA_HF_CACHE=${PUNICA_HF_CACHE:-/tmp/punica_hf_cache}
OUT=${OUT:-/tmp/punica_out}
mkdir -p "$OUT"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log"; }

log "gpu"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$OUT/log"
log "build"; ( time python3 -m punica_hf.ops.build ) 2>&1 | tail -5 | tee -a "$OUT/log" || { log "BUILD FAILED"; exit 1; }
log "tests"; python3 -m pytest -q -p no:cacheprovider tests/gpu ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest.log" | tail -25 | tee -a "$OUT/log"
log "bench"; python3 benchmarks/bench_ops.py --out-dir "$OUT" 2>&1 | tail -30 | tee -a "$OUT/log"
[ -n "$MEMCHECK" ] && { log "memcheck"
timeout 60 compute-sanitizer --tool memcheck --print-limit 5 python3 - <<'PY' 2>&1 | tail -8 | tee -a "$OUT/log"
import torch
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops.segments import build_segments
for tokens, hidden_in, hidden_out, rank in ((37, 1000, 2056, 13), (700, 1000, 2056, 24)):
    slots = torch.randint(-1, 6, (tokens,), dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, hidden_in, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(tokens, hidden_out, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(6, rank, hidden_in, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(6, hidden_out, rank, device="cuda", dtype=torch.bfloat16)
    ranks = torch.randint(0, rank + 1, (6,), dtype=torch.int32, device="cuda")
    cuda_ops.lora_add(y, x, a, b, ranks, build_segments(slots, 6, "cuda"))
torch.cuda.synchronize()
print("memcheck script done")
PY
} ; log "done"
