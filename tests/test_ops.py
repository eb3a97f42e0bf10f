"""The per-forward segment metadata and the PyTorch reference op, against per-token float64 math."""

from __future__ import annotations

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


def _per_token_reference(y, x, lora_a, lora_b, ranks, slots):
    """float64, one token at a time: the definition."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            rank = int(ranks[slot])
            out[t] += lora_b[slot, :, :rank].double() @ (lora_a[slot, :rank].double() @ x[t].double())
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_torch_lora_add_matches_per_token_math(dtype, tolerance, num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    num_slots, max_rank, h_in, h_out = 4, 8, 24, 40
    ranks = torch.tensor([8, 0, 3, 5], dtype=torch.int32)
    lora_a = torch.randn(num_slots, max_rank, h_in, generator=generator)
    lora_b = torch.randn(num_slots, h_out, max_rank, generator=generator)
    for slot, rank in enumerate(ranks.tolist()):  # padding past each slot's rank is zero, as in the layers
        lora_a[slot, rank:] = 0
        lora_b[slot, :, rank:] = 0
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    x = torch.randn(num_tokens, h_in, generator=generator).to(dtype)
    y = torch.randn(num_tokens, h_out, generator=generator).to(dtype)
    slots = _random_slots(num_tokens, num_slots, generator)

    expected = _per_token_reference(y, x, lora_a, lora_b, ranks, slots)
    out = y.clone()
    torch_ops.lora_add(out, x, lora_a, lora_b, ranks, build_segments(slots, num_slots, backend="torch"))

    error = (out.double() - expected).norm() / expected.norm()
    assert error < tolerance
    no_adapter = (slots < 0) | (ranks[slots.clamp(min=0)] == 0)
    assert torch.equal(out[no_adapter], y[no_adapter]), "rows without an adapter must stay untouched"


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
