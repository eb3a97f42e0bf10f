"""Time the LoRA op (shrink + expand, bf16, factors in one pool) on one GPU against its baselines and the floor.

    PYTHONPATH=. python benchmarks/bench_ops.py [--out-dir benchmarks/results] [--rep-ms 50]

Timed as /work/shared/ANCHORS.md times the peers: each call captured alone in a CUDA graph and timed with
``triton.testing.do_bench(graph.replay)`` (median; do_bench clears the L2 before every replay, so factors, tables
and activations come from HBM). Per case:
  * punica_hf's kernels, with the expand as a programmatic dependent launch (default), and without (PDL off);
  * gather-BMM: torch, A and B gathered per token from stacked copies of the same factors, two bmm (decode only);
  * the per-adapter loop: the PyTorch reference ops, eager (it syncs, so it cannot be captured);
  * an empty graph (one 1-element kernel) in the same harness: the fixed cost every column carries;
  * the floor: bytes / device-to-device copy bandwidth measured in the same run, bytes =
    2 * (T*H_in + 2*T*H_out + n_distinct * r * (H_in + H_out)).
The best peer of each row (vLLM Triton, Punica SGMV / BGMV) is ANCHORS.md's, same harness, another run: the
gather-BMM column of both runs shows how far the two runs' machines differ.
Writes bench_ops_h200.json and bench_ops_h200.md to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.testing import do_bench

from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

HIDDEN_IN = 4096

# ANCHORS.md (H200, 2026-12-02, graph + do_bench): (rank, H_out, case) -> (best peer, its time, gather-BMM time).
ANCHORS_US = {
    (16, 4096, "distinct 1"): ("Punica BGMV", 12.0, 25.0),
    (16, 4096, "distinct 16"): ("Punica BGMV", 14.6, 26.0),
    (16, 4096, "distinct 64"): ("Punica BGMV", 21.6, 47.5),
    (16, 4096, "distinct 256"): ("Punica BGMV", 54.1, 96.3),
    (16, 4096, "8 adapters 64"): ("vLLM Triton", 16.1, 43.6),
    (16, 4096, "1 adapter 64"): ("vLLM Triton", 14.2, 42.8),
    (16, 4096, "prefill 16x256"): ("Punica SGMV", 76.1, None),
    (16, 14336, "distinct 1"): ("Punica BGMV", 11.7, 25.4),
    (16, 14336, "distinct 16"): ("Punica BGMV", 19.0, 35.0),
    (16, 14336, "distinct 64"): ("Punica BGMV", 39.6, 69.6),
    (16, 14336, "distinct 256"): ("Punica BGMV", 121.0, 190.6),
    (16, 14336, "8 adapters 64"): ("vLLM Triton", 22.1, 62.3),
    (16, 14336, "1 adapter 64"): ("vLLM Triton", 14.3, 60.8),
    (16, 14336, "prefill 16x256"): ("Punica SGMV", 153.4, None),
    (64, 4096, "distinct 1"): ("Punica BGMV", 12.4, 25.8),
    (64, 4096, "distinct 16"): ("Punica BGMV", 17.3, 41.2),
    (64, 4096, "distinct 64"): ("Punica BGMV", 38.8, 66.0),
    (64, 4096, "distinct 256"): ("Punica BGMV", 105.3, 226.3),
    (64, 4096, "8 adapters 64"): ("vLLM Triton", 22.6, 50.8),
    (64, 4096, "1 adapter 64"): ("vLLM Triton", 16.5, 49.2),
    (64, 4096, "prefill 16x256"): ("vLLM Triton", 116.8, None),
}
DISTINCT_TARGET = 0.8  # project issue 10: <= 0.8x the best peer on distinct-adapter decode, <= 1.0x elsewhere


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_adapters: int  # distinct adapters in the batch

    def slots(self) -> torch.Tensor:
        """[T] slot of each token, in 0 .. num_adapters - 1."""
        if self.name.startswith("prefill"):  # 16 requests of 256 tokens, one adapter each
            return torch.arange(self.num_tokens) // (self.num_tokens // self.num_adapters)
        return torch.arange(self.num_tokens) % self.num_adapters  # tokens interleaved over adapters

    @property
    def target(self) -> float:
        return DISTINCT_TARGET if self.name.startswith("distinct") else 1.0


CASES = [Case(f"distinct {t}", t, t) for t in (1, 16, 64, 256)] + [
    Case("8 adapters 64", 64, 8),
    Case("1 adapter 64", 64, 1),
    Case("prefill 16x256", 16 * 256, 16),
]
SHAPES = [(16, 4096), (16, 14336), (64, 4096)]  # (rank, H_out)


def graph_us(fn, rep_ms: int) -> float:
    """Median time of `fn` captured alone in a CUDA graph, replays timed by do_bench (L2 cleared before each)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy init)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def eager_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_bytes_per_us() -> float:
    """Device-to-device copy of 4 GiB after ~0.2 s of copies (the card idles at low clocks): bytes read + written."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(100):
        dst.copy_(src)
    elapsed = eager_us(lambda: dst.copy_(src), reps=30)
    return 2 * src.numel() * src.element_size() / elapsed


def kernel_times_us(fn, calls: int = 10) -> dict[str, float]:
    """Mean device time of each kernel `fn` launches, eager, L2 cleared before each call (torch.profiler).

    With PDL the expand starts while the shrink runs, so its time includes waiting for the shrink."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if "punica" in event.key:
            name = "shrink" if "shrink" in event.key else "expand"
            times[name] = times.get(name, 0.0) + event.device_time_total / calls
    return times


