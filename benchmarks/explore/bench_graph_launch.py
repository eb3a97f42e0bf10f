"""What a LoRA kernel costs inside a CUDA graph beyond its own run time: host time of the graph launch and GPU gaps.

A compiled decode step is one CUDA graph launch. This builds a graph shaped like a Llama-3-8B decode step (32
layers, batch 32, the seven projections as cuBLAS GEMMs plus a few elementwise kernels per layer), then the same
graph with the LoRA calls of a step added, in each kernel configuration, and measures per replay:

- ``launch_us``: host time of ``graph.replay()`` (CUDA's graph launch), after the GPU went idle;
- ``gpu_us``: CUDA-event time of one replay (kernels plus the gaps between them);
- ``kernel_us``: the sum of the kernels' own durations (profiler), so ``gpu_us - kernel_us`` is the gaps;
- ``profiled_launch_us``: ``launch_us`` with torch.profiler recording CUDA activity, as in a step profile. CUPTI
  records every kernel node of a graph, which costs host time per node at each launch: the ``cudaGraphLaunch`` times
  of ``bench_generate.py``'s profiles are this, not what a step pays without the profiler.

Variants: ``chain N``, N tiny elementwise kernels on one stream and nothing else (launch time against the node count
alone); the base graph; plus 128 plain elementwise kernels (a node with no launch attributes); plus the step's
LoRA calls (4 per layer: q/k/v and gate/up as grouped ``lora_delta`` calls, o and down as ``lora_add``) with the
fused cluster kernel, and with two launches with and without PDL; and the fused calls on a second stream, each
forked before the GEMMs that read the same input and joined before their output is used ("overlapped": what running
the LoRA kernels beside the base GEMMs would save; its joins add each update with one more elementwise kernel, 128
in all, which "base + 128 plain kernels" prices).

    PYTHONPATH=. python benchmarks/explore/bench_graph_launch.py --output benchmarks/results/bench_graph_launch_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared helpers
from cuda_graph import capture  # noqa: E402
from punica_hf.ops import KernelConfig  # noqa: E402
from punica_hf.ops import cuda as cuda_ops  # noqa: E402
from punica_hf.ops import torch_ops  # noqa: E402
from punica_hf.ops.segments import build_segments  # noqa: E402

LAYERS, TOKENS, HIDDEN, KV, INTERMEDIATE, RANK = 32, 32, 4096, 1024, 14336, 16
# Kernel config of each LoRA variant (the fused kernel is a plain launch: programmatic_launch is for two launches).
LORA_VARIANTS = {
    "lora fused": KernelConfig(fused=True),
    "lora two launches, PDL": KernelConfig(fused=False, programmatic_launch=True),
    "lora two launches, no PDL": KernelConfig(fused=False, programmatic_launch=False),
}


class Step:
    """Weights, activations and LoRA tables of one decode step; ``run`` launches its kernels on the current stream."""

    def __init__(self, distinct: int) -> None:
        device, dtype = "cuda", torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device, generator=g) * shape[-1] ** -0.5).to(dtype)

        # One set of weights shared by all layers keeps memory small; each GEMM still streams its weight.
        self.w = {"q": randn(HIDDEN, HIDDEN), "k": randn(KV, HIDDEN), "v": randn(KV, HIDDEN),
                  "o": randn(HIDDEN, HIDDEN), "gate": randn(INTERMEDIATE, HIDDEN),
                  "up": randn(INTERMEDIATE, HIDDEN), "down": randn(HIDDEN, INTERMEDIATE)}
        self.x = randn(TOKENS, HIDDEN)
        self.small = torch.zeros(TOKENS, 8, device=device, dtype=dtype)
        # Pool: A [r, in] and Bt [r, out] of every slot and member of the four calls (q/k/v, o, gate/up, down).
        calls = {"qkv": (HIDDEN, [HIDDEN, KV, KV]), "o": (HIDDEN, [HIDDEN]),
                 "gate_up": (HIDDEN, [INTERMEDIATE, INTERMEDIATE]), "down": (INTERMEDIATE, [HIDDEN])}
        factors = [randn(RANK, size) for _ in range(distinct) for hidden_in, outputs in calls.values()
                   for width in outputs for size in (hidden_in, width)]
        self.pool, offsets = torch_ops.pack_factors(factors)
        offsets = torch.tensor(offsets, device=device).view(distinct, -1, 2)  # [S, members of all calls, A/Bt]
        self.tables, member = {}, 0
        for name, (_, outputs) in calls.items():
            rows = slice(member, member + len(outputs))
            member += len(outputs)
            self.tables[name] = (offsets[:, rows, 0].T.contiguous(), offsets[:, rows, 1].T.contiguous(),
                                 torch.full((len(outputs), distinct), RANK, dtype=torch.int32, device=device),
                                 outputs)
        self.side = torch.cuda.Stream()  # the overlapped variant's second stream
        slots = (torch.arange(TOKENS, device=device) % distinct).to(torch.int32)
        self.segments = build_segments(slots, distinct)
        self.backend = cuda_ops.CudaLoraBackend()  # the LoRA variant: set per measurement

    def run(self, lora: bool, plain_extra: bool, overlap: bool = False) -> None:
        w, x = self.w, self.x
        side = self.side
        for _ in range(LAYERS):
            h = x * 1.0001  # stands in for the norm
            qkv_delta = self._fork(side, h, "qkv") if overlap else None
            q, k, v = F.linear(h, w["q"]), F.linear(h, w["k"]), F.linear(h, w["v"])
            if lora and not overlap:
                self._delta(h, "qkv")
            if overlap:
                q = q + self._join(side, qkv_delta)[:, :HIDDEN]
            attn = q + k.repeat(1, 4) + v.repeat(1, 4)  # stands in for attention
            o_delta = self._fork(side, attn, "o") if overlap else None
            o = F.linear(attn, w["o"])
            if lora and not overlap:
                self._add(o, attn, "o")
            h2 = o * 1.0001 if not overlap else o + self._join(side, o_delta)
            gate_up_delta = self._fork(side, h2, "gate_up") if overlap else None
            gate, up = F.linear(h2, w["gate"]), F.linear(h2, w["up"])
            if lora and not overlap:
                self._delta(h2, "gate_up")
            if overlap:
                gate = gate + self._join(side, gate_up_delta)[:, :INTERMEDIATE]
            act = F.silu(gate) * up
            down_delta = self._fork(side, act, "down") if overlap else None
            down = F.linear(act, w["down"])
            if lora and not overlap:
                self._add(down, act, "down")
            x = down + o if not overlap else down + self._join(side, down_delta) + o
            if plain_extra:
                for _ in range(4):
                    self.small.add_(1)
        self.out = x

    def _delta(self, h: torch.Tensor, name: str) -> torch.Tensor:
        a, b, ranks, outputs = self.tables[name]
        return self.backend.lora_delta_unchecked(h, self.pool, a, b, ranks, self.segments, RANK, outputs)

    def _fork(self, side: torch.cuda.Stream, h: torch.Tensor, name: str) -> torch.Tensor:
        """The call's updates computed on ``side`` once ``h`` is ready (the inputs stay alive: the graph is captured
        whole, so nothing is freed before the join)."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return self._delta(h, name)

    def _join(self, side: torch.cuda.Stream, delta: torch.Tensor) -> torch.Tensor:
        torch.cuda.current_stream().wait_stream(side)
        return delta

    def _add(self, y: torch.Tensor, h: torch.Tensor, name: str) -> None:
        a, b, ranks, _ = self.tables[name]
        self.backend.lora_add_unchecked(y, h, self.pool, a[0], b[0], ranks[0], self.segments, RANK)


