"""Time the LoRA op (shrink + expand, bf16) on one GPU against its baselines and the memory floor.

    PYTHONPATH=. python benchmarks/bench_ops.py [--out-dir benchmarks/results]

Each case times, by CUDA-graph replay (median of many replays after warm-up):
  * punica_hf's kernels, "cold": the graph runs the op over several input sets with their own x, y and adapter
    weights (together well over the L2 size), as consecutive layers of a model would; time per op.
  * punica_hf's kernels, "warm": one input set replayed, weights L2-resident where they fit (how the peer numbers
    in ANCHORS.md were likely taken; the cold number is the honest one).
  * gather-BMM: torch, A and B indexed per token, two bmm (cold, like ours; skipped for prefill).
  * the per-adapter loop: the PyTorch reference ops, eager (it syncs, so it cannot be captured).
  * the floor: bytes / device-to-device copy bandwidth measured in the same run, bytes =
    2 * (T*H_in + 2*T*H_out + n_distinct * r * (H_in + H_out)).
Writes bench_ops_h200.json and bench_ops_h200.md to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

HIDDEN_IN = 4096
L2_FLUSH_BYTES = 256 << 20  # the cold graph touches at least this much (L2 of an H200: 60 MB)
MAX_SETS = 512

# Best peer in ANCHORS.md (H200, us): (rank, H_out, case) -> (system, time).
BEST_PEER_US = {
    (16, 4096, "distinct 1"): ("Punica BGMV", 11.5), (16, 4096, "distinct 16"): ("Punica BGMV", 14.3),
    (16, 4096, "distinct 64"): ("Punica BGMV", 21.3), (16, 4096, "distinct 256"): ("Punica BGMV", 53.1),
    (16, 4096, "8 adapters 64"): ("vLLM Triton", 15.5), (16, 4096, "1 adapter 64"): ("vLLM Triton", 13.7),
    (16, 4096, "prefill 16x256"): ("Punica SGMV", 74.5),
    (16, 14336, "distinct 1"): ("Punica BGMV", 11.6), (16, 14336, "distinct 16"): ("Punica BGMV", 18.9),
    (16, 14336, "distinct 64"): ("Punica BGMV", 39.3), (16, 14336, "distinct 256"): ("Punica BGMV", 119.9),
    (16, 14336, "8 adapters 64"): ("vLLM Triton", 21.6), (16, 14336, "1 adapter 64"): ("vLLM Triton", 14.1),
    (16, 14336, "prefill 16x256"): ("Punica SGMV", 152.2),
    (64, 4096, "distinct 1"): ("Punica BGMV", 11.6), (64, 4096, "distinct 16"): ("Punica BGMV", 17.1),
    (64, 4096, "distinct 64"): ("Punica BGMV", 38.6), (64, 4096, "distinct 256"): ("Punica BGMV", 104.4),
    (64, 4096, "8 adapters 64"): ("vLLM Triton", 22.2), (64, 4096, "1 adapter 64"): ("vLLM Triton", 16.2),
    (64, 4096, "prefill 16x256"): ("vLLM Triton", 116.0),
}
# Targets of project issue 3 (us), rank 16: (H_out, case) -> time.
TARGET_US = {
    (4096, "distinct 64"): 12.0, (4096, "distinct 256"): 35.0, (14336, "distinct 64"): 20.0,
    (4096, "prefill 16x256"): 45.0, (4096, "1 adapter 64"): 8.0,
}


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


CASES = [Case(f"distinct {t}", t, t) for t in (1, 16, 64, 256)] + [
    Case("8 adapters 64", 64, 8),
    Case("1 adapter 64", 64, 1),
    Case("prefill 16x256", 16 * 256, 16),
]
SHAPES = [(16, 4096), (16, 14336), (64, 4096)]  # (rank, H_out)


def graph_time_us(fn, replays: int, calls_per_replay: int) -> float:
    """Median time of one `fn` call: `fn` (which makes `calls_per_replay` calls) captured once, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_replay)
    return statistics.median(times)


