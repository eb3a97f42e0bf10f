"""The LoRA calls of one compiled decode step, alone and between the base GEMMs, without the model around them.

A Llama-3-8B decode step at batch 32 makes 128 LoRA calls (32 layers x q/k/v, o, gate/up, down, each a
``lora_delta`` call as in compiled code). Every layer gets its own pool here, holding its own factors for every
slot, so each call reads its factors from DRAM as in the model (one pool shared by all layers would leave part of
them in L2). Three CUDA graphs are captured per adapter mix and replayed in turn:

- ``lora_us``: the 128 LoRA calls alone;
- ``gemm_us``: the base projections alone (``x @ W^T``, one GEMM per call with the members' weights stacked: 128
  GEMMs reading the 224 projections' weights);
- ``both_us``: the two interleaved as in a step; ``added_us = both_us - gemm_us`` is what LoRA adds to it.

``floor_us`` is the bytes the LoRA calls must move (the factors of the adapters in the batch, x read, updates
written) at the copy bandwidth measured here. With one adapter the calls move a small fraction of the bytes they
move at 32 distinct adapters, so ``lora_us`` at ``--distinct 1`` is close to the calls' fixed cost.

``--mixed P+D,...`` also times the 224 LoRA calls of mixed engine steps (one ``lora_add`` per projection, as the
engine's eager mixed steps make them): P prefill tokens in four runs and D decode tokens, two per adapter, over 64
slots of ranks 8/16/32/64 (``max_rank`` 64, as in ``bench_serving.py --mixed-ranks``; P = 0: a decode step, where
the paths are one). Each kernel path of a tiled call is a row: the decode tokens on the per-token kernels walking
the list of their chunks (the default), the same kernels with a block per position of the call, every token
tiled. ``--kernel-times`` adds each row's device time by kernel (per-token shrink and expand, tiled shrink and
expand) from the profiler over replays; a programmatic dependent expand starts before its shrink ends, so the
kinds overlap and add up to more than the replay.

    python benchmarks/bench_step_lora.py --output benchmarks/results/bench_step_lora_h200.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

import torch

from bench_ops import copy_bandwidth_bytes_per_us
from cuda_graph import capture
from punica_hf.ops import KernelConfig
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

LAYERS, TOKENS, HIDDEN, KV, INTERMEDIATE = 32, 32, 4096, 1024, 14336
# The four calls of a layer: input width and member widths (q/k/v and gate/up grouped, as compiled code does).
CALLS = {"qkv": (HIDDEN, [HIDDEN, KV, KV]), "o": (HIDDEN, [HIDDEN]),
         "gate_up": (HIDDEN, [INTERMEDIATE, INTERMEDIATE]), "down": (INTERMEDIATE, [HIDDEN])}


class Layer:
    """One layer's base weights ``[sum(members), in]`` per call, and a pool with every slot's A ``[r, in]`` and
    Bt ``[r, out]`` for every member, with the ``[members, slots]`` offset and rank tables of each call."""

    def __init__(self, slots: int, rank: int, generator: torch.Generator, ranks: torch.Tensor | None = None) -> None:
        def randn(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device="cuda", generator=generator) * shape[-1] ** -0.5).bfloat16()

        self.weights = {name: randn(sum(widths), hidden_in) for name, (hidden_in, widths) in CALLS.items()}
        members = [(hidden_in, width) for hidden_in, widths in CALLS.values() for width in widths]
        factors = [randn(rank, size) for _ in range(slots) for member in members for size in member]  # A, Bt
        self.pool, offsets = torch_ops.pack_factors(factors)
        offsets = torch.tensor(offsets, device="cuda").view(slots, len(members), 2)  # [S, member, A / Bt]
        self.tables, first = {}, 0
        for name, (_, widths) in CALLS.items():
            rows = slice(first, first + len(widths))
            first += len(widths)
            # Every slot holds factors of `rank` rows; `ranks` ([S], optional) makes the calls read only the first ones.
            table = torch.full((slots,), rank) if ranks is None else ranks
            ranks_table = table.to(torch.int32).cuda().expand(len(widths), slots).contiguous()
            self.tables[name] = (offsets[:, rows, 0].T.contiguous(), offsets[:, rows, 1].T.contiguous(), ranks_table)


def lora_floor_bytes(distinct: int, rank: int, calls: list[str]) -> int:
    """Bytes the step's ``calls`` must move: each used adapter's factors once per layer, x read, updates written."""
    per_layer = 0
    for name in calls:
        hidden_in, widths = CALLS[name]
        per_layer += TOKENS * hidden_in
        per_layer += sum(distinct * rank * (hidden_in + width) + TOKENS * width for width in widths)
    return 2 * LAYERS * per_layer


def replay_medians_us(graphs: dict[str, torch.cuda.CUDAGraph], reps: int) -> dict[str, float]:
    """Median CUDA-event time of one replay of each graph, the graphs replayed in turn (drift hits all alike)."""
    for graph in graphs.values():
        for _ in range(5):
            graph.replay()
    times = {name: [] for name in graphs}
    for _ in range(reps):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def kernel_times_us(graph: torch.cuda.CUDAGraph, reps: int) -> dict[str, float]:
    """Device time of one replay of ``graph`` by kernel (``lora_per_token`` and ``lora_tiled`` kernels by kind, the
    rest by name), mean over ``reps`` replays under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            path = "tiled" if "tiled" in event.name else "per-token"
            kind = next((f"{path} {k}" for k in ("shrink", "expand") if k in event.name), event.name[:80])
            times[kind] += event.device_time / reps
    return dict(times)


