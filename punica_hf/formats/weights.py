"""What every adapter source is read into: per-module LoRA factors with the scaling folded in."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import LoraAdapterConfig


# Every tensor a ModuleLora may hold, and the per-output-row vectors among them
VECTOR_NAMES = ("magnitude", "lora_bias", "base_bias", "output_scale", "output_shift")
FACTOR_NAMES = ("lora_a", "lora_b", *VECTOR_NAMES)


@dataclass(frozen=True)
class ModuleLora:
    """One module's LoRA factors, ready to copy into a slot. ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]``
    with the module's scaling already folded in; float32 from PEFT checkpoints, a converted file's own dtype.

    Per-output-row vectors ``[out]`` of PEFT features beyond plain LoRA (None when the adapter lacks them):
    ``magnitude``: DoRA's magnitude; ``lora_bias``: lora_B's bias (``lora_bias=True``), scaling folded in;
    ``base_bias``: the adapter's own bias of the base layer (``bias="lora_only"`` / ``"all"``). A model turns them
    into ``output_scale`` / ``output_shift`` (``punica_hf.adapter_vectors``): the layer's output with LoRA
    becomes ``output * output_scale + output_shift``.

    ValueError when a tensor is not floating-point or a vector is not ``[out]``.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    magnitude: torch.Tensor | None = None
    lora_bias: torch.Tensor | None = None
    base_bias: torch.Tensor | None = None
    output_scale: torch.Tensor | None = None
    output_shift: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in FACTOR_NAMES:
            tensor = getattr(self, name)
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"{name} holds {tensor.dtype}, not floating-point values")
        out_features = self.lora_b.shape[0]
        for name in VECTOR_NAMES:
            vector = getattr(self, name)
            if vector is not None and tuple(vector.shape) != (out_features,):
                raise ValueError(f"{name} has shape {list(vector.shape)}, expected [{out_features}] (lora_B's rows)")

    @property
    def has_vectors(self) -> bool:
        return any(getattr(self, name) is not None for name in VECTOR_NAMES)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """A whole adapter: base-model module name -> its LoRA factors.

    ``base_weights``: full copies of base layers PEFT saved beside their LoRA (embeddings, lm_head), by module
    name; PEFT loads them over the base model's weights, so serving checks they equal them.

    Every factor is checked to hold finite values only (``ValueError`` naming the module otherwise), whatever
    made it: a PEFT checkpoint, a converted file or code.
    """

    modules: dict[str, ModuleLora]
    config: LoraAdapterConfig
    source: str
    base_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    # bias="all": the biases a checkpoint holds of modules the adapter does not target, by module name (served only
    # where they equal the base model's: they would change the base model for every request)
    other_biases: dict[str, torch.Tensor] = field(default_factory=dict)
    # PEFT ``target_parameters`` factors as saved, by PEFT's key of the wrapped module (``...experts``,
    # ``...experts.base_layer``, ...): unscaled, every expert's rank stacked. Only a base model tells which
    # parameter each key adapts (``matching.weights_for_model`` splits them into per-expert ``modules``).
    parameters: dict[str, ModuleLora] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for module_name, factors in {**self.modules, **self.parameters}.items():
            for factor_name in FACTOR_NAMES:
                factor = getattr(factors, factor_name)
                if factor is not None and not _all_finite(factor):
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
