"""The per-forward segment metadata, the pool layout, and the PyTorch reference op against per-token float64 math."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from punica_hf import ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments


def _random_slots(num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-1, num_slots, (num_tokens,), generator=generator)


@pytest.mark.parametrize("num_tokens,num_slots", [(1, 1), (1, 5), (7, 3), (40, 8), (64, 64), (3, 50)])
def test_segments_group_every_token_with_its_slot(num_tokens, num_slots):
    generator = torch.Generator().manual_seed(num_tokens * 100 + num_slots)
    slots = _random_slots(num_tokens, num_slots, generator)
    segments = build_segments(slots, num_slots, backend="torch")

    num_segments = min(num_tokens, num_slots)
    assert segments.segment_slots.shape == (num_segments,)
    assert segments.segment_starts.shape == (num_segments + 1,)
    assert sorted(segments.sorted_token_ids.tolist()) == list(range(num_tokens))
    assert segments.sorted_slots.dtype == torch.int32
    assert segments.sorted_slots.tolist() == slots[segments.sorted_token_ids.long()].tolist()

    present = sorted(set(slots.tolist()) - {-1})
    segment_slots = segments.segment_slots.tolist()
    assert segment_slots[: len(present)] == present
    assert all(s == -1 for s in segment_slots[len(present) :])
    starts = segments.segment_starts.tolist()
    assert starts[0] == 0 and starts == sorted(starts)
    for g, slot in enumerate(present):
        token_ids = segments.sorted_token_ids[starts[g] : starts[g + 1]].tolist()
        assert token_ids == sorted(token_ids), "the sort must be stable"
        assert token_ids == [t for t in range(num_tokens) if slots[t] == slot]
    assert starts[len(present)] == (slots >= 0).sum().item()  # tokens without adapter come after all segments
    assert all(start == starts[len(present)] for start in starts[len(present) :])


def test_segments_split_positions_by_the_size_of_their_run():
    """A mixed step: one slot's long prefill, single decode tokens of many slots, a run of exactly the threshold,
    base tokens. Positions of runs above ``SHORT_RUN_TOKENS`` keep their slot in ``long_run_slots`` only, the
    others in ``short_run_slots`` only, base tokens in neither."""
    from punica_hf.ops.segments import SHORT_RUN_TOKENS

    slots = torch.tensor([5] * 300 + list(range(10, 30)) + [7] * SHORT_RUN_TOKENS + [-1] * 9 + [9] * (SHORT_RUN_TOKENS + 1))
    slots = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(0))]
    segments = build_segments(slots, 32, backend="torch")
    sorted_slots = segments.sorted_slots.tolist()
    long_run, short_run = segments.long_run_slots.tolist(), segments.short_run_slots.tolist()
    for slot, long_slot, short_slot in zip(sorted_slots, long_run, short_run):
        is_long = slot in (5, 9)
        assert long_slot == (slot if is_long else -1) and short_slot == (-1 if is_long else slot)
    assert segments.long_run_slots.dtype == segments.short_run_slots.dtype == torch.int32


def test_segments_to_moves_every_tensor_and_sets_the_backend():
    segments = build_segments(torch.tensor([2, -1, 0, 2]), 3, backend="cuda")
    moved = segments.to(torch.device("cpu"), backend="torch")
    assert moved.backend == "torch" and moved.num_slots == 3
    for field in dataclasses.fields(segments):
        value = getattr(segments, field.name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(moved, field.name), value), field.name
            assert getattr(moved, field.name).device == torch.device("cpu"), field.name


def test_pack_factors_aligns_and_keeps_every_factor():
    generator = torch.Generator().manual_seed(0)
    factors = [torch.randn(rows, cols, generator=generator) for rows, cols in [(3, 40), (1, 8), (5, 24)]]
    pool, offsets = torch_ops.pack_factors(factors, gaps=[0, 70, 1], fill=float("nan"))
    assert all(offset % torch_ops.POOL_ALIGNMENT == 0 for offset in offsets)
    assert offsets[1] >= offsets[0] + factors[0].numel() + 70 and offsets[2] >= offsets[1] + factors[1].numel() + 1
    for factor, offset in zip(factors, offsets):
        assert torch.equal(torch_ops.factor_view(pool, offset, *factor.shape), factor)
    assert pool.isnan().sum() == pool.numel() - sum(f.numel() for f in factors)
    with pytest.raises(ValueError, match="outside the pool"):
        torch_ops.factor_view(pool, offsets[2], 6, 24)


def _pool_problem(ranks: list[int], hidden_in: int, hidden_out: int, dtype: torch.dtype, generator: torch.Generator):
    """Dense factors per slot (A [r, in], B [out, r]) and the same factors in one NaN-filled pool.

    Factors go in random order with random gaps between them; slots of rank 0 get offsets into a NaN block at the
    pool's end (a read through them would show up as NaN). Returns (dense A list, dense B list, pool, a_offsets,
    b_offsets), offsets as int64 tensors.
    """
    lora_a = [torch.randn(r, hidden_in, generator=generator).to(dtype) for r in ranks]
    lora_b = [torch.randn(hidden_out, r, generator=generator).to(dtype) for r in ranks]
    factors = [f for r, a, b in zip(ranks, lora_a, lora_b) if r > 0 for f in (a, b.T)]
    order = torch.randperm(len(factors), generator=generator).tolist()
    nan_block = torch.full((1, torch_ops.POOL_ALIGNMENT), float("nan"), dtype=dtype)
    gaps = torch.randint(0, 3 * torch_ops.POOL_ALIGNMENT, (len(factors) + 1,), generator=generator).tolist()
    pool, placed = torch_ops.pack_factors([factors[i] for i in order] + [nan_block], gaps, fill=float("nan"))
    offsets = [0] * len(factors)
    for position, i in enumerate(order):
        offsets[i] = placed[position]
    a_offsets, b_offsets, next_factor = [], [], 0
    for r in ranks:
        if r > 0:
            a_offsets.append(offsets[next_factor])
            b_offsets.append(offsets[next_factor + 1])
            next_factor += 2
        else:
            a_offsets.append(placed[-1])
            b_offsets.append(placed[-1])
    return lora_a, lora_b, pool, torch.tensor(a_offsets), torch.tensor(b_offsets)


def _per_token_reference(y, x, lora_a, lora_b, ranks, slots):
    """float64, one token at a time, from the dense factors: the definition."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0 and ranks[slot] > 0:
            out[t] += lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double())
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_torch_lora_add_matches_per_token_math(dtype, tolerance, num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    ranks, max_rank, h_in, h_out = [8, 0, 3, 5, 0, 1], 8, 24, 40
    lora_a, lora_b, pool, a_offsets, b_offsets = _pool_problem(ranks, h_in, h_out, dtype, generator)
    x = torch.randn(num_tokens, h_in, generator=generator).to(dtype)
    y = torch.randn(num_tokens, h_out, generator=generator).to(dtype)
    slots = _random_slots(num_tokens, len(ranks), generator)
    lora_ranks = torch.tensor(ranks, dtype=torch.int32)

    expected = _per_token_reference(y, x, lora_a, lora_b, ranks, slots)
    out = y.clone()
    segments = build_segments(slots, len(ranks), backend="torch")
    torch_ops.lora_add(out, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)

    assert torch.isfinite(out).all(), "a read outside the adapters' factors (NaN) reached the output"
    error = (out.double() - expected).norm() / expected.norm()
    assert error < tolerance
    no_adapter = (slots < 0) | (lora_ranks[slots.clamp(min=0)] == 0)
    assert torch.equal(out[no_adapter], y[no_adapter]), "rows without an adapter must stay untouched"


def test_torch_lora_add_rejects_rank_above_max_rank():
    generator = torch.Generator().manual_seed(1)
    _, _, pool, a_offsets, b_offsets = _pool_problem([4], 8, 8, torch.float32, generator)
    segments = build_segments(torch.tensor([0]), 1, backend="torch")
    y = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="max_rank=2"):
        torch_ops.lora_add(y, torch.ones(1, 8), pool, a_offsets, b_offsets, torch.tensor([4], dtype=torch.int32),
                           segments, max_rank=2)
    assert torch.equal(y, torch.zeros(1, 8))


def test_backend_env_forces_torch_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("PUNICA_HF_BACKEND", "torch")
    assert ops.backend_for(torch.device("cpu")) == "torch"
    assert ops.build_segments(torch.tensor([0, -1]), 2).backend == "torch"
    monkeypatch.setenv("PUNICA_HF_BACKEND", "cuda")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.backend_for(torch.device("cpu"))
    monkeypatch.setenv("PUNICA_HF_BACKEND", "fastest")
    with pytest.raises(ValueError, match="PUNICA_HF_BACKEND"):
        ops.backend_for(torch.device("cpu"))
