"""What punica_hf needs to know about the base layers it wraps: sizes, the LoRA dtype and device, servability.

Servable kinds: ``nn.Linear`` and GPT-2's ``Conv1D`` with a plain floating-point weight, bitsandbytes'
``Linear4bit`` (nf4 / fp4) and ``Linear8bitLt``, and transformers' fp8 layer (``FP8Linear``, from
``FineGrainedFP8Config``). A quantized layer stores its weight packed (uint8 / int8, or float8 with block scales),
takes activations in the model's dtype and returns them in that same dtype, so its LoRA factors live in the
model's dtype, never in the storage dtype. Anything else a LoRA checkpoint may target (GPTQ, AWQ, HQQ, EETQ,
torchao or other quantized layers, tensor-parallel weights) is refused by its class name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

# Weight dtypes a plain layer computes in: LoRA factors in these dtypes are added straight into its output.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_SERVABLE_KINDS = "nn.Linear, Conv1D, bitsandbytes Linear4bit / Linear8bitLt and transformers' FP8Linear layers"


@dataclass(frozen=True)
class LinearModule:
    """What the adapter store needs to know of one linear module of the base model, as plain data."""

    in_features: int
    out_features: int
    device: torch.device | None  # where its LoRA factors live; None: the module cannot be served (check_servable)
    dtype: torch.dtype | None  # the dtype its LoRA runs in (lora_dtype); None when it cannot be served
    # (in, out) of the whole layer when tensor parallelism splits it and in/out_features are this rank's share
    unsplit_features: tuple[int, int] | None = None
    # (in, out) of the widest rank's share of a split layer (rank 0's: uneven splits give the first ranks more):
    # every rank sizes its pool and its adapters' chunks by it, so all ranks place and evict alike
    widest_features: tuple[int, int] | None = None

    @property
    def sizing_features(self) -> tuple[int, int]:
        """``(in, out)`` the pools are sized by: the widest rank's share under tensor parallelism, else this one."""
        return self.widest_features or (self.in_features, self.out_features)


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear module (``nn.Linear`` or a subclass, ``Conv1D``), else None.

    Read from the module, never from its weight's shape: a bitsandbytes 4-bit weight is packed (``[n, 1]``).
    Whether the layer can be served is ``check_servable``'s question.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # weight stored [nx, nf] = [in, out]
        return module.nx, module.nf
    return None


def lora_dtype(module: nn.Module, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the LoRA factors and of ``x`` for a servable ``module``: the dtype of its activations.

    A plain layer computes in its weight's dtype. A quantized layer returns its output in its input's dtype, which
    is the model's floating dtype ``model_dtype`` (``activation_dtype``); its weight is storage only, and a
    bitsandbytes 4-bit ``compute_dtype`` is internal to its matmul (transformers' default is float32 even for a
    bfloat16 model, whose activations stay bfloat16).
    """
    if _is_bitsandbytes_linear(module) or is_fp8_linear(module):
        return model_dtype
    return module.weight.dtype


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations flow in: transformers' ``model.dtype`` (its first floating-point parameter's),
    unless that is a storage dtype (float8: an fp8 embedding comes first), then the dtype the model was loaded in
    (``config.dtype``), else its first parameter of a plain floating dtype."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and is_plain_float(dtype):
        return dtype
    loaded_in = getattr(getattr(model, "config", None), "dtype", None)
    if isinstance(loaded_in, str):
        loaded_in = getattr(torch, loaded_in, None)
    if isinstance(loaded_in, torch.dtype) and is_plain_float(loaded_in):
        return loaded_in
    for parameter in model.parameters():
        if is_plain_float(parameter.dtype):
            return parameter.dtype
    return torch.get_default_dtype()


def lora_device(module: nn.Module) -> torch.device:
    """Where the LoRA factors of a servable ``module`` live: its weight's device, or, for a layer offloaded by
    accelerate (weight on 'meta' until its hook loads it), the execution device of its ``_hf_hook``."""
    device = module.weight.device
    if device.type != "meta":
        return device
    execution_device = _hook_execution_device(getattr(module, "_hf_hook", None))
    if execution_device is None or execution_device.type == "meta":
        raise ValueError(
            "its weight is on the 'meta' device and no accelerate hook (_hf_hook) gives the device it runs on"
        )
    return execution_device


def check_servable(module: nn.Module, module_name: str) -> None:
    """Raise ValueError naming ``module_name`` and its kind when punica_hf cannot add LoRA to ``module``."""
    problem = _servability_problem(module)
    if problem is not None:
        kind = type(module)
        raise ValueError(
            f"module {module_name} is a {kind.__module__}.{kind.__qualname__}: {problem}; "
            f"punica_hf serves LoRA on {_SERVABLE_KINDS}"
        )
    try:
        lora_device(module)
    except ValueError as error:
        raise ValueError(f"module {module_name}: {error}") from None


def _servability_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot be served, or None when it can."""
    if _is_bitsandbytes_linear(module):
        return None
    if is_fp8_linear(module):
        if hasattr(module, "n_groups"):  # FP8GroupedLinear: its input is [..., groups, in], one weight per group
            return "a grouped fp8 layer (block-diagonal weights over a grouped input)"
        return None
    if type(module).__module__.split(".")[0] == "bitsandbytes":
        return "a bitsandbytes layer other than Linear4bit / Linear8bitLt"
    if linear_features(module) is None:
        return "not an nn.Linear or Conv1D"
    weight = module.weight
    if type(weight) not in (torch.Tensor, nn.Parameter):  # torchao, DTensor, ...: a subclass with its own matmul
        return f"its weight is a {type(weight).__module__}.{type(weight).__qualname__} (a quantized or sharded tensor)"
    if weight.dtype not in _FLOAT_DTYPES:  # int8 / uint8 / fp8 storage means a quantized kernel does the matmul
        return f"its weight is stored in {weight.dtype} (a quantized layer)"
    return None


def _is_bitsandbytes_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit`` or ``Linear8bitLt`` (or a subclass, e.g. ``LinearNF4``).

    A bitsandbytes layer exists only once bitsandbytes is imported, so this never imports it.
    """
    bitsandbytes = sys.modules.get("bitsandbytes")
    return bitsandbytes is not None and isinstance(module, (bitsandbytes.nn.Linear4bit, bitsandbytes.nn.Linear8bitLt))


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``FP8Linear`` (a model quantized with ``FineGrainedFP8Config``): float8
    weights with block scales, multiplied by transformers' fp8 kernel. Never imports transformers' fp8 module: such
    a layer exists only once it is imported."""
    fp8 = sys.modules.get("transformers.integrations.finegrained_fp8")
    return fp8 is not None and isinstance(module, fp8.FP8Linear)


def is_plain_float(dtype: torch.dtype) -> bool:
    """Whether a weight of ``dtype`` is multiplied as it is stored (float8 storage needs its scales)."""
    return dtype in _FLOAT_DTYPES


def _hook_execution_device(hook: object) -> torch.device | None:
    """The execution device of an accelerate hook (``AlignDevicesHook``, or one inside a ``SequentialHook``)."""
    if hook is None:
        return None
    for inner in getattr(hook, "hooks", ()):
        device = _hook_execution_device(inner)
        if device is not None:
            return device
    device = getattr(hook, "execution_device", None)
    return None if device is None else torch.device(device)
