"""Attention over transformers' paged KV cache: the decode and prefill rows of many sequences in one call.

Layout (transformers' continuous batching). Per layer, ``key_cache`` / ``value_cache`` ``[N, Hkv, D]`` are
indexed by cache slot (``page * page_size + offset``). A step packs the queries of ``B`` sequences into
``query`` ``[Tq, Hq, D]``: sequence ``b`` owns rows ``cu_seq_lens_q[b] : cu_seq_lens_q[b + 1]`` (``q_len`` of
them) and the keys in cache slots ``key_slots[cu_seq_lens_k[b] : cu_seq_lens_k[b + 1]]`` (``k_len``, in position
order; the step's own new keys are the last ``q_len``, already written). Query ``i`` of a sequence (0-based)
attends to keys ``0 .. k_len - q_len + i``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.

Padding (how transformers makes static shapes for CUDA graphs): rows at or past ``cu_seq_lens_q[B]`` belong to
no sequence, come out zero and are never read; ``key_slots`` past ``cu_seq_lens_k[B]`` are never read; repeated
``cu`` entries are empty sequences. A row whose causal range is empty (``k_len < q_len``) comes out zero. The
``cu`` tables must be non-decreasing; values past ``Tq`` / ``Tk`` are clamped.

Backends. ``paged_attention`` runs the CUDA kernel (``csrc/paged_attention.cu``) on CUDA tensors it takes
(``CUDA_DTYPES``, ``CUDA_HEAD_DIMS``, each slot's ``[Hkv, D]`` block dense) when the extension builds, and the
PyTorch reference otherwise; the argument ``backend="torch"|"cuda"`` forces one (``"cuda"`` raises for what the
kernel does not take). The kernel reads every length on the device: no host sync, capturable in a CUDA graph,
traceable by ``torch.compile``. The reference loops over the sequences on the host (it syncs once per call).
"""

from __future__ import annotations

import math

import torch

from . import cuda

CUDA_DTYPES = (torch.float16, torch.bfloat16)  # what the kernel takes
CUDA_HEAD_DIMS = (64, 128, 256)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SLOT_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 64  # most key splits per row the kernel takes (PUNICA_ATTENTION_MAX_SPLITS)


