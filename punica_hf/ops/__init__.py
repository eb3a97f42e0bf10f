"""LoRA ops over a batch whose tokens each use their own adapter slot, and attention over a paged KV cache.

The LoRA ops run on a backend object picked once per device by ``backend_for``: ``CudaLoraBackend`` (the kernels
of ``csrc/``, their paths chosen by a ``KernelConfig``) for CUDA tensors when the kernels build, else
``TorchLoraBackend`` (the PyTorch reference). Each has ``lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks,
segments, max_rank)`` and ``lora_delta(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank,
out_features)`` (shapes in ``torch_ops``); ``segments`` is the forward's ``build_segments``. ``paged_attention``
(``attention``) picks its backend per call from the argument ``backend`` (``"auto"`` by default).

``PUNICA_HF_BACKEND=torch|cuda|auto`` is a user's override of the LoRA backend, read once by ``requested_backend``
when a model is made (``MultiLoraModel(backend=...)`` overrides it in turn); nothing here reads it per call.
"""

from __future__ import annotations

import os

import torch

from .attention import paged_attention
from .config import KernelConfig
from .cuda import CudaLoraBackend, kernels_available
from .segments import LoraSegments, build_segments
from .torch_ops import POOL_ALIGNMENT, TorchLoraBackend

__all__ = ["BACKENDS", "CudaLoraBackend", "KernelConfig", "LoraBackend", "LoraSegments", "POOL_ALIGNMENT",
           "TorchLoraBackend", "backend_for", "build_segments", "paged_attention", "requested_backend"]

BACKENDS = ("auto", "torch", "cuda")
LoraBackend = TorchLoraBackend | CudaLoraBackend

_TORCH_BACKEND = TorchLoraBackend()


def requested_backend(backend: str | None = None) -> str:
    """``backend`` checked, or when None the user's ``PUNICA_HF_BACKEND`` (default ``"auto"``): one of ``BACKENDS``."""
    source = "backend"
    if backend is None:
        source, backend = "PUNICA_HF_BACKEND", os.environ.get("PUNICA_HF_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {backend!r}")
    return backend


def backend_for(
    device: torch.device | str, requested: str = "auto", kernels: KernelConfig | None = None
) -> LoraBackend:
    """The LoRA backend for tensors on ``device``: ``requested`` is ``"torch"``, ``"cuda"`` (raises if the kernels
    cannot be built or ``device`` is not a GPU) or ``"auto"`` (the kernels on a GPU when they build, else the
    reference). ``kernels``: the paths the CUDA backend takes (default ``KernelConfig()``). Builds the kernels on
    the first CUDA call: callers decide this once, outside any traced or captured region."""
    device = torch.device(device)
    requested = requested_backend(requested)
    if requested == "torch" or (requested == "auto" and (device.type != "cuda" or not kernels_available())):
        return _TORCH_BACKEND
    if device.type != "cuda":
        raise ValueError(f"the cuda LoRA backend needs CUDA tensors, got tensors on {device}")
    return CudaLoraBackend(kernels)  # raises with the build error