MIXED_SLOTS, MIXED_RANKS = 64, (8, 16, 32, 64)
MIXED_PATHS = {"short runs walk their chunk list": KernelConfig(),
               "short runs, a block per position": KernelConfig(short_run_chunks=False),
               "every token tiled": KernelConfig(short_runs=False)}


def mixed_step_rows(mixes: list[tuple[int, int]], reps: int, label: str, kernel_times: bool = False) -> list[dict]:
    """Median replay time of the 224 ``lora_add`` calls of a mixed step, per mix (prefill, decode) and kernel path;
    with ``kernel_times``, each path's device time by kernel too."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    ranks = torch.tensor(MIXED_RANKS).repeat(MIXED_SLOTS // len(MIXED_RANKS))
    max_rank = max(MIXED_RANKS)
    layers = [Layer(MIXED_SLOTS, max_rank, generator, ranks) for _ in range(LAYERS)]
    rows = []
    for prefill, decode in mixes:
        tokens = prefill + decode
        runs = torch.tensor([prefill - 3 * (prefill // 4)] + [prefill // 4] * 3)
        token_slots = torch.cat([torch.arange(decode) // 2 % MIXED_SLOTS,
                                 torch.repeat_interleave(torch.arange(4) * 16 + 7, runs)]).to(torch.int32).cuda()
        segments = build_segments(token_slots, MIXED_SLOTS)
        inputs = {name: torch.randn(tokens, hidden_in, device="cuda", generator=generator).bfloat16()
                  for name, (hidden_in, _) in CALLS.items()}
        outputs = {width: torch.zeros(tokens, width, device="cuda", dtype=torch.bfloat16)  # one per output width
                   for _, widths in CALLS.values() for width in widths}

        def step(backend) -> None:
            for layer in layers:
                for name, (_, widths) in CALLS.items():
                    a_offsets, b_offsets, table = layer.tables[name]
                    for member, width in enumerate(widths):
                        backend.lora_add_unchecked(outputs[width], inputs[name], layer.pool, a_offsets[member],
                                                   b_offsets[member], table[member], segments, max_rank)

        graphs = {path: capture(lambda b=cuda_ops.CudaLoraBackend(kernels): step(b))
                  for path, kernels in MIXED_PATHS.items()}
        times = replay_medians_us(graphs, reps)
        calls = LAYERS * sum(len(widths) for _, widths in CALLS.values())
        for path, us in times.items():
            rows.append({"prefill": prefill, "decode": decode, "path": path, "lora_us": us,
                         "lora_us_per_call": us / calls})
            print(f"{label:11s} mixed step {prefill}+{decode} tokens, {path:34s}: {us:8.1f} us "
                  f"({us / calls:5.2f} per call)", flush=True)
            if kernel_times:
                rows[-1]["kernel_us"] = kernel_times_us(graphs[path], reps)
                print("    by kernel: " + ", ".join(f"{kind} {t:.1f} us" for kind, t in rows[-1]["kernel_us"].items()))
        del graphs
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distinct", default="32,8,1", help="distinct adapters over the 32 tokens")
    parser.add_argument("--calls", default=",".join(CALLS), help="the calls of each layer to make (default: all four)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--label", default="", help="a name for this build, kept in the output (to tell runs of two builds apart)")
    parser.add_argument("--mixed", default="432+128,1920+128",
                        help="mixed steps to time after the decode steps, prefill+decode tokens ('' for none)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="the mixed steps' device time by kernel too (profiled replays)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_lora.py times CUDA kernels: no CUDA device here")
    mixes = [tuple(int(n) for n in mix.split("+")) for mix in args.mixed.split(",") if mix]
    calls = args.calls.split(",")
    if not calls or any(name not in CALLS for name in calls):
        raise SystemExit(f"--calls: a comma-separated subset of {', '.join(CALLS)}, got {args.calls!r}")
    backend = cuda_ops.CudaLoraBackend()
    distinct_counts = [int(d) for d in args.distinct.split(",")]
    slots = max(distinct_counts)
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(slots, args.rank, generator) for _ in range(LAYERS)]
    inputs = {name: torch.randn(TOKENS, hidden_in, device="cuda", generator=generator).bfloat16()
              for name, (hidden_in, _) in CALLS.items()}
    bandwidth = copy_bandwidth_bytes_per_us()

    def step(segments, gemm: bool, lora: bool) -> None:
        for layer in layers:
            for name in calls:
                x, widths = inputs[name], CALLS[name][1]
                if gemm:
                    torch.mm(x, layer.weights[name].T)
                if lora:
                    a_offsets, b_offsets, ranks = layer.tables[name]
                    backend.lora_delta_unchecked(x, layer.pool, a_offsets, b_offsets, ranks, segments, args.rank,
                                                 widths)

    rows = []
    for distinct in distinct_counts:
        token_slots = (torch.arange(TOKENS, device="cuda") % distinct).to(torch.int32)
        segments = build_segments(token_slots, slots)
        graphs = {f"{name}_us": capture(lambda g=gemm, l=lora: step(segments, g, l))
                  for name, gemm, lora in (("lora", False, True), ("gemm", True, False), ("both", True, True))}
        row = {"distinct": distinct, **replay_medians_us(graphs, args.reps)}
        row["added_us"] = row["both_us"] - row["gemm_us"]
        row["lora_us_per_call"] = row["lora_us"] / (LAYERS * len(calls))
        row["floor_us"] = lora_floor_bytes(distinct, args.rank, calls) / bandwidth
        rows.append(row)
        print(f"{args.label:11s} {args.calls:20s} distinct {distinct:3d}: LoRA alone {row['lora_us']:7.1f} us "
              f"({row['lora_us_per_call']:5.2f} per call), GEMMs {row['gemm_us']:7.1f}, both {row['both_us']:7.1f}, "
              f"added {row['added_us']:7.1f}, floor {row['floor_us']:6.1f}", flush=True)
        del graphs
    mixed = mixed_step_rows(mixes, args.reps, args.label, args.kernel_times) if mixes else []
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        setup = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "label": args.label, "calls": calls, "layers": LAYERS, "tokens": TOKENS, "rank": args.rank,
                 "copy_bandwidth_tb_s": bandwidth / 1e6}
        setup["mixed"] = {"slots": MIXED_SLOTS, "ranks": list(MIXED_RANKS), "decode_tokens_per_adapter": 2,
                          "prefill_runs": 4}
        args.output.write_text(json.dumps({"setup": setup, "rows": rows, "mixed_rows": mixed}, indent=2) + "\n")


if __name__ == "__main__":
    main()
