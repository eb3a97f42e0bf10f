"""The PyTorch LoRA ops behind opaque custom ops, standing in for the CUDA kernels on the CPU: a forward through them
compiles to one graph, as it does with the kernels (the PyTorch ops read tables on the host: graph breaks)."""

from __future__ import annotations

import os

import torch

from punica_hf import MultiLoraModel, ops
from punica_hf.ops import build_segments


@torch.library.custom_op("punica_hf_test::lora_add", mutates_args=("y",))
def _opaque_lora_add(
    y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor,
    lora_ranks: torch.Tensor, token_slots: torch.Tensor, num_slots: int, max_rank: int,
) -> None:
    """The reference op behind one opaque call, as the CUDA op is to torch.compile (its host reads stay outside);
    like the binding it takes ``y [..., H_out]`` and ``x [..., H_in]``, tokens in the leading dimensions."""
    from punica_hf.ops import torch_ops

    segments = build_segments(token_slots, num_slots)
    y_tokens = y.view(-1, y.shape[-1])
    torch_ops.lora_add(y_tokens, x.reshape(-1, x.shape[-1]), pool, a_offsets, b_offsets, lora_ranks, segments,
                       max_rank)


@torch.library.custom_op("punica_hf_test::lora_delta", mutates_args=())
def _opaque_lora_delta(
    x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, lora_ranks: torch.Tensor,
    token_slots: torch.Tensor, num_slots: int, max_rank: int, out_features: list[int],
) -> torch.Tensor:
    """The reference grouped op behind one opaque call, as the CUDA ``lora_delta`` is to torch.compile."""
    from punica_hf.ops import torch_ops

    segments = build_segments(token_slots, num_slots)
    return torch_ops.lora_delta(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)


@_opaque_lora_delta.register_fake
def _(x, pool, a_offsets, b_offsets, lora_ranks, token_slots, num_slots, max_rank, out_features):
    return x.new_empty(x.shape[0], sum(out_features))


class OpaqueKernelBackend:
    """A LoRA backend shaped as ``ops.CudaLoraBackend`` (same entries, the same static limits for the unchecked ones)
    whose calls are the opaque CPU ops above."""

    name = "opaque"

    def takes_unchecked(self, dtype, in_features, out_features, max_rank) -> bool:
        return dtype == torch.float32 and in_features % 8 == 0 and out_features % 8 == 0

    def lora_add_unchecked(self, y, x, pool, a_offsets, b_offsets, ranks, segments, max_rank) -> None:
        _opaque_lora_add(y, x, pool, a_offsets, b_offsets, ranks, segments.token_slots, segments.num_slots, max_rank)

    def lora_delta_unchecked(self, x, pool, a_offsets, b_offsets, ranks, segments, max_rank, out_features):
        return _opaque_lora_delta(x, pool, a_offsets, b_offsets, ranks, segments.token_slots, segments.num_slots,
                                  max_rank, out_features)

    lora_add = lora_add_unchecked
    lora_delta = lora_delta_unchecked


def route_to_opaque_kernels(wrapped: MultiLoraModel, monkeypatch, decided: bool = True) -> OpaqueKernelBackend:
    """The hooks take their CUDA route, with the opaque CPU ops above standing in for the kernels; returns the
    backend they call. ``decided=False``: the backend is decided again at the next call that asks for it, as the
    CUDA one is the first time, in a way Dynamo cannot trace (finding the built kernels reads files), so a decision
    left to a compiled forward breaks its graph."""
    backend = OpaqueKernelBackend()
    if decided:
        monkeypatch.setattr(wrapped._injection.context, "backend", lambda device: backend)
        return backend

    def backend_for(device, requested, kernels):
        os.stat(__file__)
        return backend

    monkeypatch.setattr(ops, "backend_for", backend_for)
    monkeypatch.setattr(wrapped._injection.context, "_backends", {})
    return backend
