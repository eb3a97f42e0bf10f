"""The paged attention reference (``ops.attention``) against independent float64 math, SDPA, and its checks (CPU).

Every batch lays its keys out in scattered cache slots; every cache slot no sequence owns holds NaN, and so do the
padding query rows: a read of anything the semantics exclude (padding rows, key_slots past cu_seq_lens_k[B],
unused slots) shows up as NaN in the output.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from punica_hf import ops
from punica_hf.ops import attention


def _batch(q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, dtype=torch.float64, seed=0, pad_rows=0,
           pad_seqs=0, extra_keys=0, spare_slots=7, slot_dtype=torch.int32):
    """Arguments of one call: B = len(q_lens) sequences (+ pad_seqs empty ones at the end, repeating the last cu
    entries), pad_rows NaN query rows past the last sequence, extra_keys key_slots entries past cu_seq_lens_k[B]
    pointing at NaN slots. Keys sit in random distinct slots of a cache with spare NaN slots."""
    gen = torch.Generator().manual_seed(seed)
    used_rows, used_keys = sum(q_lens), sum(k_lens)
    num_slots = used_keys + extra_keys + spare_slots
    order = torch.randperm(num_slots, generator=gen)
    key_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    value_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    unused = order[used_keys:]
    key_cache[unused] = float("nan")
    value_cache[unused] = float("nan")
    query = torch.randn(used_rows + pad_rows, num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    query[used_rows:] = float("nan")
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()] + [used_rows] * pad_seqs, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()] + [used_keys] * pad_seqs, dtype=torch.int32)
    key_slots = order[: used_keys + extra_keys].to(slot_dtype)
    return (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), key_slots, cu_q, cu_k,
            head_dim**-0.5)


def _float64_math(query, key_cache, value_cache, key_slots, cu_q, cu_k, scale):
    """The definition, one (row, head) at a time in float64: row i of sequence b sees its first
    k_len - q_len + i + 1 keys (none: zero)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[1]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        q_len, k_len = starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]
        for i in range(q_len):
            visible = k_len - q_len + i + 1
            if visible <= 0:
                continue
            slots = key_slots[starts_k[b] : starts_k[b] + visible].long()
            for head in range(query.shape[1]):
                keys = key_cache[slots, head // group].double()  # [visible, D]
                values = value_cache[slots, head // group].double()
                scores = keys @ query[starts_q[b] + i, head].double() * scale
                weights = torch.exp(scores - scores.max())
                out[starts_q[b] + i, head] = (weights / weights.sum()) @ values
    return out


TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

CASES = {
    # name: (q_lens, k_lens, Hq, Hkv, D, padding)
    "prefill": ([5, 1, 9], [5, 1, 9], 4, 4, 16, {}),
    "decode": ([1] * 7, [3, 40, 1, 17, 8, 25, 2], 8, 2, 32, {}),
    "mixed": ([1, 6, 1, 3], [17, 6, 1, 10], 6, 2, 8, {}),  # chunked prefill on history, decode rows, group 3
    "mqa": ([2, 1, 4], [9, 30, 4], 8, 1, 16, {}),
    "padded": ([2, 0, 1, 4], [5, 3, 12, 4], 4, 2, 16, {"pad_rows": 5, "pad_seqs": 3, "extra_keys": 6}),
    "fewer_keys_than_queries": ([4, 5, 2], [2, 0, 6], 4, 2, 8, {"pad_rows": 2}),  # rows with no key: zero
    "empty_middle_and_keys_only": ([3, 0, 0, 2], [3, 9, 0, 5], 2, 1, 8, {"extra_keys": 2}),
}


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_float64_math(case, dtype, slot_dtype):
    q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, padding = case
    args = _batch(q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed=len(q_lens) + head_dim,
                  slot_dtype=slot_dtype, **padding)
    out = attention.paged_attention_reference(*args)
    expected = _float64_math(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert torch.isfinite(out).all(), "a read of a padding row, an extra key slot or an unused cache slot"
    used_rows = sum(q_lens)
    assert torch.equal(out[used_rows:], torch.zeros_like(out[used_rows:])), "padding rows must be zero"
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
    # rows without any visible key are exactly zero
    silent = expected.abs().sum(dim=(1, 2)) == 0
    assert torch.equal(out[silent], torch.zeros_like(out[silent]))


def test_dispatch_on_cpu_runs_the_reference():
    args = _batch([3, 1], [5, 7], 4, 2, 16, torch.float32, seed=3)
    assert attention.attention_backend(*args[:3]) == "torch"
    assert torch.equal(ops.paged_attention(*args), attention.paged_attention_reference(*args))
    assert torch.equal(ops.paged_attention(*args, backend="torch"), attention.paged_attention_reference(*args))


def test_reference_reads_cache_views_with_a_slot_stride():
    """A cache whose slots are further apart than [Hkv, D] (a view into storage interleaving K and V, as
    transformers' pages do): same result as on dense copies."""
    query, key_cache, value_cache, key_slots, cu_q, cu_k, scale = _batch([2, 3], [6, 3], 4, 2, 64, seed=5)
    storage = torch.stack([key_cache, value_cache], dim=1)  # [N, 2, Hkv, D]
    key_view, value_view = storage[:, 0], storage[:, 1]
    assert key_view.stride(0) == 2 * 2 * 64 and not key_view.is_contiguous()
    out = attention.paged_attention_reference(query, key_view, value_view, key_slots, cu_q, cu_k, scale)
    assert torch.equal(out, attention.paged_attention_reference(query, key_cache, value_cache, key_slots, cu_q, cu_k,
                                                                scale))
    # the kernel takes this layout too (only the device is wrong here)
    storage = storage.bfloat16()
    assert "CUDA tensors" in attention.cuda_unsupported(query.bfloat16(), storage[:, 0], storage[:, 1])


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_equals_sdpa_for_one_sequence(num_q_heads, num_kv_heads):
    """One sequence of L tokens in scattered slots: the reference is causal SDPA over the gathered K/V; a prefill
    chunk (the last q_len rows over all L keys) is the last q_len rows of it."""
    length, head_dim = 13, 16
    query, key_cache, value_cache, key_slots, cu_q, cu_k, scale = _batch([length], [length], num_q_heads,
                                                                         num_kv_heads, head_dim, seed=num_q_heads)
    group = num_q_heads // num_kv_heads
    keys = key_cache[key_slots.long()].repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = value_cache[key_slots.long()].repeat_interleave(group, dim=1)
    sdpa = F.scaled_dot_product_attention(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                          is_causal=True, scale=scale).transpose(0, 1)
    out = attention.paged_attention_reference(query, key_cache, value_cache, key_slots, cu_q, cu_k, scale)
    torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)
    q_len = 4
    chunk = attention.paged_attention_reference(query[-q_len:], key_cache, value_cache, key_slots,
                                                torch.tensor([0, q_len], dtype=torch.int32), cu_k, scale)
    torch.testing.assert_close(chunk, sdpa[-q_len:], rtol=1e-12, atol=1e-12)


def test_no_sequences_and_no_rows():
    query, key_cache, value_cache, key_slots, _, _, scale = _batch([2], [2], 2, 1, 8, torch.float32, seed=1)
    empty_cu = torch.zeros(1, dtype=torch.int32)  # B = 0: every row is padding
    out = ops.paged_attention(query, key_cache, value_cache, key_slots, empty_cu, empty_cu, scale)
    assert torch.equal(out, torch.zeros_like(query))
    no_rows = ops.paged_attention(query[:0], key_cache, value_cache, key_slots[:0], empty_cu, empty_cu, scale)
    assert no_rows.shape == (0, 2, 8)


def _bad_arguments():
    """(name, mutate(args) -> args, message pattern): one wrong thing each."""
    def replace(index, value):
        return lambda args: args[:index] + (value,) + args[index + 1 :]

    def replace_with(index, change):
        return lambda args: args[:index] + (change(args[index]),) + args[index + 1 :]

    return [
        ("query_2d", replace_with(0, lambda q: q[:, 0]), r"expected query \[Tq, Hq, D\]"),
        ("int_query", replace_with(0, lambda q: q.to(torch.int32)), "dtype torch.int32 not supported"),
        ("mixed_dtypes", replace_with(1, lambda k: k.half()), "share one dtype"),
        ("cache_shapes", replace_with(2, lambda v: v[:-1]), "must have one shape"),
        ("head_size", replace_with(0, lambda q: q[..., :8]), "head size 16 differs"),
        ("heads_not_multiple", replace_with(0, lambda q: q[:, :3]), r"query heads \(3\) must be a positive multiple"),
        ("float_slots", replace_with(3, lambda s: s.float()), "key_slots must be 1-D int32 or int64"),
        ("2d_slots", replace_with(3, lambda s: s[None]), "key_slots must be 1-D"),
        ("int64_cu", replace_with(4, lambda c: c.long()), "cu_seq_lens_q must be 1-D int32"),
        ("empty_cu", replace_with(5, lambda c: c[:0]), r"cu_seq_lens_k must be 1-D int32 with B \+ 1 >= 1"),
        ("cu_lengths", replace_with(5, lambda c: torch.cat([c, c[-1:]])), "must have one length"),
        ("devices", replace_with(3, lambda s: s.to("meta")), "one device"),
        ("scale_tensor", replace(6, torch.tensor(0.5)), "scale must be a finite number"),
        ("scale_nan", replace(6, float("nan")), "scale must be a finite number"),
        ("not_a_tensor", replace(1, [1.0]), "key_cache must be a tensor"),
    ]


@pytest.mark.parametrize("name,mutate,message", _bad_arguments(), ids=[b[0] for b in _bad_arguments()])
def test_bad_arguments_raise_value_error(name, mutate, message):
    args = _batch([2, 3], [4, 3], 4, 2, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match=message):
        ops.paged_attention(*mutate(args))


def test_kernel_limits_are_named():
    """What the CUDA kernel does not take, and what backend="cuda" / a bad backend name do on CPU."""
    query, key_cache, value_cache, *rest = _batch([2], [3], 4, 2, 64, torch.bfloat16, seed=4)
    assert "float16 and bfloat16" in attention.cuda_unsupported(query.float(), key_cache.float(), value_cache.float())
    assert "head sizes" in attention.cuda_unsupported(query[..., :48], key_cache[..., :48], value_cache[..., :48])
    wide = torch.zeros(key_cache.shape[0], 2, 2 * 64, dtype=torch.bfloat16)[..., ::2]  # every other element
    assert "contiguous" in attention.cuda_unsupported(query, wide, wide)
    odd = torch.zeros(key_cache.shape[0] * 129 + 1, dtype=torch.bfloat16)[1:].view(-1, 129)[:, :128].view(-1, 2, 64)
    assert "multiples of 8" in attention.cuda_unsupported(query, odd, odd)
    assert "CUDA tensors" in attention.cuda_unsupported(query, key_cache, value_cache)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attention.paged_attention_cuda(query, key_cache, value_cache, *rest)
    with pytest.raises(ValueError, match="backend must be"):
        ops.paged_attention(query, key_cache, value_cache, *rest, backend="triton")


def test_backend_argument_is_honoured():
    args = _batch([2], [3], 2, 1, 8, torch.float32, seed=6)
    with pytest.raises(ValueError, match="the CUDA kernel takes float16"):
        ops.paged_attention(*args, backend="cuda")
    assert attention.attention_backend(*args[:3]) == "torch"
    assert torch.isfinite(ops.paged_attention(*args, backend="torch")).all()


def test_scale_is_applied():
    """Doubling the scale equals doubling the queries (the scale multiplies q . k, nothing else)."""
    query, key_cache, value_cache, key_slots, cu_q, cu_k, scale = _batch([3, 2], [5, 2], 4, 2, 16, seed=8)
    doubled = attention.paged_attention_reference(query, key_cache, value_cache, key_slots, cu_q, cu_k, 2 * scale)
    torch.testing.assert_close(doubled, attention.paged_attention_reference(2 * query, key_cache, value_cache,
                                                                            key_slots, cu_q, cu_k, scale))
    assert not torch.allclose(doubled, attention.paged_attention_reference(query, key_cache, value_cache, key_slots,
                                                                           cu_q, cu_k, scale))
    assert math.isclose(scale, 16**-0.5)
