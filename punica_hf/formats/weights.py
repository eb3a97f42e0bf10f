"""What every adapter source is read into: per-module LoRA factors with the scaling folded in."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """A whole adapter: base-model module name -> its LoRA factors.

    Every factor is checked to hold finite values only (``ValueError`` naming the module otherwise), whatever
    made it: a PEFT checkpoint, a converted file or code.
    """

    modules: dict[str, ModuleLora]
    config: LoraAdapterConfig
    source: str
    # PEFT ``target_parameters`` factors as saved, by PEFT's key of the wrapped module (``...experts``,
    # ``...experts.base_layer``, ...): unscaled, every expert's rank stacked. Only a base model tells which
    # parameter each key adapts (``matching.weights_for_model`` splits them into per-expert ``modules``).
    parameters: dict[str, ModuleLora] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for module_name, factors in {**self.modules, **self.parameters}.items():
            for factor_name in ("lora_a", "lora_b"):
                if not _all_finite(getattr(factors, factor_name)):
                    raise ValueError(
                        f"adapter {self.source}: module {module_name} has NaN or Inf values in its {factor_name}"
                    )

    @property
    def max_rank(self) -> int:
        # 0 for an adapter that changes no module of its base model (see matching.weights_for_model)
        return max((m.rank for m in self.modules.values()), default=0)


def _all_finite(tensor: torch.Tensor) -> bool:
    # A sum is finite unless some value is NaN or Inf or the sum overflows: one reduction, several times cheaper
    # than an element-wise isfinite; the exact check runs only when the sum is not finite.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
