"""The engine's attention: transformers' paged KV cache read in place by ``ops.paged_attention``.

Without flash-attn, transformers' paged paths (``paged|sdpa``, ``paged|eager``) copy every running request's keys
and values out of the cache at every layer of every step, attend with a ``[T, T + cache]`` mask built on the host,
and leave CUDA graphs off: their decode steps are several times slower than a compiled static-cache step (numbers
in benchmarks/README.md). This path writes the step's new keys and values into the cache and attends through the
step's slot lists: no copy, no mask, graphable.

``transformers_cb`` registers it with transformers under ``NAME`` (why that name: see there). When flash-attn is
installed the engine leaves the choice to transformers; models with sliding-window layers keep transformers' own
paged sdpa path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from .. import ops
from ..base_layers import activation_dtype
from ..ops import attention as ops_attention
from .transformers_cb import ATTENTION_NAME as NAME
from .transformers_cb import SDPA_NAME as SDPA
from .transformers_cb import layer_cache


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str  # the config's attention implementation while the engine runs; None: transformers picks
    path: str  # in words, for logs and metrics
    reason: str


def choose(hf_model) -> AttentionChoice:
    """The attention path the engine runs ``hf_model`` with."""
    if _flash_attn_installed():
        return AttentionChoice(None, "flash-attn (transformers)", "flash-attn is installed")
    windows = _sliding_windows(hf_model)
    if windows:
        return AttentionChoice(SDPA, "transformers paged sdpa", f"the model has sliding-window layers {windows}")
    if hf_model.device.type != "cuda":  # the PyTorch reference: no graphs on the CPU anyway
        return AttentionChoice(NAME, "punica_hf paged attention (PyTorch ops)", "the model is on the CPU")
    text_config = hf_model.config.get_text_config()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    dtype = activation_dtype(hf_model)  # not model.dtype: float8 when an fp8 embedding comes first
    if dtype not in ops_attention.CUDA_DTYPES or head_dim not in ops_attention.CUDA_HEAD_DIMS:
        # the reference would sync inside every step: no CUDA graphs
        return AttentionChoice(SDPA, "transformers paged sdpa", f"the kernel takes float16 / bfloat16 and head sizes "
                               f"{ops_attention.CUDA_HEAD_DIMS}, not {dtype} and {head_dim}")
    return AttentionChoice(NAME, "punica_hf paged kernel", "flash-attn is not installed")


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one layer over transformers' paged cache, called by the model's attention modules.

    ``query`` ``[1, Hq, T, D]``: the step's ``T`` packed tokens (padding included); ``key`` / ``value``
    ``[1, Hkv, T, D]``: their new keys and values; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[B + 1]`` in ``kwargs``
    delimit each sequence's queries and keys. ``kwargs`` also hold the paged ``cache`` and the step's slot lists
    (``write_index``: the new tokens' slots, ``read_index``: every sequence's key slots in order, both per attention
    group): transformers hands them over itself up to 5.23, ``transformers_cb``'s cache from 5.24 on, where
    transformers' own ``cache.update`` would copy the keys out. This writes the new tokens into the cache and reads
    every key where it lies. Returns ``[1, T, Hq, D]``.
    """
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError("punica_hf's paged attention needs transformers' paged cache in its arguments: it runs "
                         "inside the serving engine's continuous batching only")
    layer = layer_cache(cache, module.layer_idx)
    cu_seq_lens_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_seq_lens_k, dict):  # one entry per layer type
        cu_seq_lens_k = cu_seq_lens_k["full_attention"]
    # Compiled steps (EngineConfig.compile_steps) see the cache write and the kernel as one op that declares what it
    # writes: no graph break per layer, and the compiler writes the cache in place rather than copying it.
    attend = write_and_attend if torch.compiler.is_compiling() else _write_and_attend
    output = attend(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layer.keys, layer.key_row,
        layer.values, layer.value_row, layer.rows, kwargs["write_index"][layer.group],
        kwargs["read_index"][layer.group], kwargs["cu_seq_lens_q"], cu_seq_lens_k,
        module.scaling if scaling is None else scaling,
    )
    return output.unsqueeze(0), None


def _write_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, key_row: int,
                      values: torch.Tensor, value_row: int, rows: int, write_index: torch.Tensor,
                      read_index: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Write the step's keys and values ``[T, Hkv, D]`` into the layer's cache at ``write_index`` ``[T]``, then
    attend ``query`` ``[T, Hq, D]`` over the keys at ``read_index``: ``[T, Hq, D]``. The layer's cache is rows
    ``key_row`` to ``key_row + rows`` of ``keys`` ``[N, Hkv, D]``, and the same of ``values`` (``LayerCache``;
    ``keys`` and ``values`` may be one tensor)."""
    key_cache = keys[key_row:key_row + rows]
    value_cache = values[value_row:value_row + rows]
    key_cache.index_copy_(0, write_index, key)
    value_cache.index_copy_(0, write_index, value)
    # No cached keys (prefills only): the keys are the new tokens, in the slots just written, cu_k == cu_q.
    key_slots = read_index if read_index.numel() else write_index
    return ops.paged_attention(query.contiguous(), key_cache, value_cache, key_slots, cu_seq_lens_q.to(torch.int32),
                               cu_seq_lens_k.to(torch.int32), scale)


write_and_attend = torch.library.custom_op(
    "punica_hf_serving::write_and_attend", _write_and_attend, mutates_args=("keys", "values"))


@write_and_attend.register_fake
def _write_and_attend_fake(query, key, value, keys, key_row, values, value_row, rows, write_index, read_index,
                           cu_seq_lens_q, cu_seq_lens_k, scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _sliding_windows(hf_model) -> list[int]:
    layer_types = getattr(hf_model.config.get_text_config(), "layer_types", None) or []
    return sorted({i for i, kind in enumerate(layer_types) if kind != "full_attention"})


def _flash_attn_installed() -> bool:
    return is_flash_attn_2_available() or is_flash_attn_3_available()
