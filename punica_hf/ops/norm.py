"""RMSNorm of each row: transformers' Llama-family RMSNorm (``x * rsqrt(mean(x^2) + eps)`` in float, rounded to
the input's dtype, times ``weight``) as one kernel (``csrc/rms_norm.cu``) instead of eight.

``rms_norm_reference`` is that arithmetic in PyTorch ops, as transformers writes it; the kernel differs from it
only in the order a row's squares are summed (a last-place difference in float, at most two rounding steps of the
output's dtype: ``tolerance``). ``rms_norm`` runs the kernel on CUDA tensors when the extension builds, else the
reference.
"""

from __future__ import annotations

import torch

from . import cuda

DTYPES = cuda.DTYPES  # what the kernel takes (x and weight alike), as the LoRA kernels


def tolerance(dtype: torch.dtype) -> float:
    """How far, relative, the kernel's output may be from the reference's: where the other summation order moves a
    normalized value across a rounding boundary, it and then the product each round one step apart (float32: its
    ``rsqrt`` and summation errors, a few units in the last place)."""
    return max(2 * torch.finfo(dtype).eps, 1e-5)


def within_tolerance(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``out`` is within ``tolerance`` of ``expected`` (same shape) everywhere; where the output is
    subnormal (fp16), within two of its steps absolutely."""
    finfo = torch.finfo(out.dtype)
    expected = expected.double()
    bound = tolerance(out.dtype) * expected.abs() + 2 * finfo.tiny * finfo.eps
    return bool(((out.double() - expected).abs() <= bound).all())


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., H]`` -> ``[..., H]``: transformers' ``LlamaRMSNorm.forward`` for ``weight`` ``[H]`` of x's dtype."""
    normalized = x.to(torch.float32)
    normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """ValueError naming the problem for arguments the kernel does not take."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("rms_norm: x and weight must be tensors")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a number >= 0, got {eps!r}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x and weight must share one dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] < 1:
        raise ValueError(f"rms_norm: expected x [..., H] and weight [H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not (x.is_cuda and weight.device == x.device):
        raise ValueError(f"rms_norm: x and weight must be on one CUDA device, got {x.device} and {weight.device}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("rms_norm: x and weight must be contiguous")


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel: a new tensor of x's shape; one launch, no host sync (capturable, traceable)."""
    check_rms_norm(x, weight, eps)
    return rms_norm_unchecked(x, weight, eps)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_cuda`` where the caller guarantees what ``check_rms_norm`` checks (the binding checks shapes,
    devices and dtypes again before the launch)."""
    if cuda._rms_norm_op is None:
        cuda.load_extension()
    return cuda._rms_norm_op(x, weight, float(eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., H]`` -> ``[..., H]``: the kernel for CUDA tensors it takes when it builds, else the reference."""
    if x.is_cuda and cuda.kernels_available():
        return rms_norm_cuda(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