def run_case(rank: int, hidden_out: int, case: Case, bandwidth: float, empty_us: float, rep_ms: int,
             profile: bool) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    tokens, adapters = case.num_tokens, case.num_adapters
    floor_bytes = 2 * (tokens * HIDDEN_IN + 2 * tokens * hidden_out + adapters * rank * (HIDDEN_IN + hidden_out))
    lora_a = (torch.randn(adapters, rank, HIDDEN_IN, device=device) * HIDDEN_IN**-0.5).to(dtype)
    lora_b = (torch.randn(adapters, hidden_out, rank, device=device) * rank**-0.5).to(dtype)  # PEFT's [out, r]
    # The store's layout: A [r, in] then Bt [r, out] of each adapter, end to end in one pool.
    pool, offsets = torch_ops.pack_factors([f for s in range(adapters) for f in (lora_a[s], lora_b[s].T)])
    a_offsets = torch.tensor(offsets[0::2], device=device)
    b_offsets = torch.tensor(offsets[1::2], device=device)
    lora_ranks = torch.full((adapters,), rank, dtype=torch.int32, device=device)
    x = torch.randn(tokens, HIDDEN_IN, device=device).to(dtype)
    y = torch.randn(tokens, hidden_out, device=device).to(dtype)
    slots = case.slots().to(device=device, dtype=torch.int32)
    segments = build_segments(slots, adapters, "cuda")  # grouping not timed, as for the peers

    def ours():
        cuda_ops.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, rank)

    # The timed kernels must compute the right thing: against the fp32 reference on the same inputs.
    expected = y.float()
    torch_ops.lora_add(expected, x.float(), pool.float(), a_offsets, b_offsets, lora_ranks,
                       build_segments(slots, adapters, "torch"), rank)
    out_ref = y.clone()
    cuda_ops.lora_add(out_ref, x, pool, a_offsets, b_offsets, lora_ranks, segments, rank)
    rel_error = ((out_ref.float() - expected).norm() / (expected - y.float()).norm()).item()

    result = {
        "rank": rank, "hidden_in": HIDDEN_IN, "hidden_out": hidden_out, "case": case.name, "tokens": tokens,
        "distinct_adapters": adapters, "path": "tiled" if tokens > 256 else "per-token",
        "rel_error_vs_fp32_reference": rel_error, "floor_us": floor_bytes / bandwidth, "empty_graph_us": empty_us,
        "ours_us": graph_us(ours, rep_ms),
    }
    os.environ["PUNICA_HF_PDL"] = "0"
    try:
        result["ours_no_pdl_us"] = graph_us(ours, rep_ms)
    finally:
        del os.environ["PUNICA_HF_PDL"]
    if not case.name.startswith("prefill"):
        slots_long = slots.long()

        def gather_bmm():
            v = torch.bmm(lora_a[slots_long], x.unsqueeze(2))  # [T, r, 1]
            y.add_(torch.bmm(lora_b[slots_long], v).squeeze(2))

        result["gather_bmm_us"] = graph_us(gather_bmm, rep_ms)
    if profile:
        result["kernel_us"] = kernel_times_us(ours)
    reference_segments = build_segments(slots, adapters, "torch")
    result["loop_eager_us"] = eager_us(
        lambda: torch_ops.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, reference_segments, rank), reps=3)
    peer, peer_us, anchors_gather_us = ANCHORS_US[(rank, hidden_out, case.name)]
    result.update(best_peer=peer, best_peer_us=peer_us, anchors_gather_bmm_us=anchors_gather_us,
                  target_ratio=case.target, ratio=result["ours_us"] / peer_us)
    result["met"] = result["ratio"] <= case.target
    return result


