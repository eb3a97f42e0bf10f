"""Where the serving engine's time goes with adapters: device kernels of ``bench_serving.py``'s saturation run
(Llama-3-8B shape, 160 requests at once, 32 rank-16 adapters), then the same requests on the base model.
``--mixed-ranks``: its ``--mixed-ranks`` workload instead (120 adapters of ranks 8-64 over 64 GPU slots, Zipf
popularity, 256 requests at once), whose adapter loads while serving show as host-to-device copies.

For each system a window of the run (``--skip`` seconds after the requests arrive, ``--window`` seconds long) is
traced with torch.profiler (CUDA kernels, also those replayed from CUDA graphs); the kernels are summed by kind:
LoRA per-token calls of decode size (grid over at most 256 positions), the per-token half of tiled calls (the
short runs of mixed steps), the tiled kernels, attention, GEMMs, the rest.
Times are per engine step of the window (steps counted by the engine's step listener), split into decode and
mixed steps by the listener's records. A per-token kernel belongs to a tiled call when it runs right after that
call's tiled kernels (the split call launches them back to back), else to a decode-sized call.
``--kernels short_run_chunks=false`` profiles the model made with that ``KernelConfig``, to set a kernel path
against the default one in two runs of one device call.

    python benchmarks/profile_engine_steps.py --output benchmarks/results/profile_engine_steps_h200.json
    python benchmarks/profile_engine_steps.py --mixed-ranks --skip 3 --window 5 \
        --output benchmarks/results/profile_engine_steps_mixed_ranks_h200.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_serving import FULL, build_model, make_requests, run_engine
from serving_workloads import kernel_config, workload_setup

from punica_hf.ops import KernelConfig
from punica_hf.serving import Engine, EngineConfig, StepRecord

PER_TOKEN = ("shrink_chunk_kernel", "expand_chunk_kernel", "fused_chunk_kernel")
TILED = ("shrink_tiled_kernel", "expand_tiled_kernel")
ATTENTION = ("paged_attention", "merge_splits_kernel", "flash", "attention")  # merge: the split-KV attention's


def kinds_of(kernels: list[dict]) -> list[str]:
    """The kind of each kernel event; ``kernels`` in launch order per stream. A split tiled call launches its tiled
    kernels, then its per-token shrink and expand, with nothing between them on its stream."""
    kinds, in_tiled_call, stream = [], False, None
    for event in kernels:
        if event.get("tid") != stream:
            in_tiled_call, stream = False, event.get("tid")
        name = event["name"]
        if any(k in name for k in PER_TOKEN):
            kinds.append("lora per-token, in tiled calls" if in_tiled_call else "lora per-token, decode-sized calls")
            in_tiled_call = in_tiled_call and "shrink_chunk_kernel" in name  # its expand ends the call
            continue
        in_tiled_call = any(k in name for k in TILED)
        if in_tiled_call:
            kinds.append("lora tiled")
        elif any(k in name.lower() for k in ATTENTION):
            kinds.append("attention")
        elif any(k in name.lower() for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas")):
            kinds.append("gemm")
        else:
            kinds.append("other")
    return kinds


def traced_window(engine: Engine, requests, adapters, skip: float, window: float) -> dict:
    """Run every request at once; trace ``window`` seconds from ``skip`` seconds in. Kernel time by kind and
    the steps that ran in the window."""
    steps: list[StepRecord] = []
    tracing = threading.Event()  # each system's listener records only while its own window is traced
    engine.add_step_listener(lambda record: tracing.is_set() and steps.append(record))
    runner = ThreadPoolExecutor(max_workers=1)
    run = runner.submit(run_engine, engine, requests, adapters, None, 0)
    time.sleep(skip)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tracing.set()
        time.sleep(window)
        tracing.clear()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder, "trace.json")
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    run.result()  # the run's own error, if it failed
    runner.shutdown()
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: (str(e.get("tid")), e["ts"]))
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    by_kind: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event, kind in zip(kernels, kinds_of(kernels)):
        by_kind[kind] += event["dur"] / 1e3  # ms
        launches[kind] += 1
    decode = [s for s in steps if s.tokens == s.requests]
    mixed = [s for s in steps if s.tokens > s.requests]
    return {
        "steps": len(steps), "decode_steps": len(decode), "mixed_steps": len(mixed),
        "step_seconds": sum(s.seconds for s in steps),
        "mean_decode_batch": sum(s.requests for s in decode) / max(len(decode), 1),
        "mean_mixed_tokens": sum(s.tokens for s in mixed) / max(len(mixed), 1),
        "kernel_ms": dict(sorted(by_kind.items())), "kernel_launches": dict(sorted(launches.items())),
        "kernel_ms_per_step": {k: v / max(len(steps), 1) for k, v in sorted(by_kind.items())},
        "kernels_seen": len(kernels),
        "copy_ms_per_step": sum(e["dur"] for e in copies) / 1e3 / max(len(steps), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=float, default=1.5, help="seconds into the run before tracing")
    parser.add_argument("--window", type=float, default=2.0, help="seconds traced")
    parser.add_argument("--mixed-ranks", action="store_true",
                        help="bench_serving's --mixed-ranks workload rather than 32 rank-16 adapters")
    parser.add_argument("--kernels", type=kernel_config, default=KernelConfig(),
                        help="KernelConfig fields of the model, e.g. 'short_run_chunks=false' (default: the defaults)")
    parser.add_argument("--output", type=Path, default=Path("profile_engine_steps.json"))
    args = parser.parse_args()
    kernels = args.kernels
    if args.mixed_ranks:
        setup = argparse.Namespace(tiny=False, workload="mixed-ranks", layers=32, adapters=[120], max_adapters=64,
                                   requests=256, zipf=1.0, kernels=kernels)
        model, workload_systems, requests_for = workload_setup(setup)
        systems = [(system.name, system.adapters) for system in workload_systems]
        requests = requests_for(0)
    else:
        setup = argparse.Namespace(tiny=False, layers=32, adapters=[32], rank=16, max_adapters=128, kernels=kernels)
        model, adapter_sets, config = build_model(setup)
        systems = [("engine, 32 adapters", adapter_sets[32]), ("engine, base model", [None])]
        requests = make_requests(160, config.vocab_size, FULL, 0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "skip": args.skip,
              "window": args.window, "workload": "mixed-ranks" if args.mixed_ranks else "uniform",
              "kernels": repr(kernels), "systems": {}}
    with profile(activities=[ProfilerActivity.CUDA]):  # the profiler set up before the engine captures graphs
        torch.zeros(1, device="cuda")
    with Engine(model, config=EngineConfig(max_queue=len(requests), max_running=128)) as engine:
        run_engine(engine, requests[:8], systems[0][1], None, 0)  # warm-up
        for name, adapters in systems:
            report["systems"][name] = result = traced_window(engine, requests, adapters, args.skip, args.window)
            print(name, json.dumps(result, indent=1), flush=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
