"""Pure-PyTorch LoRA ops: the CPU path, and the reference the CUDA kernels are tested against.

One matmul pair per adapter present in the batch (a loop over segments). Exact in the accumulation dtype
(float32, or float64 for float64 inputs) and cheap on memory; it reads segment boundaries on the host, so
on a GPU it synchronises once per call and cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .segments import LoraSegments


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
) -> None:
    """``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for every token ``t`` with slot ``s >= 0``, in place.

    Shapes: ``y`` ``[T, H_out]``, ``x`` ``[T, H_in]``, ``lora_a_stacked`` ``[S, R, H_in]``,
    ``lora_b_stacked`` ``[S, H_out, R]`` (scaling already folded in), ``lora_ranks`` ``[S]`` int32 (rank of each
    slot in this layer, 0 = slot unused here; rows/columns past the rank are zero and skipped).
    """
    acc = _accumulation_dtype(x.dtype)
    starts = segments.segment_starts.tolist()
    ranks = lora_ranks.tolist()
    for g, slot in enumerate(segments.segment_slots.tolist()):
        if slot < 0:
            break
        rank = ranks[slot]
        if rank == 0:
            continue
        token_ids = segments.sorted_token_ids[starts[g] : starts[g + 1]].long()
        v = x[token_ids].to(acc) @ lora_a_stacked[slot, :rank].to(acc).T
        delta = v @ lora_b_stacked[slot, :, :rank].to(acc).T
        y[token_ids] = (y[token_ids].to(acc) + delta).to(y.dtype)
