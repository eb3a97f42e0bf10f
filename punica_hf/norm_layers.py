"""The base model's RMSNorm modules run as one kernel each (``ops.rms_norm``) while the serving engine runs.

transformers' Llama-family RMSNorm is eight small kernels per call (widen, square, mean, add eps, rsqrt, scale,
narrow, weight), two calls per decoder layer: at decode sizes each kernel is a launch of a few microseconds over a
few kilobytes, a few hundred launches per step of an 8B model. ``fuse_norms`` puts a ``NormHook`` on each such
module, as ``LoraHook`` does on the linear ones (the module's ``forward`` as an instance attribute; the module tree
and ``state_dict()`` untouched; ``remove()`` gives the module back).

Which modules: those whose own forward is exactly transformers' Llama arithmetic (``ops.norm.rms_norm_reference``),
checked on the module itself rather than trusted from its class name. A module named ``*RMSNorm`` with a 1-D
``weight`` of the model's activation dtype and a float ``variance_epsilon``, on a CUDA device, is run on probe rows
(random, near eps, zero, large) by its own forward, which must equal the reference bit for bit, and by the kernel,
which must agree within ``ops.norm.tolerance`` (it sums a row's squares in another order than PyTorch). Norms that
round once instead of twice (OLMo-2's ``(weight * x).to(dtype)``), Gemma's ``1 + weight``, eps in another place,
or norms with extra arguments fail that check and keep their forward.

A copy of a hooked module (``copy.deepcopy``, pickle) carries an inert hook that runs the module's own forward:
the engine that hooked the original does not know the copy and could never take its hook off.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .base_layers import activation_dtype
from .ops import norm as ops_norm

PROBE_ROWS = 16


class NormHook:
    """The fused forward of one RMSNorm module: ``ops.rms_norm`` for one contiguous CUDA input of the weight's dtype,
    the module's own forward for anything else (and once removed)."""

    __slots__ = ("module", "installed")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.installed = True
        module.forward = self

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward
        self.installed = False

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        module = self.module
        if self.installed and len(args) == 1 and not kwargs:
            hidden_states, weight = args[0], module.weight
            if (hidden_states.is_cuda and hidden_states.dtype == weight.dtype and hidden_states.device == weight.device
                    and hidden_states.is_contiguous()):
                return ops_norm.rms_norm_unchecked(hidden_states, weight, module.variance_epsilon)
        return type(module).forward(module, *args, **kwargs)

    def __getstate__(self) -> dict:
        return {"module": self.module, "installed": False}  # a copy's hook is inert (module docstring)

    def __setstate__(self, state: dict) -> None:
        self.module, self.installed = state["module"], state["installed"]


def fuse_norms(model: nn.Module) -> list[NormHook]:
    """Hook every RMSNorm module of ``model`` whose arithmetic the kernel reproduces (see the module docstring);
    returns the hooks (``remove()`` each to undo). Nothing is hooked where the kernels do not build."""
    dtype = activation_dtype(model)
    candidates = [module for module in model.modules() if _candidate(module, dtype)]
    if not candidates or not ops_norm.cuda.kernels_available():
        return []
    agreeing = [module for module in candidates if _agrees(module)]  # all checked before any is hooked
    return [NormHook(module) for module in agreeing]


def _candidate(module: nn.Module, dtype: torch.dtype) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and "forward" not in module.__dict__  # not already wrapped
            and type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == 1 and weight.is_cuda
            and weight.dtype == dtype and dtype in ops_norm.DTYPES and weight.is_contiguous()
            and isinstance(getattr(module, "variance_epsilon", None), float) and module.variance_epsilon >= 0)


def probe_rows(width: int, eps: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[PROBE_ROWS + 3, width]``: random rows, then rows whose mean square is near ``eps`` (where it matters
    where eps is added), a zero row and a large one."""
    generator = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(PROBE_ROWS + 3, width, generator=generator, device=device)
    rows[PROBE_ROWS] *= max(eps, 1e-12) ** 0.5
    rows[PROBE_ROWS + 1] = 0
    rows[PROBE_ROWS + 2] *= 100
    return rows.to(dtype)


def same_arithmetic(module: nn.Module, rows: torch.Tensor, expected: torch.Tensor | None = None) -> bool:
    """Whether the module's own forward on ``rows`` is transformers' Llama RMSNorm (``rms_norm_reference``, or
    ``expected`` when given: the reference's result on ``rows``), bit for bit: the same ops in the same order, so
    only another arithmetic differs."""
    try:
        own = type(module).forward(module, rows)
    except Exception:  # a norm that takes other arguments: not the arithmetic the kernel computes
        return False
    if expected is None:
        expected = ops_norm.rms_norm_reference(rows, module.weight, module.variance_epsilon)
    return isinstance(own, torch.Tensor) and own.shape == expected.shape and own.dtype == expected.dtype and bool(
        torch.equal(own, expected))


@torch.no_grad()
def _agrees(module: nn.Module) -> bool:
    """Whether the module computes the reference's arithmetic and the kernel agrees with it on the probe rows."""
    weight = module.weight
    rows = probe_rows(weight.shape[0], module.variance_epsilon, weight.dtype, weight.device)
    expected = ops_norm.rms_norm_reference(rows, weight, module.variance_epsilon)
    if not same_arithmetic(module, rows, expected):
        return False
    try:
        fused = ops_norm.rms_norm_cuda(rows, weight, module.variance_epsilon)
    except (ValueError, RuntimeError) as error:  # the module keeps its forward; the engine still starts
        warnings.warn(f"punica_hf: the RMSNorm kernel failed on {type(module).__name__} {tuple(weight.shape)} "
                      f"({error}); that module runs its own forward", RuntimeWarning, stacklevel=3)
        return False
    return ops_norm.within_tolerance(fused, expected)
