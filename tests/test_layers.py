"""MultiLoraLinear on Linear and Conv1D: per-token adapters, flattened inputs, slot writes and clears."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from punica_hf.layers import LoraContext, MultiLoraLinear
from punica_hf.formats import ModuleLora
from punica_hf.ops.segments import build_segments

IN, OUT, SLOTS, MAX_RANK = 12, 20, 3, 6


def _layer(kind: str) -> tuple[MultiLoraLinear, LoraContext, dict[int, ModuleLora]]:
    torch.manual_seed(0)
    base = nn.Linear(IN, OUT) if kind == "linear" else Conv1D(OUT, IN)
    context = LoraContext()
    layer = MultiLoraLinear(base, SLOTS, MAX_RANK, context)
    factors = {slot: ModuleLora(torch.randn(rank, IN), torch.randn(OUT, rank)) for slot, rank in [(0, 6), (2, 2)]}
    for slot, f in factors.items():
        layer.set_slot(slot, f)
    return layer, context, factors


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("shape", [(2, 5), (10,)], ids=["batch_seq", "flattened"])
def test_each_token_gets_its_own_adapter(kind, shape):
    layer, context, factors = _layer(kind)
    x = torch.randn(*shape, IN)
    token_slots = torch.tensor([0, -1, 2, 2, 0, 1, -1, 0, 2, 0])  # slot 1 holds no adapter in this layer
    context.segments = build_segments(token_slots, SLOTS, backend="torch")
    y = layer(x)
    context.segments = None

    base = layer.base_layer(x).reshape(-1, OUT)
    flat_x = x.reshape(-1, IN)
    for t, slot in enumerate(token_slots.tolist()):
        expected = base[t]
        if slot in factors:
            expected = expected + factors[slot].lora_b @ (factors[slot].lora_a @ flat_x[t])
        torch.testing.assert_close(y.reshape(-1, OUT)[t], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)  # no context: base layer only


def test_cleared_slot_is_zero_and_has_rank_zero():
    layer, _, _ = _layer("linear")
    layer.set_slot(0, None)
    assert layer.lora_ranks.tolist() == [0, 0, 2]
    assert not layer.lora_a_stacked[0].any() and not layer.lora_b_stacked[0].any()
    assert layer.lora_a_stacked[2, 2:].abs().sum() == 0, "rows past a slot's rank stay zero"


def test_token_count_mismatch_is_a_clear_error():
    layer, context, _ = _layer("linear")
    context.segments = build_segments(torch.tensor([0, 2]), SLOTS, backend="torch")
    with pytest.raises(ValueError, match="3 tokens but the batch's adapter mapping has 2"):
        layer(torch.randn(3, IN))


def test_only_linear_and_conv1d_can_be_wrapped():
    with pytest.raises(ValueError, match="Embedding"):
        MultiLoraLinear(nn.Embedding(4, 4), SLOTS, MAX_RANK, LoraContext())
