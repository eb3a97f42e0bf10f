"""The base model's RMSNorm modules run as one kernel each (``ops.rms_norm``) while the serving engine runs.

transformers' Llama-family RMSNorm is eight small kernels per call (widen, square, mean, add eps, rsqrt, scale,
narrow, weight), two calls per decoder layer: at decode sizes each kernel is a launch of a few microseconds over a
few kilobytes, a few hundred launches per step of an 8B model. ``fuse_norms`` puts a ``NormHook`` on each such
module, as ``LoraHook`` does on the linear ones (the module's ``forward`` as an instance attribute; the module tree
and ``state_dict()`` untouched; ``remove()`` gives the module back).

Which modules: those whose own forward computes what the kernel computes, checked on the module itself rather
than trusted from its class name: a module named ``*RMSNorm`` with a 1-D ``weight`` and a float
``variance_epsilon``, on a CUDA device, is run once on random rows by its own forward and by the kernel, and hooked
only where the two agree within ``ops.norm.tolerance`` (the kernel sums a row's squares in another order than
PyTorch). Gemma's ``1 + weight``, norms with extra arguments, or norms in another dtype than their weight
fail that check and keep their forward.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .ops import norm as ops_norm

PROBE_ROWS = 16


class NormHook:
    """The fused forward of one RMSNorm module: ``ops.rms_norm`` for a contiguous input of the weight's dtype and
    device, the module's own forward for anything else."""

    __slots__ = ("module", "installed")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.installed = True
        module.forward = self

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward
        self.installed = False

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        module = self.module
        weight = module.weight
        if (self.installed and not args and not kwargs and hidden_states.dtype == weight.dtype
                and hidden_states.device == weight.device and hidden_states.is_contiguous()):
            return ops_norm.rms_norm_unchecked(hidden_states, weight, module.variance_epsilon)
        return type(module).forward(module, hidden_states, *args, **kwargs)


def fuse_norms(model: nn.Module) -> list[NormHook]:
    """Hook every RMSNorm module of ``model`` that the kernel computes exactly (see the module docstring); returns
    the hooks (``remove()`` each to undo). Nothing is hooked where the kernels do not build."""
    candidates = [module for module in model.modules() if _candidate(module)]
    if not candidates or not ops_norm.cuda.kernels_available():
        return []
    agreeing = [module for module in candidates if _agrees(module)]  # all checked before any is hooked
    return [NormHook(module) for module in agreeing]


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and "forward" not in module.__dict__  # not already wrapped
            and type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == 1 and weight.is_cuda
            and weight.dtype in ops_norm.DTYPES and weight.is_contiguous()
            and isinstance(getattr(module, "variance_epsilon", None), float) and module.variance_epsilon >= 0)


@torch.no_grad()
def _agrees(module: nn.Module) -> bool:
    """Whether the module's own forward and the kernel agree on random rows (within ``ops.norm.tolerance``)."""
    weight = module.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    rows = torch.randn(PROBE_ROWS, weight.shape[0], generator=generator, device=weight.device).to(weight.dtype)
    try:
        expected = type(module).forward(module, rows)
    except Exception:  # a norm that takes other arguments: not the arithmetic the kernel computes
        return False
    if not isinstance(expected, torch.Tensor) or expected.shape != rows.shape or expected.dtype != rows.dtype:
        return False
    try:
        fused = ops_norm.rms_norm_cuda(rows, weight, module.variance_epsilon)
    except (ValueError, RuntimeError) as error:  # the module keeps its forward; the engine still starts
        warnings.warn(f"punica_hf: the RMSNorm kernel failed on {type(module).__name__} {tuple(weight.shape)} "
                      f"({error}); that module runs its own forward", RuntimeWarning, stacklevel=3)
        return False
    expected = expected.float()
    bound = ops_norm.tolerance(rows.dtype) * expected.abs() + 1e-6 * weight.float().abs()
    return bool(((fused.float() - expected).abs() <= bound).all())
