"""The multi-adapter layer that replaces a targeted ``nn.Linear`` or GPT-2 ``Conv1D``.

Each layer keeps the untouched base layer and preallocated stacked LoRA factors for every adapter slot.
The per-token slot mapping does not come through ``forward``'s arguments (transformers only hands a
projection its hidden states): the model wrapper puts the current forward's ``LoraSegments`` in a
``LoraContext`` shared by all layers, built once per forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import ops
from .formats import ModuleLora
from .ops import LoraSegments


class LoraContext:
    """The LoRA state of the forward in progress; ``segments`` is None outside a forward with adapters."""

    def __init__(self) -> None:
        self.segments: LoraSegments | None = None


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a module LoRA can wrap, None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # weight stored [in, out]; LoRA factors keep the Linear orientation
        return module.weight.shape[0], module.weight.shape[1]
    return None


class MultiLoraLinear(nn.Module):
    """``y = base_layer(x) + lora_b[s] @ lora_a[s] @ x`` with ``s`` the adapter slot of each token.

    Buffers (base weight's dtype and device, zero where unused):
        lora_a_stacked: ``[max_adapters, max_rank, in_features]``
        lora_b_stacked: ``[max_adapters, out_features, max_rank]``, the adapter's scaling folded in
        lora_ranks: ``[max_adapters]`` int32, each slot's rank in this layer (0 = the adapter skips this layer)
    """

    def __init__(self, base_layer: nn.Module, max_adapters: int, max_rank: int, context: LoraContext) -> None:
        super().__init__()
        features = linear_features(base_layer)
        if features is None:
            raise ValueError(f"LoRA can wrap nn.Linear or Conv1D modules, not {type(base_layer).__name__}")
        self.in_features, self.out_features = features
        self.base_layer = base_layer
        self.context = context
        weight = base_layer.weight
        factory = {"dtype": weight.dtype, "device": weight.device}
        self.register_buffer(
            "lora_a_stacked", torch.zeros(max_adapters, max_rank, self.in_features, **factory), persistent=False
        )
        self.register_buffer(
            "lora_b_stacked", torch.zeros(max_adapters, self.out_features, max_rank, **factory), persistent=False
        )
        self.register_buffer(
            "lora_ranks", torch.zeros(max_adapters, dtype=torch.int32, device=weight.device), persistent=False
        )

    def set_slot(self, slot: int, factors: ModuleLora | None) -> None:
        """Write one adapter's factors into ``slot`` (zero-padded to max_rank), or clear it with None."""
        self.lora_a_stacked[slot].zero_()
        self.lora_b_stacked[slot].zero_()
        rank = 0
        if factors is not None:
            rank = factors.rank
            self.lora_a_stacked[slot, :rank].copy_(factors.lora_a)
            self.lora_b_stacked[slot, :, :rank].copy_(factors.lora_b)
        self.lora_ranks[slot] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        segments = self.context.segments
        if segments is None:
            return y
        x_tokens = x.reshape(-1, self.in_features)
        if x_tokens.shape[0] != segments.num_tokens:
            raise ValueError(
                f"a LoRA layer got {x_tokens.shape[0]} tokens but the batch's adapter mapping has "
                f"{segments.num_tokens}; adapter_ids must cover every token of input_ids"
            )
        y_tokens = y.view(-1, self.out_features)
        ops.lora_add(
            y_tokens,
            x_tokens.to(self.lora_a_stacked.dtype).contiguous(),
            self.lora_a_stacked,
            self.lora_b_stacked,
            self.lora_ranks,
            segments,
        )
        return y

    def extra_repr(self) -> str:
        slots, max_rank = self.lora_a_stacked.shape[:2]
        return f"in_features={self.in_features}, out_features={self.out_features}, slots={slots}, max_rank={max_rank}"
