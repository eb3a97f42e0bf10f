"""Time the paged attention kernel (``ops.paged_attention``, bf16) against SDPA on the same keys and values, dense.

    PYTHONPATH=. python benchmarks/bench_attention.py [--output PATH] [--reps 100] [--splits 1,2,4,8]

Decode: Llama-3-8B's attention (Hq 32, Hkv 8, D 128), one query row per sequence, batch 32 / 64 / 128 / 256 x
k_len 512 / 2048 (all sequences that long), plus ragged rows (k_len uniform in 100..4000). The keys sit in random
pages of 16 slots of one paged cache, as transformers' continuous batching lays them out. The baseline is
``torch.nn.functional.scaled_dot_product_attention`` on the same keys and values gathered into dense
``[B, Hkv, L, D]`` tensors (the gather not timed; ``enable_gqa`` so it reads the same bytes). Prefill rows: one or a
few sequences of q_len = k_len tokens against causal SDPA.

Each call is captured alone in a CUDA graph and replayed after a warm-up; every replay is timed with CUDA events
after a 256 MiB write that evicts the L2 (the keys and values come from HBM), and the median is reported. K/V
bytes = sum of k_len x Hkv x D x 2 bytes x 2 (keys and values), the floor every implementation reads; GB/s is that
over the median time, and ``of_copy_bandwidth`` compares it with a device-to-device copy measured in the same run
(bytes read + written per second). ``--splits`` also times the kernel with forced split counts (``paged_attention``'s
``splits`` argument). Writes JSON to benchmarks/results/bench_attention_h200.json or ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from punica_hf.ops import attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (32, 64, 128, 256)
DECODE_KEYS = (512, 2048)
RAGGED_BATCHES = (64, 256)
PREFILL_CASES = ((1, 512), (1, 2048), (4, 1024))  # (sequences, tokens each)
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "bench_attention_h200.json"


def _events_median_us(fn, reps: int, flush: torch.Tensor) -> float:
    """Median over `reps` timed calls of `fn`, each after an L2-evicting write (not timed)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(fn, reps: int, flush: torch.Tensor) -> float:
    """`fn` captured alone in a CUDA graph (warmed up on a side stream first), replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _events_median_us(graph.replay, reps, flush)


def copy_bandwidth_gbps(flush: torch.Tensor) -> float:
    """Device-to-device copy of 2 GiB (after warm-up copies: the card idles at low clocks): bytes read + written."""
    src = torch.empty(1 << 30, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(20):
        dst.copy_(src)
    elapsed_us = _events_median_us(lambda: dst.copy_(src), 20, flush)
    return 2 * src.numel() * src.element_size() / elapsed_us / 1e3


def paged_batch(q_lens: list[int], k_lens: list[int], gen: torch.Generator):
    """Arguments of one call: keys in random pages of one cache (a few spare pages), queries packed."""
    pages_per_seq = [-(-k // PAGE_SIZE) for k in k_lens]
    num_pages = sum(pages_per_seq) + 8
    pages = torch.randperm(num_pages, generator=gen)
    slots, next_page = [], 0
    for k_len, count in zip(k_lens, pages_per_seq):
        seq_pages = pages[next_page : next_page + count]
        slots.append((seq_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()[:k_len])
        next_page += count
    shape = (num_pages * PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    value_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    key_slots = torch.cat(slots).to(device="cuda", dtype=torch.int32)
    return query, key_cache, value_cache, key_slots, cu_q, cu_k, HEAD_DIM**-0.5


def sdpa(query, keys, values, causal: bool = False, mask: torch.Tensor | None = None):
    """SDPA on dense [B, H, L, D] tensors; GQA without copying the kv heads where torch supports it."""
    try:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        group = query.shape[1] // keys.shape[1]
        return F.scaled_dot_product_attention(query, keys.repeat_interleave(group, 1),
                                              values.repeat_interleave(group, 1), attn_mask=mask, is_causal=causal)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def time_ours(args, reps: int, flush: torch.Tensor, forced_splits: list[int]) -> dict:
    result = {"ours_us": graph_us(lambda: attention.paged_attention_cuda(*args), reps, flush)}
    for splits in forced_splits:
        result[f"ours_splits_{splits}_us"] = graph_us(
            lambda: attention.paged_attention_cuda(*args, splits=splits), reps, flush)
    return result


def decode_row(batch: int, k_lens: list[int], label: str, reps: int, flush: torch.Tensor, copy_gbps: float,
               forced_splits: list[int], gen: torch.Generator) -> dict:
    args = paged_batch([1] * batch, k_lens, gen)
    query, key_cache, value_cache, key_slots, _, cu_k, _ = args
    kv_bytes = 2 * sum(k_lens) * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    # Dense copies for SDPA ([B, Hkv, L, D], L = the longest row; shorter rows masked), built once, not timed.
    longest = max(k_lens)
    starts = cu_k[:-1].tolist()
    dense_keys = torch.zeros(batch, NUM_KV_HEADS, longest, HEAD_DIM, device="cuda", dtype=DTYPE)
    dense_values = torch.zeros_like(dense_keys)
    for b, (start, k_len) in enumerate(zip(starts, k_lens)):
        slots = key_slots[start : start + k_len].long()
        dense_keys[b, :, :k_len] = key_cache[slots].transpose(0, 1)
        dense_values[b, :, :k_len] = value_cache[slots].transpose(0, 1)
    dense_query = query.view(batch, 1, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)  # [B, Hq, 1, D]
    ragged = len(set(k_lens)) > 1
    mask = None
    if ragged:  # each row sees its own keys only
        mask = torch.arange(longest, device="cuda")[None, :] < torch.tensor(k_lens, device="cuda")[:, None]
        mask = mask[:, None, None, :]  # [B, 1, 1, L]

    def baseline():
        return sdpa(dense_query, dense_keys, dense_values, mask=mask)

    expected = baseline().transpose(1, 2).reshape(batch, NUM_Q_HEADS, HEAD_DIM)
    error = relative_error(attention.paged_attention_cuda(*args), expected)
    row = {"case": label, "batch": batch, "k_len": k_lens[0] if not ragged else "100..4000",
           "total_keys": sum(k_lens), "kv_bytes": kv_bytes, "rel_error_vs_sdpa": error}
    row.update(time_ours(args, reps, flush, forced_splits))
    row["sdpa_us"] = graph_us(baseline, reps, flush)
    row["sdpa_note"] = "padded to the longest row, masked" if ragged else "dense"
    row["ours_GBps"] = kv_bytes / row["ours_us"] / 1e3
    row["ours_of_copy_bandwidth"] = row["ours_GBps"] / copy_gbps
    row["sdpa_GBps"] = kv_bytes / row["sdpa_us"] / 1e3
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ours_us"]
    return row


def prefill_row(num_seqs: int, tokens: int, reps: int, flush: torch.Tensor, forced_splits: list[int],
                gen: torch.Generator) -> dict:
    args = paged_batch([tokens] * num_seqs, [tokens] * num_seqs, gen)
    query, key_cache, value_cache, key_slots, _, _, _ = args
    slots = key_slots.long().view(num_seqs, tokens)
    dense_keys = key_cache[slots].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
    dense_values = value_cache[slots].permute(0, 2, 1, 3).contiguous()
    dense_query = query.view(num_seqs, tokens, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def baseline():
        return sdpa(dense_query, dense_keys, dense_values, causal=True)

    expected = baseline().transpose(1, 2).reshape(num_seqs * tokens, NUM_Q_HEADS, HEAD_DIM)
    row = {"case": "prefill", "sequences": num_seqs, "tokens_each": tokens,
           "rel_error_vs_sdpa": relative_error(attention.paged_attention_cuda(*args), expected)}
    row.update(time_ours(args, reps, flush, forced_splits))
    row["sdpa_us"] = graph_us(baseline, reps, flush)
    flops = 4 * num_seqs * NUM_Q_HEADS * HEAD_DIM * tokens * (tokens + 1) / 2  # causal: QK^T and PV
    row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
    row["sdpa_TFLOPs"] = flops / row["sdpa_us"] / 1e6
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ours_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    parser.add_argument("--reps", type=int, default=100, help="timed replays per measurement")
    parser.add_argument("--splits", default="", help="comma-separated split counts to time as well (forced)")
    parser.add_argument("--no-prefill", action="store_true", help="decode rows only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured")
    forced_splits = [int(s) for s in args.splits.split(",") if s.strip()]
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_gbps = copy_bandwidth_gbps(flush)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")

    decode = []
    for k_len in DECODE_KEYS:
        for batch in DECODE_BATCHES:
            decode.append(decode_row(batch, [k_len] * batch, "decode", args.reps, flush, copy_gbps, forced_splits,
                                     gen))
    for batch in RAGGED_BATCHES:
        k_lens = torch.randint(100, 4001, (batch,), generator=gen).tolist()
        decode.append(decode_row(batch, k_lens, "decode ragged", args.reps, flush, copy_gbps, forced_splits, gen))
    print(f"{'case':<14}{'batch':>6}{'k_len':>11}{'ours us':>10}{'GB/s':>8}{'of copy':>9}{'sdpa us':>10}"
          f"{'speedup':>9}{'rel err':>10}")
    for row in decode:
        print(f"{row['case']:<14}{row['batch']:>6}{row['k_len']!s:>11}{row['ours_us']:>10.1f}{row['ours_GBps']:>8.0f}"
              f"{row['ours_of_copy_bandwidth']:>9.2f}{row['sdpa_us']:>10.1f}{row['speedup_vs_sdpa']:>9.2f}"
              f"{row['rel_error_vs_sdpa']:>10.1e}")

    prefill = []
    if not args.no_prefill:
        for num_seqs, tokens in PREFILL_CASES:
            prefill.append(prefill_row(num_seqs, tokens, args.reps, flush, forced_splits, gen))
        for row in prefill:
            print(f"prefill {row['sequences']} x {row['tokens_each']}: ours {row['ours_us']:.1f} us "
                  f"({row['ours_TFLOPs']:.1f} TFLOP/s), sdpa {row['sdpa_us']:.1f} us, rel err "
                  f"{row['rel_error_vs_sdpa']:.1e}")

    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(DTYPE),
        "num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
        "copy_bandwidth_GBps": copy_gbps, "reps": args.reps, "decode": decode, "prefill": prefill,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
