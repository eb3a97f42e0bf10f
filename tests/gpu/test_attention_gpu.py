"""The paged attention kernel against the float64 reference, on fresh random inputs (the seed is in every message).

Keys live in random pages of a paged cache (transformers' layout: slot = page * page_size + offset). Every cache
slot no sequence owns is NaN, padding query rows are NaN, and key_slots past cu_seq_lens_k[B] point at NaN slots:
a read the semantics exclude shows up as NaN. The op returns a fresh tensor; the memory it is made in was all NaN
just before (the caching allocator hands the freed block back), so an element the kernel forgets to write shows up
too. Padding rows and rows without keys must be exactly zero; every other row must match the reference (queries in
float64, so it computes in float64) within a relative error per row. Imports only ``punica_hf.ops``.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import punica_hf.ops as ops
from punica_hf.ops import attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Relative error per row ||out - ref|| / ||ref||: the output's rounding, P rounded to the input dtype before P.V
# (as flash attention does), fp32 accumulation.
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
PAGE_SIZE = 16


@dataclass
class Batch:
    """One call's arguments (``args()``) and what the checks need."""

    query: torch.Tensor  # [Tq, Hq, D]
    key_cache: torch.Tensor  # [N, Hkv, D]
    value_cache: torch.Tensor
    key_slots: torch.Tensor  # [Tk]
    cu_seq_lens_q: torch.Tensor  # [B + 1] int32
    cu_seq_lens_k: torch.Tensor
    scale: float
    used_rows: int  # rows past it are padding

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.key_slots, self.cu_seq_lens_q,
                self.cu_seq_lens_k, self.scale)


