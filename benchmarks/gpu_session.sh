#!/bin/bash
# One device call, everything measured on the GPU: the GPU, the kernel build, the GPU tests, then the op, adapter
# store and generate() benchmarks (and, when asked for in ONLY, the adapter kinds, the serving engine, its extra
# workloads and Ray Serve against the engine's server). Every part runs under `timeout`, cut to what is left of one
# overall budget, so a hang costs its part only. Into $OUT go session.log (every part's output), pytest.log and
# pytest_summary.log (a line per test group), and each benchmark's JSON (bench_ops_h200.json/.md,
# bench_adapters_h200.json, bench_generate_h200.json, bench_step_lora_h200.json, ...: named h200 whatever the GPU;
# the JSON names the device). A short
# summary is printed last.
#
#   OUT=$OUT bash benchmarks/gpu_session.sh          # from the repository root on the GPU machine
#
# Environment:
#   ONLY="build tests ops adapters generate step"   the parts to run (default: these, in this order; also "kinds"
#                                                   (bench_adapter_kinds.py), "serving" (bench_serving.py's quick
#                                                   saturation run, adapters vs base), "serving_b" (the same
#                                                   run with AB_FLAGS, default "--kernels fused_norms=true"),
#                                                   "compiled" (the same run
#                                                   with EngineConfig.compile_steps), "workloads" (its small-model,
#                                                   mixed-ranks, long-prompts and shared-prefixes runs; WORKLOADS=
#                                                   to pick some) and "ray" (bench_ray.py:
#                                                   Ray Serve carried with carry_packages.py, on PYTHONPATH); the kernel
#                                                   build runs whenever another part does, so no part pays for it in
#                                                   its timeout)
#   SKIP_TESTS=1                                    leave out the GPU tests
#   PYTEST_ARGS="-k compile"                        extra pytest arguments
#   TEST_GROUPS="tests/gpu tests/test_fp8.py"       the test files, one pytest process per word (default below)
#   OPS_FLAGS="--profile"                           extra bench_ops.py flags (--profile: each kernel's time)
#   GEN_FLAGS="..."                                 bench_generate.py flags (default below: every system, ~4 min)
#   ADAPTER_FLAGS="..."                             bench_adapters.py flags (default: the issue-8 setup, ~2 min)
#   RAY_FLAGS="--repeats 1"                         extra bench_ray.py flags
#   WORKLOAD_FLAGS="--compile-steps"                extra bench_serving.py flags of the "workloads" part
#   BUDGET_S=530                                    seconds for the whole call
set -o pipefail
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PUNICA_HF_CACHE=${PUNICA_HF_CACHE:-/tmp/punica_hf_cache}
# tests/test_fp8.py runs transformers' fp8 kernel, which transformers fetches from the Hub: carried (the GPU machine
# has no network) as kernels-community/finegrained-fp8's torch-ext/finegrained_fp8 package in .carry-fp8
[ -d .carry-fp8 ] && export PYTHONPATH=$PWD/.carry-fp8:$PYTHONPATH
OUT=${OUT:-/tmp/punica_out}
ONLY=${ONLY:-build tests ops adapters generate step}
[ -n "$SKIP_TESTS" ] && ONLY=${ONLY//tests/}
# tests/gpu, and the engine's GPU-marked tests beside its CPU ones; a comma joins files run in one process
TEST_GROUPS=${TEST_GROUPS:-tests/gpu tests/test_engine.py tests/test_attention.py,tests/test_sampling.py,tests/test_prefix_cache.py tests/test_fp8.py}
GEN_FLAGS=${GEN_FLAGS:---modes eager,compiled --distinct 1,8,32 --prefill-heavy eager --profile eager,compiled}
BUDGET_S=${BUDGET_S:-530}
mkdir -p "$OUT"
LOG="$OUT/session.log"
SUMMARY=()

log() { echo "== $(date +%T) [$SECONDS s] $*" | tee -a "$LOG"; }
wanted() { [[ " $ONLY " == *" $1 "* ]]; }

# part NAME CAP_S COMMAND...: run COMMAND with a timeout of min(CAP_S, budget left), output appended to the log;
# skipped when less than 30 s are left. Returns the command's status.
part() {
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET_S - SECONDS)) started=$SECONDS status
    local limit=$((cap < left ? cap : left))
    if ((limit < 30)); then
        log "$name: skipped, ${left} s of the budget left"; SUMMARY+=("$name|skipped|0"); return 1
    fi
    log "$name (timeout ${limit} s): $*"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    status=$?
    ((status == 124 || status == 137)) && log "$name: TIMED OUT after ${limit} s"
    log "$name: exit $status after $((SECONDS - started)) s"
    SUMMARY+=("$name|$status|$((SECONDS - started))")
    return $status
}

log "gpu"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv 2>&1 | tee -a "$LOG"
# whether the kernel groups processes by session (a nice value then counts only within its session): Ray's workers
echo "CPUs $(nproc), sched_autogroup_enabled $(cat /proc/sys/kernel/sched_autogroup_enabled 2>&1)" | tee -a "$LOG"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

if [ -n "${ONLY// /}" ]; then  # every part runs the kernels
    part build 180 python3 -m punica_hf.ops.build || { log "BUILD FAILED: nothing else runs"; ONLY=""; }
