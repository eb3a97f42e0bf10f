"""What every adapter source is read into: per-module LoRA factors with the scaling folded in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import LoraAdapterConfig


@dataclass(frozen=True)
class ModuleLora:
    """One module's LoRA factors, ready to copy into a slot. ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]``
    with the module's scaling already folded in; float32 from PEFT checkpoints, a converted file's own dtype."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """A whole adapter: base-model module name -> its LoRA factors."""

    modules: dict[str, ModuleLora]
    config: LoraAdapterConfig
    source: str

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())