def check_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          key_slots: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor,
                          scale: float) -> None:
    """ValueError naming the problem for arguments neither backend takes (static properties only: no sync)."""
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "key_slots": key_slots,
               "cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"paged_attention: {name} must be a tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or key_cache.dim() != 3 or value_cache.dim() != 3:
        raise ValueError(f"paged_attention: expected query [Tq, Hq, D], key_cache and value_cache [N, Hkv, D], got "
                         f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if query.dtype not in REFERENCE_DTYPES:
        raise ValueError(f"paged_attention: dtype {query.dtype} not supported (float16, bfloat16, float32, float64)")
    if not (key_cache.dtype == value_cache.dtype == query.dtype):
        raise ValueError(f"paged_attention: query, key_cache and value_cache must share one dtype, got {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: key_cache {tuple(key_cache.shape)} and value_cache "
                         f"{tuple(value_cache.shape)} must have one shape")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    if key_cache.shape[2] != head_dim:
        raise ValueError(f"paged_attention: the caches' head size {key_cache.shape[2]} differs from query's {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"paged_attention: query heads ({num_q_heads}) must be a positive multiple of kv heads "
                         f"({num_kv_heads})")
    if key_slots.dim() != 1 or key_slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"paged_attention: key_slots must be 1-D int32 or int64, got {key_slots.dtype} of shape "
                         f"{tuple(key_slots.shape)}")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        table = tensors[name]
        if table.dim() != 1 or table.dtype != torch.int32 or table.shape[0] < 1:
            raise ValueError(f"paged_attention: {name} must be 1-D int32 with B + 1 >= 1 entries, got {table.dtype} "
                             f"of shape {tuple(table.shape)}")
    if cu_seq_lens_q.shape != cu_seq_lens_k.shape:
        raise ValueError(f"paged_attention: cu_seq_lens_q {tuple(cu_seq_lens_q.shape)} and cu_seq_lens_k "
                         f"{tuple(cu_seq_lens_k.shape)} must have one length (B + 1)")
    devices = {name: tensor.device for name, tensor in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"paged_attention: all tensors must be on one device, got {devices}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"paged_attention: scale must be a finite number, got {scale!r}")


def check_splits(splits: int) -> None:
    if isinstance(splits, bool) or not isinstance(splits, int) or not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: splits must be an int in [0, {MAX_SPLITS}] (0: the launcher's choice), "
                         f"got {splits!r}")


def cuda_unsupported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """Why the CUDA kernel cannot take these (checked) arguments, or None when it can (static properties only)."""
    if query.dtype not in CUDA_DTYPES:
        return f"the CUDA kernel takes float16 and bfloat16, not {query.dtype}"
    head_dim = query.shape[2]
    if head_dim not in CUDA_HEAD_DIMS:
        return f"the CUDA kernel takes head sizes {CUDA_HEAD_DIMS}, not {head_dim}"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(2) != 1 or (cache.shape[1] > 1 and cache.stride(1) != head_dim):
            return f"the CUDA kernel needs each slot of {name} ([Hkv, D]) contiguous, got strides {cache.stride()}"
        # 16-byte loads: slot starts 8 elements apart (the allocator aligns the storage itself)
        # torch.compile cannot trace storage_offset(): while it traces, the binding's own check has the last word
        misplaced = not torch.compiler.is_compiling() and cache.storage_offset() % 8
        if (cache.shape[0] > 1 and cache.stride(0) % 8) or misplaced:
            return (f"the CUDA kernel needs {name}'s slots at multiples of 8 elements, got slot stride "
                    f"{cache.stride(0)} and offset {cache.storage_offset()}")
    if query.device.type != "cuda":
        return f"the CUDA kernel needs CUDA tensors, got tensors on {query.device}"
    return None


def attention_backend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The backend ``paged_attention(backend="auto")`` uses for these (checked) arguments: ``"cuda"`` where the
    kernel takes them and builds, else ``"torch"``. Builds the extension on its first CUDA call: callers that trace
    (torch.compile) decide it eagerly once and pass it as ``backend``."""
    if query.device.type == "cuda" and cuda_unsupported(query, key_cache, value_cache) is None:
        if cuda.kernels_available():
            return "cuda"
    return "torch"


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              key_slots: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor,
                              scale: float, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch reference: ``[Tq, Hq, D]`` in query's dtype, the semantics of the module docstring exactly.

    One batch of matmuls per sequence: its keys and values gathered by slot, GQA by repeating each kv head, the
    causal mask on the scores, softmax in ``compute_dtype`` (default float32, float64 for float64 inputs). Reads
    the ``cu`` tables on the host (one sync).
    """
    compute = compute_dtype or torch.promote_types(query.dtype, torch.float32)
    num_rows, num_q_heads, _ = query.shape
    group_size = num_q_heads // key_cache.shape[1]
    num_keys = key_slots.shape[0]
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)  # padding rows stay zero
    starts_q, starts_k = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
    for b in range(len(starts_q) - 1):
        q_start = min(max(starts_q[b], 0), num_rows)
        q_end = min(max(starts_q[b + 1], q_start), num_rows)
        k_start = min(max(starts_k[b], 0), num_keys)
        k_end = min(max(starts_k[b + 1], k_start), num_keys)
        q_len, k_len = q_end - q_start, k_end - k_start
        if q_len == 0 or k_len == 0:
            continue
        slots = key_slots[k_start:k_end].long()
        keys = key_cache[slots].to(compute).repeat_interleave(group_size, dim=1)  # [k_len, Hq, D]
        values = value_cache[slots].to(compute).repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[q_start:q_end].to(compute), keys) * scale
        last_key = torch.arange(q_len, device=query.device) + (k_len - q_len)  # [q_len]: row i's last visible key
        visible = torch.arange(k_len, device=query.device)[None, :] <= last_key[:, None]  # [q_len, k_len]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.where(visible.any(dim=-1)[None, :, None], probs, 0.0)  # rows without keys: 0, not NaN
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def paged_attention_cuda(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         key_slots: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor,
                         scale: float, splits: int = 0) -> torch.Tensor:
    """The CUDA kernel: a new ``[Tq, Hq, D]`` tensor; no host sync, so capturable and traceable.

    One launch (two when each row's keys are split: decode batches too small to fill the GPU), the launch shape
    from static shapes only. ``splits``: 0 = the launcher's choice, else the split count to use (tests, benchmarks).
    Arguments the kernel does not take raise ValueError.
    """
    check_paged_attention(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale)
    check_splits(splits)
    return _run_kernel(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale, splits)


def _run_kernel(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale, splits) -> torch.Tensor:
    """The kernel on checked arguments (``check_paged_attention``, ``check_splits``); ValueError for what it does
    not take. The binding checks shapes, dtypes, devices and alignment again before the launch."""
    reason = cuda_unsupported(query, key_cache, value_cache)
    if reason is not None:
        raise ValueError(f"paged_attention: {reason}")
    if cuda._attention_op is None:
        cuda.load_extension()
    return cuda._attention_op(query.contiguous(), key_cache, value_cache, key_slots.contiguous(),
                              cu_seq_lens_q.contiguous(), cu_seq_lens_k.contiguous(), float(scale), splits)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    key_slots: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, scale: float,
                    backend: str = "auto", splits: int = 0) -> torch.Tensor:
    """Causal attention of the packed ``query`` rows ``[Tq, Hq, D]`` over the paged cache: ``[Tq, Hq, D]``.

    ``key_cache`` / ``value_cache`` ``[N, Hkv, D]``, ``key_slots`` ``[Tk]`` int32 or int64, ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` ``[B + 1]`` int32, ``scale`` the softmax scale; semantics and padding in the module
    docstring. ``backend``: ``"auto"`` (``attention_backend(...)``), ``"cuda"`` or ``"torch"``. ``splits``: the
    kernel's key splits per row, 0 = its own choice (the reference ignores it). Bad arguments raise ValueError.
    """
    check_paged_attention(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale)
    check_splits(splits)
    if backend == "auto":
        backend = attention_backend(query, key_cache, value_cache)
    if backend == "cuda":
        return _run_kernel(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale, splits)
    if backend != "torch":
        raise ValueError(f"paged_attention: backend must be 'auto', 'cuda' or 'torch', got {backend!r}")
    return paged_attention_reference(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale)