fi
if wanted tests; then
    # one pytest process per file group: a crash (a fatal error in torch or a kernel) loses that group only
    part tests 420 bash -c 'status=0; for group in $0; do echo "== $group" >> "$1/pytest.log"
        python3 -m pytest -q -p no:cacheprovider ${group//,/ } $2 >> "$1/pytest.log" 2>&1; rc=$?; ((rc)) && status=$rc
        echo "$group: exit $rc: $(tail -1 "$1/pytest.log" | cut -c1-200)" >> "$1/pytest_summary.log"; done
        exit $status' "$TEST_GROUPS" "$OUT" "$PYTEST_ARGS"
    [ -f "$OUT/pytest_summary.log" ] && cat "$OUT/pytest_summary.log" | tee -a "$LOG"
fi
# The benchmarks use the CUDA kernels or fail: a silent fallback to the PyTorch ops would time the wrong code.
export PUNICA_HF_BACKEND=${PUNICA_HF_BACKEND:-cuda}
wanted ops && part ops 150 python3 benchmarks/bench_ops.py --out-dir "$OUT" $OPS_FLAGS
wanted adapters && part adapters 200 \
    python3 benchmarks/bench_adapters.py --output "$OUT/bench_adapters_h200.json" $ADAPTER_FLAGS
wanted generate && part generate 330 \
    python3 benchmarks/bench_generate.py --output "$OUT/bench_generate_h200.json" $GEN_FLAGS
wanted step && part step 90 python3 benchmarks/bench_step_lora.py --output "$OUT/bench_step_lora_h200.json"
wanted kinds && part kinds 300 \
    python3 benchmarks/bench_adapter_kinds.py --output "$OUT/bench_adapter_kinds_h200.json"
wanted serving && part serving 240 python3 benchmarks/bench_serving.py --adapters 32 --static-requests 0 --rates "" \
    --compiled-batches "" --no-transformers-cb --output "$OUT/bench_serving_quick_h200.json"
# the same quick run on a model made with other kernel choices: an A/B of one KernelConfig field against "serving"
wanted serving_b && part serving_b 240 python3 benchmarks/bench_serving.py --adapters 32 --static-requests 0 \
    --rates "" --compiled-batches "" --no-transformers-cb ${AB_FLAGS:---kernels fused_norms=true} \
    --output "$OUT/bench_serving_quick_b_h200.json"
wanted compiled && part compiled 360 python3 benchmarks/bench_serving.py --adapters 32 --static-requests 0 \
    --rates "" --compiled-batches "" --no-transformers-cb --compile-steps --output "$OUT/bench_serving_compiled_h200.json"
if wanted workloads; then
    for workload in ${WORKLOADS:-small-model mixed-ranks long-prompts shared-prefixes}; do
        part "$workload" 300 python3 benchmarks/bench_serving.py "--$workload" $WORKLOAD_FLAGS \
            --output "$OUT/bench_serving_${workload//-/_}_h200.json"
    done
fi
if wanted ray; then
    # Ray Serve and the server's packages, packed by carry_packages.py into .carry (the GPU machine has no network)
    [ -d .carry ] && part carry 120 bash benchmarks/carry_packages.sh .carry /tmp/carried_site
    [ -d /tmp/carried_site ] && export PYTHONPATH=/tmp/carried_site:$PYTHONPATH
    part ray 420 python3 benchmarks/bench_ray.py --output "$OUT/bench_ray_h200.json" $RAY_FLAGS
fi

log "summary"
{
    echo "| part | exit | seconds |"
    echo "|---|---|---|"
    for row in "${SUMMARY[@]}"; do echo "| ${row//|/ | } |"; done
    [ -f "$OUT/pytest_summary.log" ] && echo && cat "$OUT/pytest_summary.log"
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


ops = load("bench_ops_h200.json")
if ops:
    rows = ops["results"]
    met = sum(bool(r.get("met")) for r in rows)
    worst = max(rows, key=lambda r: r.get("ratio", 0))
    print(f"\nbench_ops: {met} of {len(rows)} rows meet their target; worst ours/peer {worst.get('ratio', 0):.2f} "
          f"({worst.get('hidden_in')}->{worst.get('rank')}->{worst.get('hidden_out')} {worst.get('case')})")
adapters = load("bench_adapters_h200.json")
if adapters:
    done = list(adapters.get("section_seconds", {}))
    print("\nbench_adapters:" + ("" if "summary" in adapters else f" cut short; sections done: {done}"))
    for row in adapters.get("summary", []):
        met = "met " if row["met"] else "MISS"
        print(f"  {met} {row['value']:8.2f} {row['unit']:9s} {row['target']:10s} {row['what']}")
generate = load("bench_generate_h200.json")
if generate:
    print("\nbench_generate (ratio to base, same mode and case):")
    for name, ratio in generate.get("ratios", {}).items():
        print(f"  {ratio:5.2f}  {name}")
    for name, cost in generate.get("decode_step_lora_cost", {}).items():
        if "added_ms" in cost:
            added, over = cost["added_ms"], cost["added_over_floor"]
            print(f"  LoRA adds {added:.2f} ms per decode step, {over:.1f}x its bytes floor: {name}")
PY
} 2>&1 | tee -a "$LOG"
log "done"