def _slots_in_pages(pages: torch.Tensor, k_len: int) -> torch.Tensor:
    """The first k_len cache slots of ``pages``, in order: a sequence's keys in position order."""
    return (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()[:k_len]


def _layout(q_lens, k_lens, pad_seqs, extra_keys, gen, spare_pages=3):
    """Host-side layout: random pages per sequence; returns (key slot list, number of cache slots, cu tables)."""
    pages_per_seq = [-(-k // PAGE_SIZE) for k in k_lens]
    num_pages = sum(pages_per_seq) + -(-extra_keys // PAGE_SIZE) + spare_pages
    page_order = torch.randperm(num_pages, generator=gen)
    slots, next_page = [], 0
    for k_len, pages in zip(k_lens, pages_per_seq):
        slots.append(_slots_in_pages(page_order[next_page : next_page + pages], k_len))
        next_page += pages
    used = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    owned = torch.zeros(num_pages * PAGE_SIZE, dtype=torch.bool)
    owned[used] = True
    free = torch.nonzero(~owned).flatten()
    extra = free[torch.randperm(free.numel(), generator=gen)[:extra_keys]]
    used_rows, used_keys = sum(q_lens), sum(k_lens)
    cu_q = [0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()] + [used_rows] * pad_seqs
    cu_k = [0, *torch.tensor(k_lens, dtype=torch.int64).cumsum(0).tolist()] + [used_keys] * pad_seqs
    return torch.cat([used, extra]), owned, cu_q, cu_k


def _batch(q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed, pad_rows=0, pad_seqs=0, extra_keys=0,
           slot_dtype=torch.int32, scale=None) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device="cuda").manual_seed(seed)
    key_slots, owned, cu_q, cu_k = _layout(q_lens, k_lens, pad_seqs, extra_keys, gen)
    shape = (owned.numel(), num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=device_gen, device="cuda").to(dtype)
    value_cache = torch.randn(shape, generator=device_gen, device="cuda").to(dtype)
    unused = (~owned).cuda()
    key_cache[unused] = float("nan")
    value_cache[unused] = float("nan")
    used_rows = sum(q_lens)
    query = torch.randn(used_rows + pad_rows, num_q_heads, head_dim, generator=device_gen, device="cuda").to(dtype)
    query[used_rows:] = float("nan")
    return Batch(query, key_cache, value_cache, key_slots.to(device="cuda", dtype=slot_dtype),
                 torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                 torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                 head_dim**-0.5 if scale is None else scale, used_rows)


def _reference(batch: Batch) -> torch.Tensor:
    """float64 reference (the queries in float64 make it compute in float64; caches read in their dtype)."""
    args = list(batch.args())
    args[0] = args[0].double()
    return attention.paged_attention_reference(*args)


def _run(batch: Batch, splits: int = 0) -> torch.Tensor:
    """The kernel (``splits`` 0: the launcher's split count), in memory that was all NaN just before."""
    poison = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype, device="cuda")
    del poison
    return attention.paged_attention_cuda(*batch.args(), splits=splits)


def _assert_matches(out: torch.Tensor, expected: torch.Tensor, batch: Batch, context: str):
    dtype = batch.query.dtype
    assert out.dtype == dtype and out.shape == batch.query.shape, context
    assert torch.isfinite(out).all(), f"non-finite output: a NaN slot, padding row or unwritten element ({context})"
    assert (out[batch.used_rows :] == 0).all(), f"padding rows must be exactly zero ({context})"
    silent = expected.abs().amax(dim=(1, 2)) == 0  # rows without any key (k_len < q_len, empty ranges)
    assert (out[silent] == 0).all(), f"rows without keys must be exactly zero ({context})"
    live = ~silent
    if live.any():
        diff = (out[live].double() - expected[live]).flatten(1).norm(dim=1)
        error = diff / expected[live].flatten(1).norm(dim=1)
        worst = int(error.argmax())
        row = int(torch.nonzero(live).flatten()[worst])
        assert error.max() < TOLERANCE[dtype], f"relative error {error.max():.2e} at row {row} ({context})"


def _check(q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, dtype, splits=0, **kwargs):
    seed = secrets.randbits(31)
    batch = _batch(q_lens, k_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed, **kwargs)
    _assert_matches(_run(batch, splits), _reference(batch), batch, f"seed {seed}")


DTYPES = [torch.bfloat16, torch.float16]
GROUPS = {1: (8, 8), 4: (32, 8), 8: (32, 4)}  # group size -> (Hq, Hkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_decode_matches_float64_reference(rows, group, head_dim, dtype):
    """Decode batches (one query row per sequence), k_len 1..4096 at random."""
    seed = secrets.randbits(31)
    k_lens = torch.randint(1, 4097, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = _batch([1] * rows, k_lens, *GROUPS[group], head_dim, dtype, seed)
    _assert_matches(_run(batch), _reference(batch), batch, f"seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 64])
def test_decode_head_dim_256(rows, dtype):
    seed = secrets.randbits(31)
    k_lens = torch.randint(1, 2049, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = _batch([1] * rows, k_lens, 16, 4, 256, dtype, seed)
    _assert_matches(_run(batch), _reference(batch), batch, f"seed {seed}")


MIXED = {
    # name: (q_lens, k_lens)
    "prefill": ([300, 17, 1, 64], [300, 17, 1, 64]),
    "chunked_prefill_and_decode": ([128, 1, 1, 40, 3], [1000, 513, 2, 740, 3]),
    "long_prefill": ([250], [2000]),
    "step_boundaries": ([1] * 10, [1, 2, 15, 16, 17, 31, 32, 33, 63, 65]),  # 16-key steps, 64-key warp rounds
    "fewer_keys_than_queries": ([20, 5, 9], [7, 0, 9]),  # rows without keys: zero
    "many_short": ([3] * 40, [3, 50] * 20),
}
HEADS = {"mha": (8, 8), "gqa4": (32, 8), "group3": (12, 4), "group8": (32, 4), "group16": (32, 2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("lens", MIXED.values(), ids=MIXED.keys())
def test_prefill_and_mixed_batches_match_float64_reference(lens, heads, dtype):
    _check(*lens, *heads, 128, dtype)


@pytest.mark.parametrize("lens", MIXED.values(), ids=MIXED.keys())
@pytest.mark.parametrize("head_dim", [64, 256])
def test_prefill_and_mixed_other_head_sizes(lens, head_dim):
    _check(*lens, 32, 8, head_dim, torch.bfloat16)


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("lens", [MIXED["step_boundaries"], MIXED["chunked_prefill_and_decode"]])
def test_sharp_softmax_finds_the_right_keys(lens, scale):
    """Large scores (scale 1 at D = 128: scores of standard deviation ~11) make each row's softmax nearly one-hot,
    so one key too many or too few at any boundary changes the row entirely."""
    _check(*lens, 32, 8, 128, torch.float16, scale=scale)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_batches(dtype, slot_dtype):
    """Static shapes as transformers pads them: NaN rows past the last sequence, repeated cu entries (empty
    sequences in the middle and at the end), key_slots past cu_seq_lens_k[B] pointing at NaN slots."""
    q_lens = [1, 1, 7, 1, 0, 3, 1, 0, 0, 2]
    k_lens = [90, 1, 7, 300, 12, 40, 17, 0, 5, 2]
    _check(q_lens, k_lens, 32, 8, 128, dtype, pad_rows=25, pad_seqs=9, extra_keys=100, slot_dtype=slot_dtype)


@pytest.mark.parametrize("padded_rows", [0, 1, 33])
def test_every_row_padding(padded_rows):
    """B = 0 (cu tables [0]) and a batch whose only sequences are empty: all zeros, nothing read."""
    seed = secrets.randbits(31)
    batch = _batch([], [], 32, 8, 128, torch.bfloat16, seed, pad_rows=padded_rows, extra_keys=20)
    assert torch.equal(_run(batch), torch.zeros_like(batch.query))
    batch = _batch([0, 0], [3, 0], 32, 8, 128, torch.bfloat16, seed, pad_rows=padded_rows, pad_seqs=2)
    assert torch.equal(_run(batch), torch.zeros_like(batch.query))


@pytest.mark.parametrize("splits", [1, 2, 3, 17, 64])
def test_forced_split_counts_match(splits):
    """Every split count (one: the block writes the output; more: partials and the merge kernel; more splits than
    16-key steps: empty ranges with neutral partials) gives the reference's result."""
    _check([1, 1, 1, 5, 1, 30], [4000, 17, 1, 200, 64, 30], 32, 8, 128, torch.bfloat16, splits=splits, pad_rows=6,
           pad_seqs=2, extra_keys=10)


def test_repeated_calls_give_the_same_bits():
    """No atomics, no race between blocks: the same inputs twice give the same bits."""
    batch = _batch([1] * 31 + [40], [700] * 31 + [900], 32, 8, 128, torch.bfloat16, secrets.randbits(31))
    assert torch.equal(_run(batch), _run(batch))


def test_cache_views_with_a_slot_stride():
    """K and V as views into one storage interleaving them per slot ([N, 2, Hkv, D]: slots 2 * Hkv * D apart)."""
    seed = secrets.randbits(31)
    batch = _batch([1, 9, 1], [300, 9, 40], 32, 8, 128, torch.bfloat16, seed)
    storage = torch.stack([batch.key_cache, batch.value_cache], dim=1)
    strided = Batch(batch.query, storage[:, 0], storage[:, 1], *batch.args()[3:], batch.used_rows)
    assert strided.key_cache.stride(0) == 2 * 8 * 128
    out = _run(strided)
    _assert_matches(out, _reference(batch), strided, f"seed {seed}")
    assert torch.equal(out, _run(batch)), "the same values read through another layout must give the same bits"


def test_cache_views_shifted_along_one_storage():
    """K and V as transformers (5.18 on) lays out one layer of its paged cache, which the engine hands the kernel:
    views of one [rows, Hkv, D] storage in which each block holds a page of keys then a page of values per layer,
    the values' view a page past the keys', both past the layer's offset (a storage offset)."""
    seed = secrets.randbits(31)
    batch = _batch([1, 9, 1], [300, 9, 40], 32, 8, 128, torch.bfloat16, seed)
    layers, layer = 3, 1
    pages, slot_shape = batch.key_cache.shape[0] // PAGE_SIZE, batch.key_cache.shape[1:]
    block_rows = 2 * layers * PAGE_SIZE
    storage = torch.full((pages * block_rows, *slot_shape), float("nan"), dtype=torch.bfloat16, device="cuda")
    blocks = storage.view(pages, 2 * layers, PAGE_SIZE, *slot_shape)
    blocks[:, 2 * layer] = batch.key_cache.view(pages, PAGE_SIZE, *slot_shape)
    blocks[:, 2 * layer + 1] = batch.value_cache.view(pages, PAGE_SIZE, *slot_shape)
    keys, values = storage[2 * layer * PAGE_SIZE :], storage[(2 * layer + 1) * PAGE_SIZE :]
    rows = min(keys.shape[0], values.shape[0])
    slots = batch.key_slots.long()
    block_slots = (slots // PAGE_SIZE * block_rows + slots % PAGE_SIZE).to(batch.key_slots.dtype)
    shifted = Batch(batch.query, keys[:rows], values[:rows], block_slots, *batch.args()[4:], batch.used_rows)
    assert shifted.key_cache.storage_offset() > 0 and shifted.value_cache.storage_offset() > 0
    out = _run(shifted)
    _assert_matches(out, _reference(batch), shifted, f"seed {seed}")
    assert torch.equal(out, _run(batch)), "the same values read through another layout must give the same bits"


def _scenario(gen, num_rows, num_seqs, max_keys, key_capacity, num_pages):
    """New lengths and slots for fixed shapes: q_lens summing to <= num_rows over <= num_seqs sequences (a few
    prefill chunks among decode rows), k_lens >= q_len (<= max_keys); returns (q_lens, k_lens, slots [capacity])."""
    used_seqs = int(torch.randint(1, num_seqs + 1, (1,), generator=gen))
    q_lens = [1] * used_seqs
    for _ in range(3):  # grow a few sequences into prefill chunks while rows remain
        b = int(torch.randint(used_seqs, (1,), generator=gen))
        room = num_rows - sum(q_lens)
        if room > 0:
            q_lens[b] += int(torch.randint(room + 1, (1,), generator=gen))
    k_lens = [q + int(torch.randint(max_keys - q + 1, (1,), generator=gen)) for q in q_lens]
    pages = torch.randperm(num_pages - 1, generator=gen)  # the last page is the NaN one
    slots, next_page = [], 0
    for k_len in k_lens:
        count = -(-k_len // PAGE_SIZE)
        slots.append(_slots_in_pages(pages[next_page : next_page + count], k_len))
        next_page += count
    slots = torch.cat(slots)
    filler = torch.full((key_capacity - slots.numel(),), (num_pages - 1) * PAGE_SIZE)  # the NaN page
    return q_lens, k_lens, torch.cat([slots, filler])


def _static_buffers(seed):
    """Fixed-shape buffers of a captured step: 64 rows, 32 sequences, key_slots capacity; the last page is NaN."""
    num_rows, num_seqs, max_keys = 64, 32, 600
    key_capacity = num_seqs * max_keys
    num_pages = num_seqs * -(-max_keys // PAGE_SIZE) + 1
    device_gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_pages * PAGE_SIZE, 8, 128)
    key_cache = torch.randn(shape, generator=device_gen, device="cuda").bfloat16()
    value_cache = torch.randn(shape, generator=device_gen, device="cuda").bfloat16()
    key_cache[-PAGE_SIZE:] = float("nan")
    value_cache[-PAGE_SIZE:] = float("nan")
    buffers = Batch(torch.zeros(num_rows, 32, 128, dtype=torch.bfloat16, device="cuda"), key_cache, value_cache,
                    torch.zeros(key_capacity, dtype=torch.int32, device="cuda"),
                    torch.zeros(num_seqs + 1, dtype=torch.int32, device="cuda"),
                    torch.zeros(num_seqs + 1, dtype=torch.int32, device="cuda"), 128**-0.5, 0)
    return buffers, (num_rows, num_seqs, max_keys, key_capacity, num_pages)


def _fill(buffers: Batch, scenario, gen) -> Batch:
    """Writes a scenario into the buffers in place (padding included); returns the Batch view for the checks."""
    q_lens, k_lens, slots = scenario
    num_seqs = buffers.cu_seq_lens_q.numel() - 1
    pad = num_seqs - len(q_lens)
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()] + [sum(q_lens)] * pad
    cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()] + [sum(k_lens)] * pad
    buffers.cu_seq_lens_q.copy_(torch.tensor(cu_q, dtype=torch.int32))
    buffers.cu_seq_lens_k.copy_(torch.tensor(cu_k, dtype=torch.int32))
    buffers.key_slots.copy_(slots.to(torch.int32))
    query = torch.randn(buffers.query.shape, generator=gen).bfloat16()
    query[sum(q_lens) :] = float("nan")
    buffers.query.copy_(query)
    buffers.used_rows = sum(q_lens)
    return buffers


def test_cuda_graph_replay_follows_new_lengths_and_slots():
    """Captured once at fixed shapes; replays with new lengths, slots and queries in the same tensors give the new
    results (the lengths are read on the device at every replay, the split count is fixed by the shapes)."""
    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    buffers, sizes = _static_buffers(seed)
    _fill(buffers, _scenario(gen, *sizes), gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (extension load, allocator)
        ops.paged_attention(*buffers.args(), backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(*buffers.args(), backend="cuda")
    for replay in range(6):
        batch = _fill(buffers, _scenario(gen, *sizes), gen)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(out, _reference(batch), batch, f"replay {replay}, seed {seed}")


def test_torch_compile_fullgraph_no_recompile():
    """torch.compile traces the op (fake impl) in a full graph once; new lengths and slots reuse the code."""
    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    buffers, sizes = _static_buffers(seed)
    ops.paged_attention(*_fill(buffers, _scenario(gen, *sizes), gen).args(), backend="cuda")  # loads the extension

    def step(query, key_cache, value_cache, key_slots, cu_q, cu_k):
        return ops.paged_attention(query, key_cache, value_cache, key_slots, cu_q, cu_k, 128**-0.5, backend="cuda") * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for call in range(4):
            batch = _fill(buffers, _scenario(gen, *sizes), gen)
            out = compiled(*batch.args()[:6]) / 2
            _assert_matches(out, _reference(batch), batch, f"call {call}, seed {seed}")


def test_unsupported_inputs_raise_value_error():
    batch = _batch([2, 1], [5, 9], 32, 8, 128, torch.bfloat16, 0)
    q, kc, vc, slots, cu_q, cu_k, scale = batch.args()
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        attention.paged_attention_cuda(q.float(), kc.float(), vc.float(), slots, cu_q, cu_k, scale)
    with pytest.raises(ValueError, match="head sizes"):
        attention.paged_attention_cuda(q[..., :96], kc[..., :96], vc[..., :96], slots, cu_q, cu_k, scale)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention.paged_attention_cuda(q[:, :30], kc, vc, slots, cu_q, cu_k, scale)
    with pytest.raises(ValueError, match="one device"):
        attention.paged_attention_cuda(q, kc, vc, slots.cpu(), cu_q, cu_k, scale)
    with pytest.raises(ValueError, match="int32"):
        attention.paged_attention_cuda(q, kc, vc, slots, cu_q.long(), cu_k, scale)
    with pytest.raises(ValueError, match="splits must be an int"):
        attention.paged_attention_cuda(q, kc, vc, slots, cu_q, cu_k, scale, splits=attention.MAX_SPLITS + 1)
    # the auto backend runs the reference for what the kernel does not take; backend="cuda" refuses
    assert attention.attention_backend(q.float(), kc.float(), vc.float()) == "torch"
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        ops.paged_attention(q.float(), kc.float(), vc.float(), slots, cu_q, cu_k, scale, backend="cuda")


# One direct call of the registered op with one argument made wrong, in a process of its own: a crash must not take
# the test session with it (a message streaming an integer once killed the process: see punica_ops.cpp).
_WRONG_ARGUMENT_CALL = r"""
import sys, torch
from punica_hf.ops import cuda
cuda.load_extension()
args = {"query": torch.zeros(3, 8, 128, dtype=torch.bfloat16, device="cuda"),
        "key_cache": torch.zeros(40, 2, 128, dtype=torch.bfloat16, device="cuda"),
        "value_cache": torch.zeros(40, 2, 128, dtype=torch.bfloat16, device="cuda"),
        "key_slots": torch.arange(10, dtype=torch.int32, device="cuda"),
        "cu_seq_lens_q": torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda"),
        "cu_seq_lens_k": torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")}
name, change = sys.argv[1], sys.argv[2]
args[name] = {"dtype": lambda t: t.float(),
              "length": lambda t: t[:-1], "device": lambda t: t.cpu(),
              "layout": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)}[change](args[name])
try:
    torch.ops.punica_hf.paged_attention(*args.values(), 0.1, 0)
    torch.cuda.synchronize()
    print("returned")
except Exception as error:
    print("raised", type(error).__name__, error)
"""


@pytest.mark.parametrize(
    "name, change, message",
    [("cu_seq_lens_k", "length", "cu_seq_lens_k"), ("cu_seq_lens_q", "dtype", "cu_seq_lens_q"),
     ("key_slots", "device", "key_slots"), ("key_slots", "dtype", "key_slots"),
     ("value_cache", "device", "value_cache"), ("key_cache", "layout", "key_cache"), ("query", "dtype", "dtype")],
)
def test_binding_raises_on_wrong_arguments(name, change, message):
    """The binding's own checks (the op called directly, past the Python ones): ValueError, no crash."""
    result = subprocess.run([sys.executable, "-c", _WRONG_ARGUMENT_CALL, name, change], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"the process died (status {result.returncode}): {result.stderr[-2000:]}"
    assert result.stdout.startswith("raised ValueError punica_hf::paged_attention"), result.stdout
    assert message in result.stdout, result.stdout