def measure(graph: torch.cuda.CUDAGraph, reps: int) -> dict:
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    launch, gpu = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        launch.append((t1 - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3)
    profiled_launch = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            t0 = time.perf_counter()
            graph.replay()
            profiled_launch.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"launch_us": statistics.median(launch), "gpu_us": statistics.median(gpu),
            "kernel_us": sum(e.device_time for e in kernels) / 5, "kernels": len(kernels) / 5,
            "profiled_launch_us": statistics.median(profiled_launch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distinct", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    step = Step(args.distinct)
    results = {}
    counter = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    for nodes in (100, 672, 800, 2400):
        results[f"chain {nodes}"] = measure(capture(lambda: [counter.add_(1) for _ in range(nodes)]), args.reps)
    results["base"] = measure(capture(lambda: step.run(False, False)), args.reps)
    results["base + 128 plain kernels"] = measure(capture(lambda: step.run(False, True)), args.reps)
    for name, kernels in LORA_VARIANTS.items():
        step.backend = cuda_ops.CudaLoraBackend(kernels)
        results[name] = measure(capture(lambda: step.run(True, False)), args.reps)
    step.backend = cuda_ops.CudaLoraBackend(LORA_VARIANTS["lora fused"])
    results["lora fused, overlapped"] = measure(capture(lambda: step.run(True, False, overlap=True)), args.reps)
    base = results["base"]
    for name, r in results.items():
        extra = r["kernels"] - base["kernels"]
        added_to_base = extra and not name.startswith("chain")
        r["launch_us_per_added_kernel"] = (r["launch_us"] - base["launch_us"]) / extra if added_to_base else None
        r["gaps_us"] = r["gpu_us"] - r["kernel_us"]
        print(f"{name:28s} kernels {r['kernels']:5.0f}  launch {r['launch_us']:8.1f} us (profiled "
              f"{r['profiled_launch_us']:7.1f})  gpu {r['gpu_us']:8.1f} us  kernels {r['kernel_us']:8.1f} us  "
              f"gaps {r['gaps_us']:7.1f} us")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS, "tokens": TOKENS,
                "rank": RANK, "distinct": args.distinct}
        args.output.write_text(json.dumps({"setup": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