def markdown(results: list[dict], meta: dict) -> str:
    met = sum(r["met"] for r in results)
    lines = [
        f"# punica_hf LoRA op, bf16, {meta['gpu']}",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}; copy bandwidth {meta['copy_bandwidth_tb_s']:.2f} TB/s "
        f"(read + write); empty graph (one 1-element kernel) {meta['empty_graph_us']:.1f} us in the same harness. "
        "Times in us: each call alone in a CUDA graph, `do_bench(graph.replay)` median, L2 cleared before each "
        "replay (ANCHORS.md's harness). 'no PDL' = expand launched plainly. Best peer and its gather-BMM from "
        f"ANCHORS.md (another run). Target: <= {DISTINCT_TARGET}x the best peer on distinct decode, <= 1.0x "
        f"elsewhere; met in {met} of {len(results)} rows.",
        "",
        "| shape | case | path | floor | ours | no PDL | gather-BMM (ANCHORS) | loop (eager) | best peer "
        "| ours / peer | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gather = "-"
        if "gather_bmm_us" in r:
            gather = f"{r['gather_bmm_us']:.1f} ({r['anchors_gather_bmm_us']:.1f})"
        lines.append(
            f"| {r['hidden_in']}->{r['rank']}->{r['hidden_out']} | {r['case']} | {r['path']} | {r['floor_us']:.1f} "
            f"| {r['ours_us']:.1f} | {r['ours_no_pdl_us']:.1f} | {gather} | {r['loop_eager_us']:.0f} "
            f"| {r['best_peer_us']:.1f} ({r['best_peer']}) | {r['ratio']:.2f} | {r['target_ratio']:.1f} "
            f"| {'yes' if r['met'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time per measurement")
    parser.add_argument("--profile", action="store_true", help="also record each kernel's device time (eager)")
    args = parser.parse_args()
    cuda_ops.load_extension()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_bytes_per_us()
    one = torch.zeros(1, device="cuda")
    empty_us = graph_us(lambda: one.add_(1), args.rep_ms)
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "copy_bandwidth_tb_s": bandwidth / 1e6, "empty_graph_us": empty_us,
    }
    results = []
    for rank, hidden_out in SHAPES:
        for case in CASES:
            r = run_case(rank, hidden_out, case, bandwidth, empty_us, args.rep_ms, args.profile)
            results.append(r)
            kernels = " ".join(f"{k} {v:.1f}" for k, v in r.get("kernel_us", {}).items())
            print(f"{rank:3d} {hidden_out:6d} {case.name:16s} ours {r['ours_us']:7.1f} "
                  f"(no PDL {r['ours_no_pdl_us']:7.1f}) peer {r['best_peer_us']:7.1f} {kernels}", flush=True)
            torch.cuda.empty_cache()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_ops_h200.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = markdown(results, meta)
    (out_dir / "bench_ops_h200.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
