"""Time the LoRA op (shrink + expand, bf16, factors in one pool) on one GPU against its baselines and the floor.

    PYTHONPATH=. python benchmarks/bench_ops.py [--out-dir benchmarks/results] [--rep-ms 50] [--profile] [--host]

Timed as ANCHORS.md (the project's peer measurements, kept outside this repository) times the peers: each call captured alone in a CUDA graph and timed with
``triton.testing.do_bench(graph.replay)`` (median; do_bench clears the L2 before every replay, so factors, tables
and activations come from HBM). Per case:
  * punica_hf's kernels as they run by default (at decode sizes on sm_90 one fused cluster kernel where the factor
    slices fit shared memory), and with ``KernelConfig(fused=False)`` (the shrink and expand kernels);
  * gather-BMM: torch, A and B gathered per token from stacked copies of the same factors, two bmm (decode only);
  * the per-adapter loop: the PyTorch reference ops, eager (it syncs, so it cannot be captured);
  * an empty graph (one 1-element kernel) in the same harness: the fixed cost every column carries;
  * the floor: bytes / device-to-device copy bandwidth measured in the same run, bytes =
    2 * (T*H_in + 2*T*H_out + n_distinct * r * (H_in + H_out)).
The best peer of each row (vLLM Triton, Punica SGMV / BGMV) is ANCHORS.md's, same harness, another run: the
gather-BMM column of both runs shows how far the two runs' machines differ. End-to-end rows: the per-layer shapes
of Llama-3-8B decode (32 tokens, rank 16, 32 / 8 / 1 distinct adapters), timed the same way, no peer.
Writes bench_ops_h200.json and bench_ops_h200.md to --out-dir.

``--host`` adds the host (CPU) cost per call, eager: each entry of the op and two plain torch calls for scale,
median over bursts of calls that each start on an idle GPU (see ``host_us_per_call``). ``--host-only`` measures just
that and writes host_us.json (e.g. with PYTHONPATH pointing at another checkout: the code before a change, whose
file ``--host-before`` then shows beside this run's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from punica_hf import ops
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

HIDDEN_IN = 4096  # the peer rows' input size

# The peers' times from ANCHORS.md (the project's peer measurements on an H200 in this harness), the data the
# targets are set against: (rank, H_out, case) -> (best peer, its time in us, gather-BMM time in us).
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
SHAPES = [(16, HIDDEN_IN, 4096), (16, HIDDEN_IN, 14336), (64, HIDDEN_IN, 4096)]  # (rank, H_in, H_out)
# End-to-end rows: Llama-3-8B's projections (q, o; k, v; gate, up; down) in batch-32 decode, rank 16.
E2E_CASES = [Case("distinct 32", 32, 32), Case("8 adapters 32", 32, 8), Case("1 adapter 32", 32, 1)]
E2E_SHAPES = [(16, 4096, 4096), (16, 4096, 1024), (16, 4096, 14336), (16, 14336, 4096)]
HOST_TOKENS = (1, 32)  # host cost per call: decode batches at 4096 -> 16 -> 4096


def graph_us(fn, rep_ms: int) -> float:
    """Median time of `fn` captured alone in a CUDA graph, replays timed by do_bench (L2 cleared before each)."""
    from triton.testing import do_bench  # GPU-only: imported here so the module imports on CPU-only torch

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
            name = next((n for n in ("fused", "shrink") if n in event.key), "expand")
            times[name] = times.get(name, 0.0) + event.device_time_total / calls
    return times


def run_case(rank: int, hidden_in: int, hidden_out: int, case: Case, bandwidth: float, empty_us: float, rep_ms: int,
             profile: bool, end_to_end: bool = False) -> dict:
    """One row. ``end_to_end``: a Llama shape without peer numbers (no gather-BMM, loop or target either)."""
    dtype, device = torch.bfloat16, "cuda"
    tokens, adapters = case.num_tokens, case.num_adapters
    floor_bytes = 2 * (tokens * hidden_in + 2 * tokens * hidden_out + adapters * rank * (hidden_in + hidden_out))
    lora_a = (torch.randn(adapters, rank, hidden_in, device=device) * hidden_in**-0.5).to(dtype)
    lora_b = (torch.randn(adapters, hidden_out, rank, device=device) * rank**-0.5).to(dtype)  # PEFT's [out, r]
    # The store's layout: A [r, in] then Bt [r, out] of each adapter, end to end in one pool.
    pool, offsets = torch_ops.pack_factors([f for s in range(adapters) for f in (lora_a[s], lora_b[s].T)])
    a_offsets = torch.tensor(offsets[0::2], device=device)
    b_offsets = torch.tensor(offsets[1::2], device=device)
    lora_ranks = torch.full((adapters,), rank, dtype=torch.int32, device=device)
    x = torch.randn(tokens, hidden_in, device=device).to(dtype)
    y = torch.randn(tokens, hidden_out, device=device).to(dtype)
    slots = case.slots().to(device=device, dtype=torch.int32)
    segments = build_segments(slots, adapters)  # grouping not timed, as for the peers
    backend = cuda_ops.CudaLoraBackend()
    two_launch_backend = cuda_ops.CudaLoraBackend(ops.KernelConfig(fused=False))

    def ours():
        backend.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, rank)

    def ours_two_launch():  # the shrink and expand kernels, where the fused kernel would run
        two_launch_backend.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, rank)

    # The timed kernels must compute the right thing: against the fp32 reference on the same inputs.
    expected = y.float()
    torch_ops.lora_add(expected, x.float(), pool.float(), a_offsets, b_offsets, lora_ranks,
                       build_segments(slots, adapters), rank)
    out_ref = y.clone()
    backend.lora_add(out_ref, x, pool, a_offsets, b_offsets, lora_ranks, segments, rank)
    rel_error = ((out_ref.float() - expected).norm() / (expected - y.float()).norm()).item()

    result = {
        "rank": rank, "hidden_in": hidden_in, "hidden_out": hidden_out, "case": case.name, "tokens": tokens,
        "distinct_adapters": adapters, "path": "tiled" if tokens > 256 else "per-token",
        "rel_error_vs_fp32_reference": rel_error, "floor_us": floor_bytes / bandwidth, "empty_graph_us": empty_us,
        "ours_us": graph_us(ours, rep_ms),
    }
    result["ours_two_launch_us"] = graph_us(ours_two_launch, rep_ms)
    if profile:
        result["kernel_us"] = kernel_times_us(ours)
    if end_to_end:
        result["end_to_end"] = True
        return result
    if not case.name.startswith("prefill"):
        slots_long = slots.long()

        def gather_bmm():
            v = torch.bmm(lora_a[slots_long], x.unsqueeze(2))  # [T, r, 1]
            y.add_(torch.bmm(lora_b[slots_long], v).squeeze(2))

        result["gather_bmm_us"] = graph_us(gather_bmm, rep_ms)
    reference_segments = build_segments(slots, adapters)
    result["loop_eager_us"] = eager_us(
        lambda: torch_ops.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, reference_segments, rank), reps=3)
    peer, peer_us, anchors_gather_us = ANCHORS_US[(rank, hidden_out, case.name)]
    result.update(best_peer=peer, best_peer_us=peer_us, anchors_gather_bmm_us=anchors_gather_us,
                  target_ratio=case.target, ratio=result["ours_us"] / peer_us)
    result["met"] = result["ratio"] <= case.target
    return result


def host_us_per_call(fn, calls: int = 2000, burst: int = 100) -> float:
    """Host (CPU) microseconds per call of ``fn``, eager: the median over bursts of ``burst`` calls.

    Each burst starts after a synchronize, so the GPU queue is empty and ``burst`` launches of microseconds each
    never fill it: the host clock measures the host's work, never a wait for the GPU."""
    for _ in range(20):
        fn()
    per_call = []
    for _ in range(calls // burst):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        per_call.append((time.perf_counter() - start) / burst * 1e6)
    torch.cuda.synchronize()
    return sorted(per_call)[len(per_call) // 2]


def host_costs(rank: int = 16, hidden: int = 4096) -> list[dict]:
    """Host us per call of each entry of the op (and two plain torch calls) at ``hidden -> rank -> hidden``.

    Entries missing from the imported punica_hf (older code) are left out; the raw op is called by its schema's
    argument names, so older schemas work too."""
    dtype, device = torch.bfloat16, "cuda"
    rows = []
    for tokens in HOST_TOKENS:
        adapters = tokens
        factors = [torch.randn(rank, hidden, device=device, dtype=dtype) * hidden**-0.5 for _ in range(2 * adapters)]
        pool, offsets = torch_ops.pack_factors(factors)
        tables = {
            "a_offsets": torch.tensor(offsets[0::2], device=device),
            "b_offsets": torch.tensor(offsets[1::2], device=device),
            "lora_ranks": torch.full((adapters,), rank, dtype=torch.int32, device=device),
        }
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        y = torch.randn(tokens, hidden, device=device, dtype=dtype)
        weight = torch.randn(hidden, hidden, device=device, dtype=dtype) * hidden**-0.5
        segments = build_segments(torch.arange(tokens, dtype=torch.int32, device=device), adapters)
        args = (y, x, pool, tables["a_offsets"], tables["b_offsets"], tables["lora_ranks"], segments, rank)
        backend = cuda_ops.CudaLoraBackend()
        op = torch.ops.punica_hf.lora_add.default
        named = {"y": y, "x": x, "pool": pool, "max_rank": rank, **tables, **dataclasses.asdict(backend.kernels)}
        named.update({f.name: getattr(segments, f.name) for f in dataclasses.fields(segments)})
        op_args = [named[argument.name] for argument in op._schema.arguments]
        entries = {
            "torch.ops.punica_hf.lora_add (raw op)": lambda: op(*op_args),
            "ops.cuda.lora_add_unchecked": lambda: backend.lora_add_unchecked(*args),
            "ops.cuda.lora_add (checked)": lambda: backend.lora_add(*args),
            "y.add_(x) (reference)": lambda: y.add_(x),
            f"F.linear [{tokens}, {hidden}] x [{hidden}, {hidden}] (reference)":
                lambda: torch.nn.functional.linear(x, weight),
        }
        for name, fn in entries.items():
            if fn is not None:
                rows.append({"tokens": tokens, "entry": name, "host_us": host_us_per_call(fn)})
                print(f"host {tokens:3d} tokens {name:55s} {rows[-1]['host_us']:6.2f} us", flush=True)
    return rows


def _kernel_column(r: dict) -> str:
    kernels = r.get("kernel_us")
    if not kernels:
        return "-"
    if "fused" in kernels:
        return f"{kernels['fused']:.1f} (one launch)"
    return f"{kernels.get('shrink', 0):.1f} / {kernels.get('expand', 0):.1f}"


def markdown(results: list[dict], meta: dict, host: list[dict], host_before: list[dict] | None) -> str:
    peer_rows = [r for r in results if not r.get("end_to_end")]
    met = sum(r["met"] for r in peer_rows)
    lines = [
        f"# punica_hf LoRA op, bf16, {meta['gpu']}",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}; copy bandwidth {meta['copy_bandwidth_tb_s']:.2f} TB/s "
        f"(read + write); empty graph (one 1-element kernel) {meta['empty_graph_us']:.1f} us in the same harness. "
        "Times in us: each call alone in a CUDA graph, `do_bench(graph.replay)` median, L2 cleared before each "
        "replay (ANCHORS.md's harness). 'two launches' = `KernelConfig(fused=False)` (shrink and expand kernels "
        "where the fused cluster kernel runs otherwise). Best peer and its gather-BMM from "
        f"ANCHORS.md (another run). Target: <= {DISTINCT_TARGET}x the best peer on distinct decode, <= 1.0x "
        f"elsewhere; met in {met} of {len(peer_rows)} rows. Kernels: each kernel's device time, eager, L2 cleared "
        "(with PDL the expand's includes waiting for the shrink; one figure where the fused kernel ran).",
        "",
        "| shape | case | path | floor | ours | two launches | gather-BMM (ANCHORS) | loop (eager) | best peer "
        "| ours / peer | target | met | shrink / expand |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in peer_rows:
        gather = "-"
        if "gather_bmm_us" in r:
            gather = f"{r['gather_bmm_us']:.1f} ({r['anchors_gather_bmm_us']:.1f})"
        lines.append(
            f"| {r['hidden_in']}->{r['rank']}->{r['hidden_out']} | {r['case']} | {r['path']} | {r['floor_us']:.1f} "
            f"| {r['ours_us']:.1f} | {r['ours_two_launch_us']:.1f} | {gather} | {r['loop_eager_us']:.0f} "
            f"| {r['best_peer_us']:.1f} ({r['best_peer']}) | {r['ratio']:.2f} | {r['target_ratio']:.1f} "
            f"| {'yes' if r['met'] else 'no'} | {_kernel_column(r)} |"
        )
    e2e_rows = [r for r in results if r.get("end_to_end")]
    if e2e_rows:
        lines += [
            "",
            "End-to-end shapes (Llama-3-8B projections, batch-32 decode, rank 16; no peer target):",
            "",
            "| shape | case | floor | ours | two launches | shrink / expand | rel. error |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['hidden_in']}->{r['rank']}->{r['hidden_out']} | {r['case']} | {r['floor_us']:.1f} "
            f"| {r['ours_us']:.1f} | {r['ours_two_launch_us']:.1f} | {_kernel_column(r)} "
            f"| {r['rel_error_vs_fp32_reference']:.1e} |"
            for r in e2e_rows
        ]
    if host:
        before = {(b["tokens"], b["entry"]): b["host_us"] for b in host_before or []}
        lines += [
            "",
            "Host (CPU) cost per call, eager, 4096 -> 16 -> 4096, median over bursts of 100 calls on an idle GPU"
            + (" ('before': the same measurement of the code before this change)" if before else "") + ":",
            "",
            "| tokens | entry | us per call |" + (" before |" if before else ""),
            "|---|---|---|" + ("---|" if before else ""),
        ]
        for h in host:
            old = before.get((h["tokens"], h["entry"]))
            previous = (f" {old:.2f} |" if old is not None else " - |") if before else ""
            lines.append(f"| {h['tokens']} | {h['entry']} | {h['host_us']:.2f} |{previous}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time per measurement")
    parser.add_argument("--profile", action="store_true", help="also record each kernel's device time (eager)")
    parser.add_argument("--host", action="store_true", help="also measure the host cost per call of each entry")
    parser.add_argument("--host-only", action="store_true", help="measure only the host cost; write host_us.json")
    parser.add_argument("--host-before", help="a host_us.json of the code before a change, shown beside this run's")
    parser.add_argument("--only", default="", help="comma-separated substrings: run the rows whose "
                        "'H_in->r->H_out case' contains one (e.g. 'adapter' for the shared-adapter rows)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda_ops.load_extension()
    torch.manual_seed(0)
    host = host_costs() if args.host or args.host_only else []
    if args.host_only:
        (out_dir / "host_us.json").write_text(json.dumps(host, indent=1))
        return
    host_before = json.loads(Path(args.host_before).read_text()) if args.host_before else None
    bandwidth = copy_bandwidth_bytes_per_us()
    one = torch.zeros(1, device="cuda")
    empty_us = graph_us(lambda: one.add_(1), args.rep_ms)
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "copy_bandwidth_tb_s": bandwidth / 1e6, "empty_graph_us": empty_us,
    }
    plan = [(shape, case, False) for shape in SHAPES for case in CASES]
    plan += [(shape, case, True) for shape in E2E_SHAPES for case in E2E_CASES]
    if args.only:
        wanted = args.only.split(",")
        plan = [(s, c, e) for s, c, e in plan if any(w in f"{s[1]}->{s[0]}->{s[2]} {c.name}" for w in wanted)]
    results = []
    for (rank, hidden_in, hidden_out), case, end_to_end in plan:
        r = run_case(rank, hidden_in, hidden_out, case, bandwidth, empty_us, args.rep_ms, args.profile, end_to_end)
        results.append(r)
        peer = f"peer {r['best_peer_us']:7.1f}" if "best_peer_us" in r else "end-to-end shape"
        kernels = " ".join(f"{k} {v:.1f}" for k, v in r.get("kernel_us", {}).items())
        print(f"{rank:3d} {hidden_in:6d} {hidden_out:6d} {case.name:16s} ours {r['ours_us']:7.1f} "
              f"(two launches {r['ours_two_launch_us']:7.1f}) {peer} {kernels}", flush=True)
        torch.cuda.empty_cache()
    report = {"meta": meta, "results": results, "host": host, "host_before": host_before}
    (out_dir / "bench_ops_h200.json").write_text(json.dumps(report, indent=1))
    table = markdown(results, meta, host, host_before)
    (out_dir / "bench_ops_h200.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
