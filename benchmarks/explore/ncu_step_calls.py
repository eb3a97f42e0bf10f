"""The four LoRA calls of a Llama-3-8B decode step (batch 32, 32 distinct adapters, rank 16), for Nsight Compute.

Each call runs as the compiled step makes it: q/k/v and gate/up as one grouped ``lora_delta`` each, o and down as an
in-place ``lora_add``. Three calls of each named call; profile the third, e.g.

    for call in qkv o gate_up down; do
        ncu --clock-control none --kernel-name regex:fused_chunk --launch-skip 2 --launch-count 1 --set full \\
            python3 benchmarks/explore/ncu_step_calls.py $call > ncu_$call.txt
    done

(benchmarks/results/ncu/ holds the run of 2026-12-03 16:30 UTC, kernels before Bt was read from L2 for wide outputs,
made by an earlier copy of this script that also printed event timings: under ncu those mean nothing.)
"""

from __future__ import annotations

import argparse

import torch

from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

TOKENS, SLOTS, RANK = 32, 32, 16
CALLS = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
         "down": (14336, [4096])}  # name: (H_in, output widths)


def make_call(hidden_in: int, widths: list[int], segments):
    """The call for one projection group, its factors packed in a pool as the adapter store lays them out."""
    factors = [f for width in widths for _ in range(SLOTS)
               for f in (torch.randn(RANK, hidden_in, device="cuda").bfloat16() * 0.01,
                         torch.randn(RANK, width, device="cuda").bfloat16())]
    pool, offsets = torch_ops.pack_factors(factors)
    offsets = torch.tensor(offsets, device="cuda").view(len(widths), SLOTS, 2)
    a_offsets, b_offsets = offsets[..., 0].contiguous(), offsets[..., 1].contiguous()
    ranks = torch.full((len(widths), SLOTS), RANK, dtype=torch.int32, device="cuda")
    x = torch.randn(TOKENS, hidden_in, device="cuda").bfloat16()
    backend = cuda_ops.CudaLoraBackend()
    if len(widths) > 1:
        return lambda: backend.lora_delta_unchecked(x, pool, a_offsets, b_offsets, ranks, segments, RANK, widths)
    y = torch.randn(TOKENS, widths[0], device="cuda").bfloat16()
    return lambda: backend.lora_add_unchecked(y, x, pool, a_offsets[0], b_offsets[0], ranks[0], segments, RANK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", nargs="*", help=f"calls to run, of {list(CALLS)} (default: all)")
    names = parser.parse_args().calls or list(CALLS)
    unknown = set(names) - set(CALLS)
    if unknown:
        parser.error(f"unknown calls {sorted(unknown)}; choose from {list(CALLS)}")
    torch.manual_seed(0)
    slots = torch.arange(TOKENS, dtype=torch.int32, device="cuda") % SLOTS
    segments = build_segments(slots, SLOTS)
    for name in names:
        call = make_call(*CALLS[name], segments)
        for _ in range(3):
            call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
