"""LoRA ops over a batch whose tokens each use their own adapter slot, and attention over a paged KV cache.

``lora_add`` picks the backend per call: the CUDA kernels of ``csrc/`` for CUDA tensors when they build,
else the PyTorch reference (``torch_ops``). ``PUNICA_HF_BACKEND=torch|cuda`` forces one; ``cuda`` raises if
the kernels cannot be built or the tensors are not on a GPU. ``paged_attention`` (``attention``) dispatches the
same way.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from functools import lru_cache

import torch

from . import cuda, torch_ops  # importing cuda builds nothing: the kernels build on the first CUDA call
from .attention import paged_attention
from .segments import LoraSegments
from .segments import build_segments as _build_segments

__all__ = ["LoraSegments", "build_segments", "lora_add", "lora_delta", "backend_for", "paged_attention"]

_BACKENDS = ("auto", "torch", "cuda")


def _requested_backend() -> str:
    requested = os.environ.get("PUNICA_HF_BACKEND", "auto").strip().lower() or "auto"
    if requested not in _BACKENDS:
        raise ValueError(f"PUNICA_HF_BACKEND must be one of {_BACKENDS}, got {requested!r}")
    return requested


@lru_cache(maxsize=None)
def _cuda_kernels_available() -> bool:
    """Build or load the CUDA extension once; on failure warn once and fall back to PyTorch."""
    try:
        cuda.load_extension()
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
        cuda.load_extension()  # raises with the build error
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
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
    max_rank: int,
) -> None:
    """``y[t] += Bt_s^T @ (A_s @ x[t])`` in place, ``s`` = the slot of token ``t`` (skipped when -1 or rank 0).

    Shapes: ``y`` ``[T, H_out]``, ``x`` ``[T, H_in]``, ``pool`` ``[P]`` (same dtype and device as ``x``),
    ``a_offsets`` / ``b_offsets`` ``[S]`` int64, ``lora_ranks`` ``[S]`` int32, ``max_rank`` an int bound of every
    rank. Slot ``s`` of rank ``r > 0``: ``A_s = pool[a_offsets[s]:][:r * H_in].view(r, H_in)``,
    ``Bt_s = pool[b_offsets[s]:][:r * H_out].view(r, H_out)`` (LoRA B transposed, scaling folded in); offsets are
    multiples of ``torch_ops.POOL_ALIGNMENT``.
    """
    if segments.backend == "cuda":
        cuda.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)
    else:
        torch_ops.lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)


def lora_delta(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    lora_ranks: torch.Tensor,
    segments: LoraSegments,
    max_rank: int,
    out_features: Sequence[int],
) -> torch.Tensor:
    """The LoRA updates of ``G`` projections that share their input, computed together: ``[T, sum(out_features)]``.

    Projection ``g`` (``out_features[g]`` wide, tables ``a_offsets[g]``, ``b_offsets[g]``, ``lora_ranks[g]`` of
    the ``[G, S]`` tables) fills its own columns, in order: ``delta[t, cols_g] = Bt_s^T @ (A_s @ x[t])``, zero for
    tokens without an adapter. One shrink and one expand launch for the whole group on the CUDA backend (at most
    ``cuda.MAX_OUTPUTS`` projections), instead of two per projection.
    """
    if segments.backend == "cuda":
        return cuda.lora_delta(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)
    return torch_ops.lora_delta(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)