def eager_time_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_bytes_per_us() -> float:
    """Device-to-device copy of 4 GiB, timed with events: (bytes read + written) per microsecond.

    Large and eager, as the reference figure in ANCHORS.md was taken; a 1 GiB copy in a graph read 2.74 TB/s."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(100):  # ~0.2 s of copies first: the card idles at low clocks
        dst.copy_(src)
    elapsed = eager_time_us(lambda: dst.copy_(src), reps=30)
    return 2 * src.numel() * src.element_size() / elapsed


def run_case(rank: int, hidden_out: int, case: Case, bandwidth: float) -> dict:
    dtype, device = torch.bfloat16, "cuda"
    tokens, adapters = case.num_tokens, case.num_adapters
    set_bytes = 2 * (tokens * HIDDEN_IN + 2 * tokens * hidden_out + adapters * rank * (HIDDEN_IN + hidden_out))
    num_sets = max(1, min(MAX_SETS, math.ceil(L2_FLUSH_BYTES / set_bytes)))
    num_slots = num_sets * adapters
    lora_a = (torch.randn(num_slots, rank, HIDDEN_IN, device=device) * HIDDEN_IN**-0.5).to(dtype)
    lora_b = (torch.randn(num_slots, hidden_out, rank, device=device) * rank**-0.5).to(dtype)
    lora_ranks = torch.full((num_slots,), rank, dtype=torch.int32, device=device)
    xs = torch.randn(num_sets, tokens, HIDDEN_IN, device=device).to(dtype)
    ys = torch.randn(num_sets, tokens, hidden_out, device=device).to(dtype)
    base_slots = case.slots().to(device)
    set_slots = [(base_slots + i * adapters).to(torch.int32) for i in range(num_sets)]
    segments = [build_segments(s, num_slots, "cuda") for s in set_slots]  # grouping not timed, as for the peers

    # Sanity check against the reference on set 0 (the timed kernels must compute the right thing).
    expected = ys[0].float()
    torch_ops.lora_add(expected, xs[0].float(), lora_a.float(), lora_b.float(), lora_ranks,
                       build_segments(set_slots[0], num_slots, "torch"))
    out = ys[0].clone()
    cuda_ops.lora_add(out, xs[0], lora_a, lora_b, lora_ranks, segments[0])
    rel_error = ((out.float() - expected).norm() / (expected - ys[0].float()).norm()).item()

    def ours_cold():
        for i in range(num_sets):
            cuda_ops.lora_add(ys[i], xs[i], lora_a, lora_b, lora_ranks, segments[i])

    warm_calls = 20

    def ours_warm():
        for _ in range(warm_calls):
            cuda_ops.lora_add(ys[0], xs[0], lora_a, lora_b, lora_ranks, segments[0])

    replays = max(10, min(50, int(5e4 / (num_sets + 50))))
    result = {
        "rank": rank, "hidden_in": HIDDEN_IN, "hidden_out": hidden_out, "case": case.name, "tokens": tokens,
        "distinct_adapters": adapters, "input_sets": num_sets, "path": "tiled" if tokens > 256 else "per-token",
        "rel_error_vs_fp32_reference": rel_error,
        "floor_us": set_bytes / bandwidth,
        "ours_cold_us": graph_time_us(ours_cold, replays, num_sets),
        "ours_warm_us": graph_time_us(ours_warm, replays, warm_calls),
    }
    if not case.name.startswith("prefill"):
        slots_long = [s.long() for s in set_slots]

        def gather_bmm():
            for i in range(num_sets):
                v = torch.bmm(lora_a[slots_long[i]], xs[i].unsqueeze(2))  # [T, r, 1]
                ys[i] += torch.bmm(lora_b[slots_long[i]], v).squeeze(2)

        result["gather_bmm_us"] = graph_time_us(gather_bmm, max(10, replays // 4), num_sets)
    reference_segments = build_segments(set_slots[0], num_slots, "torch")
    result["loop_eager_us"] = eager_time_us(
        lambda: torch_ops.lora_add(ys[0], xs[0], lora_a, lora_b, lora_ranks, reference_segments), reps=3)
    peer, peer_us = BEST_PEER_US[(rank, hidden_out, case.name)]
    result.update(best_peer=peer, best_peer_us=peer_us)
    result["target_us"] = TARGET_US.get((hidden_out, case.name)) if rank == 16 else None
    return result


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# punica_hf LoRA op, bf16, {meta['gpu']}",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}; copy bandwidth {meta['copy_bandwidth_tb_s']:.2f} TB/s "
        "(read + write). Times in us, median of CUDA-graph replays. 'ours' = cold (input sets rotated through "
        "more than L2); 'warm' = one set replayed. Peer = best of vLLM Triton / Punica SGMV / BGMV in "
        "ANCHORS.md (other run, same GPU type).",
        "",
        "| shape | case | path | floor | ours | x floor | warm | gather-BMM | loop (eager) | best peer | ours / peer "
        "| target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gather = f"{r['gather_bmm_us']:.1f}" if "gather_bmm_us" in r else "-"
        target = "-"
        if r["target_us"] is not None:
            target = f"{r['target_us']:.0f} ({'met' if r['ours_cold_us'] <= r['target_us'] else 'missed'})"
        lines.append(
            f"| {r['hidden_in']}->{r['rank']}->{r['hidden_out']} | {r['case']} | {r['path']} | {r['floor_us']:.1f} "
            f"| {r['ours_cold_us']:.1f} | {r['ours_cold_us'] / r['floor_us']:.1f} | {r['ours_warm_us']:.1f} "
            f"| {gather} | {r['loop_eager_us']:.0f} | {r['best_peer_us']:.1f} ({r['best_peer']}) "
            f"| {r['ours_cold_us'] / r['best_peer_us']:.2f} | {target} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    cuda_ops.load_extension()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_bytes_per_us()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "copy_bandwidth_tb_s": bandwidth / 1e6,
    }
    results = []
    jobs = [(rank, hidden_out, case) for rank, hidden_out in SHAPES for case in CASES]
    for rank, hidden_out, case in tqdm(jobs, desc="bench_ops"):
        results.append(run_case(rank, hidden_out, case, bandwidth))
        torch.cuda.empty_cache()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_ops_h200.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = markdown(results, meta)
    (out_dir / "bench_ops_h200.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
