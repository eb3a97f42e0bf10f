#!/bin/bash
# Where a fused LoRA call's fixed cost goes: bench_step_lora.py run on copies of the package whose fused kernel
# returns early, at entry, after the chunk lookup, once A and x have arrived, and after the cluster has summed the
# shrink; the full kernel first and last. The difference between neighbouring stages, per call, is what that part
# of the kernel adds to a step (every stage still launches the same grid). Each copy builds into its own cache.
# Every run's rows go into one file, $OUT/fused_stages_h200.json.
#
#   OUT=$OUT bash benchmarks/explore/fused_stages.sh     # on a GPU machine (~1 min per call set)
#
# Environment: CALL_SETS="all qkv o gate_up down"  the step's four calls together, then each kind alone (default:
#              all); STEP_ARGS="--distinct 32,1"      more bench_step_lora.py arguments.
# The copies' kernels compute nothing useful past their return: timing only. A stage whose marker line is not
# found in csrc/lora_fused.cu stops the script (the kernel changed: update the markers).
set -euo pipefail
OUT=$(realpath -m "${OUT:-/tmp/punica_out}")
CALL_SETS=${CALL_SETS:-all}
work=$(mktemp -d)
repo=$(cd "$(dirname "$0")/../.." && pwd)   # this script lives in benchmarks/explore/
cd "$repo"                                  # the copies below take punica_hf/ and csrc/ from the repository root
kernel=csrc/lora_fused.cu
declare -A stages=(
    [entry]='s|^  const cg::cluster_group cluster = cg::this_cluster();$|&\n  if (num_slots >= 0) return;|'
    [lookup]='s|^  const int rank = chunk.rank;$|&\n  if (rank >= 0) return;|'
    [loads]='0,/^  cp_async_wait<1>();$/s||  cp_async_wait<1>();\n  __syncthreads();\n  if (num_slots >= 0) return;|'
    [cluster_sum]='s|^  cluster.barrier_arrive();.*|  cluster.barrier_arrive();\n  cluster.barrier_wait();\n  if (num_slots >= 0) return;|'
)
order=(full entry lookup loads cluster_sum)
for stage in "${order[@]}"; do
    mkdir -p "$work/$stage"
    cp -r punica_hf csrc "$work/$stage/"
    if [ "$stage" != full ]; then
        sed -i "${stages[$stage]}" "$work/$stage/$kernel"
        cmp -s "$kernel" "$work/$stage/$kernel" && { echo "stage $stage: marker not found in $kernel" >&2; exit 1; }
    fi
    (cd "$work/$stage" && PUNICA_HF_CACHE="$work/cache_$stage" python3 -m punica_hf.ops.build) &
done
wait
run=0
for calls in $CALL_SETS; do
    [ "$calls" = all ] && calls=qkv,o,gate_up,down
    for stage in "${order[@]}" full; do
        run=$((run + 1))
        PYTHONPATH="$work/$stage" PUNICA_HF_CACHE="$work/cache_$stage" python3 "$repo/benchmarks/bench_step_lora.py" \
            --label "$stage" --calls "$calls" --output "$work/run_$run.json" ${STEP_ARGS:-}
    done
done
mkdir -p "$OUT"
python3 - "$work" "$run" "$OUT/fused_stages_h200.json" <<'PY'
import json, sys
work, runs, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
results = [json.load(open(f"{work}/run_{i}.json")) for i in range(1, runs + 1)]
rows = [{"stage": r["setup"]["label"], "calls": r["setup"]["calls"], **row} for r in results for row in r["rows"]]
setup = {k: v for k, v in results[0]["setup"].items() if k not in ("label", "calls")}
json.dump({"setup": setup, "rows": rows}, open(output, "w"), indent=1)
PY
