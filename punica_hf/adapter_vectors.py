"""DoRA and LoRA biases as two per-output-row vectors of a layer: ``output * scale + shift``.

PEFT's inference output of a linear layer with one adapter, ``y_peft``, in terms of what a LoRA hook has at hand,
``y = W x + b0 + s B A x`` (the base layer's output with its own bias ``b0``, plus plain LoRA):

- LoRA bias (``lora_bias=True``): lora_B is a linear layer with bias ``bB``, so ``y_peft = y + s bB`` (also on a
  base layer without bias, where ``b0`` is 0).
- ``bias="lora_only"`` / ``"all"``: PEFT loads the adapter's own bias ``b1`` into the base layer:
  ``y_peft = y + (b1 - b0)``.
- DoRA: with ``g = m / ||W + s B A||`` per output row (PEFT's norm, over each row of the weight it builds from
  ``lora_B(lora_A(I))``, which holds ``bB`` when there is one), PEFT returns
  ``b1 + g (W x + s B A x + s bB)``, which is ``g y + (b1 - g b0 + g s bB)``.

So every case is ``y * scale + shift`` with ``scale = g`` (DoRA only) and ``shift = b1 - g b0 + g s bB`` (terms
that are absent drop out). Both depend on the base layer's weight and bias, not only on the checkpoint, so they are
made when an adapter is loaded into a model (once: the norm is computed here, in float32, never per forward).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .base_layers import is_fp8_linear
from .formats import AdapterWeights, ModuleLora


def output_vectors(module_name: str, module: nn.Module, factors: ModuleLora) -> ModuleLora:
    """``factors`` with ``output_scale`` / ``output_shift`` for ``module`` (this rank's rows of it under tensor
    parallelism, where ``factors`` are this rank's share); the same object for plain LoRA. ValueError naming the
    module when its weight or bias cannot be read or the adapter's vectors do not fit it."""
    if not factors.has_vectors:
        return factors
    if not isinstance(module, (nn.Linear, Conv1D)):
        kind = type(module).__name__
        raise ValueError(f"DoRA and LoRA biases are served on linear layers only, not on {module_name} ({kind})")
    base_bias = None  # b0 drops out of the shift unless DoRA scales it or the adapter has its own bias
    if factors.magnitude is not None or factors.base_bias is not None:
        base_bias = _local_float(getattr(module, "bias", None), module_name, "bias")
        base_bias = None if base_bias is None else base_bias.cpu()
    if factors.base_bias is not None and base_bias is None:
        raise ValueError(f"module {module_name} has no bias in the base model, but the adapter holds one for it")
    lora_b = factors.lora_b.float()
    lora_bias = None if factors.lora_bias is None else factors.lora_bias.float().to(lora_b.device)
    scale = None
    if factors.magnitude is not None:
        weight = _base_weight(module_name, module)
        lora_weight = lora_b.to(weight.device) @ factors.lora_a.float().to(weight.device)
        if lora_bias is not None:  # PEFT builds the DoRA weight from lora_B(lora_A(I)), bias included
            lora_weight = lora_weight + lora_bias.to(weight.device)[:, None]
        norm = torch.linalg.norm(weight + lora_weight, dim=1).cpu()
        scale = factors.magnitude.float().cpu() / norm
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"module {module_name}: DoRA's magnitude over the weight norm is not finite (a zero row)")
    shift = _shift(scale, base_bias, factors.base_bias, lora_bias)
    return dataclasses.replace(factors, output_scale=scale, output_shift=shift)


def _shift(scale, base_bias, adapter_bias, lora_bias) -> torch.Tensor | None:
    """``b1 - g b0 + g s bB`` (module docstring), None when it is zero by construction."""
    terms = []
    if adapter_bias is not None or (scale is not None and base_bias is not None):
        with_adapter = base_bias if adapter_bias is None else adapter_bias.float().cpu()
        terms.append(with_adapter - (base_bias if scale is None else scale * base_bias))
    if lora_bias is not None:
        terms.append(lora_bias.cpu() if scale is None else scale * lora_bias.cpu())
    return sum(terms) if terms else None


def _base_weight(module_name: str, module: nn.Module) -> torch.Tensor:
    """The base layer's weight ``[out, in]`` in float32 (dequantized where bitsandbytes stores it packed)."""
    from peft.utils.integrations import dequantize_module_weight  # imported late: see formats.config

    if is_fp8_linear(module):  # PEFT's dequantization would read its float8 values without their block scales
        raise ValueError(
            f"module {module_name}: DoRA needs the base layer's weight, which an fp8 layer (FP8Linear) stores as "
            "float8 blocks with scales; DoRA on fp8 bases is not supported"
        )
    weight = _local_float(dequantize_module_weight(module), module_name, "weight")
    return weight.T if isinstance(module, Conv1D) else weight  # Conv1D stores [in, out]


def _local_float(tensor: torch.Tensor | None, module_name: str, what: str) -> torch.Tensor | None:
    """``tensor`` as float32 (this rank's part of a DTensor), None for None; ValueError when it is offloaded."""
    if tensor is None:
        return None
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if tensor.device.type == "meta":
        raise ValueError(
            f"module {module_name}: DoRA and LoRA biases need the base layer's {what}, which is offloaded (on 'meta')"
        )
    return tensor.detach().float()


def check_other_biases(weights: AdapterWeights, model: nn.Module, column_splits: dict[str, slice]) -> None:
    """A ``bias="all"`` checkpoint's biases of modules it puts no LoRA on must be the base model's own: PEFT would
    load them into the base model, changing it for every request, base rows and other adapters included.
    ``column_splits``: this rank's output rows of layers split by them (tensor parallelism), whose bias is split too."""
    for module_name, saved in weights.other_biases.items():
        try:
            bias = model.get_submodule(module_name).bias
        except AttributeError:  # PEFT ignores a key the model does not have
            continue
        if not isinstance(bias, torch.Tensor):
            continue
        if hasattr(bias, "to_local"):  # this rank's part of it
            bias = bias.to_local()
            saved = saved[column_splits[module_name]] if module_name in column_splits else saved
        if not torch.equal(saved.to(device=bias.device, dtype=bias.dtype), bias.detach()):
            raise ValueError(
                f"its checkpoint (bias='all') changes the bias of {module_name}, a module without LoRA: that would "
                "change the base model for every request, which punica_hf does not do"
            )
