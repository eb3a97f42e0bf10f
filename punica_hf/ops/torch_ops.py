"""Pure-PyTorch LoRA ops: the CPU path, and the reference the CUDA kernels are tested against.

The factors live in one flat pool per device (the op contract): slot ``s`` of rank ``r > 0`` has
``A_s = pool[a_offsets[s] : + r * H_in].view(r, H_in)`` and ``Bt_s = pool[b_offsets[s] : + r * H_out].view(r, H_out)``
(LoRA B transposed, scaling folded in), so memory is exactly ``r * (H_in + H_out)`` elements per adapter and layer.
``pack_factors`` lays factors out that way (tests, benchmarks).

One matmul pair per adapter present in the batch (a loop over the runs of one slot in the sorted tokens), exact in
the accumulation dtype (float32, or float64 for float64 inputs). It reads those runs, the ranks and the offsets on
the host, so on a GPU it synchronises once per call and cannot be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .segments import LoraSegments

POOL_ALIGNMENT = 64  # elements: every factor starts at a multiple (128 bytes in bf16), so its rows are 16-byte aligned


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def factor_view(pool: torch.Tensor, offset: int, rank: int, hidden: int) -> torch.Tensor:
    """The ``[rank, hidden]`` factor starting at element ``offset`` of the 1-D ``pool`` (a view, no copy)."""
    if offset < 0 or offset + rank * hidden > pool.numel():
        raise ValueError(f"factor [{rank}, {hidden}] at offset {offset} runs outside the pool of {pool.numel()}")
    return pool[offset : offset + rank * hidden].view(rank, hidden)


def pack_factors(
    factors: Sequence[torch.Tensor], gaps: Sequence[int] | None = None, fill: float = 0.0
) -> tuple[torch.Tensor, list[int]]:
    """Lay 2-D factors end to end in a new 1-D pool, each at a multiple of ``POOL_ALIGNMENT`` elements.

    ``factors``: ``[rows_i, cols_i]`` tensors of one dtype and device, in pool order. ``gaps``: elements left
    free before each factor (rounded up to the alignment), none by default. Free elements hold ``fill``.
    Returns the pool ``[P]`` and the element offset of each factor.
    """
    if not factors:
        raise ValueError("pack_factors needs at least one factor")
    gaps = [0] * len(factors) if gaps is None else list(gaps)
    if len(gaps) != len(factors):
        raise ValueError(f"got {len(gaps)} gaps for {len(factors)} factors")

    def aligned(n: int) -> int:
        return -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT

    offsets, end = [], 0
    for factor, gap in zip(factors, gaps):
        offsets.append(aligned(end + gap))
        end = offsets[-1] + factor.numel()
    pool = torch.full((aligned(end),), fill, dtype=factors[0].dtype, device=factors[0].device)
    for factor, offset in zip(factors, offsets):
        pool[offset : offset + factor.numel()] = factor.reshape(-1)
    return pool, offsets


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
    max_rank: int,
) -> None:
    """``y[t] += Bt_s^T @ (A_s @ x[t])`` for every token ``t`` whose slot ``s >= 0`` has rank > 0, in place.

    Shapes: ``y`` ``[T, H_out]``, ``x`` ``[T, H_in]``, ``pool`` ``[P]``, ``a_offsets`` / ``b_offsets`` ``[S]``
    int64 element offsets into ``pool``, ``lora_ranks`` ``[S]`` int32 (0 = slot unused in this layer: its offsets
    are never read), ``max_rank`` the bound of every rank.
    """
    acc = _accumulation_dtype(x.dtype)
    hidden_in, hidden_out = x.shape[1], y.shape[1]
    # The runs of equal slots in the sorted positions, read on the host (this is what makes the reference sync).
    run_slots, run_lengths = torch.unique_consecutive(segments.sorted_slots, return_counts=True)
    ranks = lora_ranks.tolist()
    a_offsets_host, b_offsets_host = a_offsets.tolist(), b_offsets.tolist()
    start = 0
    for slot, length in zip(run_slots.tolist(), run_lengths.tolist()):
        run = segments.sorted_token_ids[start : start + length]
        start += length
        if slot < 0:
            break  # tokens without an adapter come last
        rank = ranks[slot]
        if rank == 0:
            continue
        if not 0 < rank <= max_rank:
            raise ValueError(f"lora_add: slot {slot} has rank {rank}, outside [0, max_rank={max_rank}]")
        lora_a = factor_view(pool, a_offsets_host[slot], rank, hidden_in)
        lora_bt = factor_view(pool, b_offsets_host[slot], rank, hidden_out)
        token_ids = run.long()
        delta = (x[token_ids].to(acc) @ lora_a.to(acc).T) @ lora_bt.to(acc)
        y[token_ids] = (y[token_ids].to(acc) + delta).to(y.dtype)


def lora_delta(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
    max_rank: int,
    out_features: Sequence[int],
) -> torch.Tensor:
    """The LoRA updates of ``G = len(out_features)`` projections sharing ``x`` ``[T, H_in]``, side by side.

    Tables ``[G, S]``: row ``g`` belongs to projection ``g``, whose update fills columns
    ``[sum(out_features[:g]), + out_features[g])`` of the returned ``[T, sum(out_features)]`` tensor (``x``'s
    dtype; zero for tokens without an adapter or of rank 0 there).
    """
    delta = x.new_zeros(x.shape[0], sum(out_features))
    first = 0
    for g, width in enumerate(out_features):
        lora_add(delta[:, first : first + width], x, pool, a_offsets[g], b_offsets[g], lora_ranks[g], segments,
                 max_rank)
        first += width
    return delta


class TorchLoraBackend:
    """The PyTorch reference as a LoRA backend (``ops.backend_for``): any device, dtype and size; syncs per call.

    ``lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)`` and ``lora_delta(x, pool,
    a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)`` are this module's functions (shapes
    there).
    """

    name = "torch"
    lora_add = staticmethod(lora_add)
    lora_delta = staticmethod(lora_delta)

    def takes_unchecked(self, dtype: torch.dtype, in_features: int, out_features: int, max_rank: int) -> bool:
        """False: the reference has no unchecked entries (its host loop costs far more than any check)."""
        return False

    def __str__(self) -> str:
        return self.name
