"""LoRA ops over a batch whose tokens each use their own adapter slot.

``lora_add`` picks the backend per call: the CUDA kernels of ``csrc/`` for CUDA tensors when they build,
else the PyTorch reference (``torch_ops``). ``PUNICA_HF_BACKEND=torch|cuda`` forces one; ``cuda`` raises if
the kernels cannot be built or the tensors are not on a GPU.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache

import torch

from . import torch_ops
from .segments import LoraSegments
from .segments import build_segments as _build_segments

__all__ = ["LoraSegments", "build_segments", "lora_add", "backend_for"]

_BACKENDS = ("auto", "torch", "cuda")


def _requested_backend() -> str:
    requested = os.environ.get("PUNICA_HF_BACKEND", "auto").strip().lower() or "auto"
    if requested not in _BACKENDS:
        raise ValueError(f"PUNICA_HF_BACKEND must be one of {_BACKENDS}, got {requested!r}")
    return requested


@lru_cache(maxsize=None)
def _cuda_kernels_available() -> bool:
    """Build or load the CUDA extension once; on failure warn once and fall back to PyTorch."""
    from . import cuda as cuda_ops

    try:
        cuda_ops.load_extension()
    except Exception as error:  # any build or load failure means: use the reference ops
        warnings.warn(
            f"punica_hf: CUDA kernels unavailable, using the PyTorch ops instead ({error}). "
            "Set PUNICA_HF_BACKEND=cuda to make this an error.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def backend_for(device: torch.device) -> str:
    """The backend ``lora_add`` uses for tensors on ``device``: ``"cuda"`` or ``"torch"``."""
    requested = _requested_backend()
    if requested == "torch":
        return "torch"
    if requested == "cuda":
        if device.type != "cuda":
            raise ValueError(f"PUNICA_HF_BACKEND=cuda needs CUDA tensors, got tensors on {device}")
        from . import cuda as cuda_ops

        cuda_ops.load_extension()  # raises with the build error
        return "cuda"
    if device.type == "cuda" and _cuda_kernels_available():
        return "cuda"
    return "torch"


def build_segments(token_slots: torch.Tensor, num_slots: int) -> LoraSegments:
    """Group the ``[T]`` per-token slots (-1 = none) by slot, and pick the backend for this forward."""
    return _build_segments(token_slots, num_slots, backend_for(token_slots.device))


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
) -> None:
    """``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` in place, ``s`` = the slot of token ``t`` (skipped when -1).

    Shapes: ``y`` ``[T, H_out]``, ``x`` ``[T, H_in]``, ``lora_a_stacked`` ``[S, R, H_in]``,
    ``lora_b_stacked`` ``[S, H_out, R]`` (scaling folded in), ``lora_ranks`` ``[S]`` int32.
    """
    if segments.backend == "cuda":
        from . import cuda as cuda_ops

        cuda_ops.lora_add(y, x, lora_a_stacked, lora_b_stacked, lora_ranks, segments)
    else:
        torch_ops.lora_add(y, x, lora_a_stacked, lora_b_stacked, lora_ranks, segments)
