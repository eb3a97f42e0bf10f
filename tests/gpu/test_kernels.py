"""The CUDA kernels against a float64 reference, on fresh random inputs, a poisoned output and a poisoned pool.

Every case draws new inputs (the seed is in the failure message). ``y`` starts random, not zero: rows without
an adapter (slot -1 or rank 0) must come back bit-identical, every other element must match ``y_in + B(Ax)``
computed in float64 by the PyTorch reference ops, and nothing may be NaN/inf. The factors sit in one pool in
random order with random gaps, everything else in the pool is NaN, and slots of rank 0 carry offsets into a NaN
block: a read outside an adapter's own factors shows up as NaN. Imports only ``punica_hf.ops``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import punica_hf.ops as ops
from punica_hf.ops import KernelConfig
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Relative error ||out - ref|| / ||ref - y_in||: output rounding of a y of the same size as the update, the
# tiled path's v rounded to the input dtype (as PEFT's B(A x) rounds it), fp32 accumulation.
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(params=["fused", "two_launch"])
def per_token_path(request) -> KernelConfig:
    """The kernel config of the per-token path under test: one launch of the cluster kernel (sm_90+, the default
    where the slices fit shared memory) or the shrink and expand kernels (``fused=False``). Calls on the tiled path
    ignore it."""
    return KernelConfig(fused=request.param == "fused")


def _slots(mapping: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if mapping == "distinct":  # every token its own adapter
        return torch.randperm(num_slots, generator=gen)[:num_tokens]
    if mapping == "one":  # one adapter for all tokens
        return torch.full((num_tokens,), int(torch.randint(num_slots, (1,), generator=gen)))
    if mapping == "random":  # tokens interleaved over adapters, with -1 rows, some slots empty
        return torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    if mapping == "none":
        return torch.full((num_tokens,), -1)
    if mapping == "mixed_step":  # an engine step: a quarter decode tokens (a few per adapter), then two prefill chunks
        decode = num_tokens // 4
        chunks = torch.tensor([num_tokens - decode - (num_tokens - decode) // 3, (num_tokens - decode) // 3])
        chunk_slots = torch.randint(0, num_slots, (2,), generator=gen)
        return torch.cat([torch.randint(-1, num_slots, (decode,), generator=gen),
                          torch.repeat_interleave(chunk_slots, chunks)])
    if mapping == "requests":  # prefill: contiguous requests of random lengths, one adapter (or none) each
        cuts = torch.sort(torch.randint(0, num_tokens + 1, (num_slots,), generator=gen)).values
        lengths = torch.diff(cuts, prepend=torch.tensor([0]), append=torch.tensor([num_tokens]))
        request_slots = torch.randint(-1, num_slots, (lengths.numel(),), generator=gen)
        return torch.repeat_interleave(request_slots, lengths)
    raise ValueError(mapping)


def _random_ranks(kind: str, num_slots: int, max_rank: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "full":
        return torch.full((num_slots,), max_rank)
    # mixed ranks in one batch; "mixed_rank0" also has slots unused in this layer
    ranks = torch.randint(0 if kind == "mixed_rank0" else 1, max_rank + 1, (num_slots,), generator=gen)
    if kind == "mixed_rank0":
        ranks[0] = 0
    return ranks


@dataclass
class Tables:
    """One layer's row of the adapter tables: [S] int64 offsets into the pool, [S] int32 ranks."""

    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor


def _pool(rank_sets: list[torch.Tensor], hidden_in: int, hidden_out: int | list[int], dtype, gen: torch.Generator):
    """Random factors for every (set, slot) of rank > 0, packed in random order with random gaps into one NaN pool.

    ``hidden_out``: one width for every set, or one per set (the projections of a group). A is scaled by
    hidden_in^-0.5 and Bt by rank^-0.5 so the update is about as large as y. Rank-0 slots point at a NaN block.
    Returns the pool (on the GPU) and one Tables per rank set.
    """
    device_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    widths = hidden_out if isinstance(hidden_out, list) else [hidden_out] * len(rank_sets)
    factors, owners = [], []  # owners[i] = (set, slot, "a" | "b")
    for set_index, ranks in enumerate(rank_sets):
        for slot, rank in enumerate(ranks.tolist()):
            if rank > 0:
                factors.append(torch.randn(rank, hidden_in, generator=device_gen, device="cuda") * hidden_in**-0.5)
                factors.append(torch.randn(rank, widths[set_index], generator=device_gen, device="cuda") * rank**-0.5)
                owners += [(set_index, slot, "a"), (set_index, slot, "b")]
    order = torch.randperm(len(factors), generator=gen).tolist()
    gaps = torch.randint(0, 3 * torch_ops.POOL_ALIGNMENT, (len(factors) + 1,), generator=gen).tolist()
    nan_block = torch.full((1, torch_ops.POOL_ALIGNMENT), float("nan"), device="cuda")
    pool, placed = torch_ops.pack_factors([factors[i].to(dtype) for i in order] + [nan_block.to(dtype)], gaps,
                                          fill=float("nan"))
    offsets = [{"a": [placed[-1]] * len(r), "b": [placed[-1]] * len(r)} for r in rank_sets]
    for position, i in enumerate(order):
        set_index, slot, which = owners[i]
        offsets[set_index][which][slot] = placed[position]
    tables = [
        Tables(torch.tensor(o["a"], device="cuda"), torch.tensor(o["b"], device="cuda"),
               ranks.to(torch.int32).cuda())
        for o, ranks in zip(offsets, rank_sets)
    ]
    return pool, tables


def _problem(num_tokens, hidden_in, hidden_out, max_rank, num_slots, mapping, ranks, dtype, seed, table_sets=1):
    gen = torch.Generator().manual_seed(seed)
    rank_sets = [_random_ranks(ranks, num_slots, max_rank, gen) for _ in range(table_sets)]
    pool, tables = _pool(rank_sets, hidden_in, hidden_out, dtype, gen)
    x = torch.randn(num_tokens, hidden_in, generator=gen).to(dtype).cuda()
    y = torch.randn(num_tokens, hidden_out, generator=gen).to(dtype).cuda()  # poison: every element starts random
    slots = _slots(mapping, num_tokens, num_slots, gen).to(torch.int32).cuda()
    return y, x, pool, tables, slots


def _reference(y, x, pool, tables: Tables, slots, max_rank):
    expected = y.double()
    segments = build_segments(slots, tables.ranks.shape[0])
    torch_ops.lora_add(expected, x.double(), pool.double(), tables.a_offsets, tables.b_offsets, tables.ranks,
                       segments, max_rank)
    return expected


def _run(y, x, pool, tables: Tables, slots, max_rank, kernels: KernelConfig = KernelConfig()):
    segments = build_segments(slots, tables.ranks.shape[0])
    backend = cuda_ops.CudaLoraBackend(kernels)
    backend.lora_add(y, x, pool, tables.a_offsets, tables.b_offsets, tables.ranks, segments, max_rank)


def _assert_matches(y_out, y_in, expected, slots, lora_ranks, dtype, context):
    assert torch.isfinite(y_out).all(), f"non-finite output ({context})"
    updated = (slots >= 0) & (lora_ranks[slots.clamp(min=0).long()] > 0)
    assert torch.equal(y_out[~updated], y_in[~updated]), f"rows without adapter changed ({context})"
    if updated.any():
        error = ((y_out.double() - expected).norm() / (expected - y_in.double()).norm()).item()
        assert error < TOLERANCE[dtype], f"relative error {error:.2e} ({context})"


CASES = [
    # tokens, hidden_in, hidden_out, max_rank, slots, mapping, ranks
    (1, 4096, 4096, 16, 4, "distinct", "full"),
    (2, 4096, 4096, 16, 1000, "random", "mixed"),  # more slots than tokens
    (5, 8, 16, 2, 2, "random", "full"),  # smallest hidden sizes
    (16, 4096, 14336, 16, 32, "distinct", "mixed"),
    (32, 4096, 14336, 16, 3, "random", "full"),  # fused, Bt from L2, chunks of tokens sharing an adapter
    (16, 4096, 4096, 64, 6, "random", "mixed"),  # rank 64, tokens sharing adapters
    (96, 4096, 4096, 64, 96, "distinct", "full"),  # two launches, each token's rank-64 rows over 8 warps
    (17, 1024, 2048, 8, 3, "one", "full"),  # full chunks and a one-token chunk
    (64, 1000, 1008, 64, 64, "distinct", "mixed"),  # non-power-of-2 hidden sizes
    (64, 4096, 4096, 16, 8, "random", "mixed_rank0"),
    (48, 14336, 4096, 16, 48, "random", "mixed_rank0"),  # a wide input: clusters of 16 (fused path, 16-bit)
    (20, 12296, 1000, 12, 5, "one", "full"),  # clusters of 16 with short last K and column slices
    (64, 2048, 2048, 64, 4, "one", "full"),
    (100, 5120, 13824, 13, 7, "random", "mixed"),  # odd ranks
    (250, 1024, 2056, 32, 5, "requests", "mixed_rank0"),  # long segments, chunk ends not at segment ends
    (33, 32768, 4096, 8, 5, "random", "mixed"),
    (40, 4096, 32768, 32, 5, "random", "mixed"),
    (256, 4096, 4096, 128, 256, "distinct", "mixed"),
    (257, 4096, 4096, 16, 16, "requests", "mixed"),  # first size on the tiled path
    (300, 4096, 4096, 160, 8, "random", "mixed"),  # rank above the tiled path's limit: per-token, 3 Bt tiles
    (500, 4096, 4096, 16, 4, "none", "full"),
    (600, 2048, 2048, 1, 600, "distinct", "full"),  # tiled, single-token runs (64 passes a tile), rank 1
    (1024, 1000, 4104, 64, 12, "requests", "mixed_rank0"),
    (1500, 4096, 2048, 24, 3, "one", "full"),
    (4096, 4096, 4096, 16, 16, "requests", "full"),
    (8192, 4096, 1024, 128, 40, "random", "mixed"),  # tiles straddling many runs, largest tiled rank
    # full ranks in the next two: with few tokens, a low random rank shrinks the update below bf16's rounding
    (3, 512, 256, 320, 4, "random", "full"),  # per-token expand over several Bt tiles
    (512, 40, 64, 16, 3, "random", "full"),  # tiled, H_in below one K step
    # tiled: several K steps per split, a last split ending mid-step, a partial last tile, runs straddling tiles,
    # rank-0 slots, and a last output tile of 8 columns
    (2100, 4104, 1032, 32, 24, "random", "mixed_rank0"),
    # tiled calls whose short runs (decode tokens) go to the per-token kernels, long ones (prefill chunks) tiled
    (900, 4096, 14336, 16, 64, "mixed_step", "full"),
    (700, 4096, 4096, 64, 128, "mixed_step", "mixed_rank0"),
    (300, 1000, 1008, 16, 40, "mixed_step", "mixed"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_lora_add_matches_float64_reference(case, dtype, per_token_path):
    seed = secrets.randbits(31)
    max_rank = case[3]
    y, x, pool, (tables,), slots = _problem(*case, dtype, seed)
    y_in = y.clone()
    expected = _reference(y, x, pool, tables, slots, max_rank)
    _run(y, x, pool, tables, slots, max_rank, per_token_path)
    _assert_matches(y, y_in, expected, slots, tables.ranks, dtype, f"seed {seed}")


@pytest.mark.parametrize("num_tokens", [64, 1024], ids=["per_token", "tiled"])
def test_programmatic_launch_changes_nothing(num_tokens):
    """The expand started early (programmatic dependent launch) gives the same bits as a plain launch."""
    y, x, pool, (tables,), slots = _problem(num_tokens, 4096, 4096, 32, 8, "random", "mixed_rank0", torch.bfloat16,
                                            secrets.randbits(31))
    outputs = []
    for programmatic_launch in (True, False):
        out = y.clone()
        _run(out, x, pool, tables, slots, 32, KernelConfig(programmatic_launch=programmatic_launch))
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])


def test_unwritten_workspace_is_ignored():
    """Two-launch per-token path: the expand must read only the partials the shrink wrote (rows of each chunk,
    r < rank).

    The workspace is likely to reuse a freed all-NaN block of its size (the caching allocator hands back a freed
    block of the same size), so reading an unwritten entry shows up as NaN rows or a large error.
    """
    seed = secrets.randbits(31)
    num_tokens, hidden_in, max_rank = 64, 2048, 32
    y, x, pool, (tables,), slots = _problem(num_tokens, hidden_in, 1024, max_rank, 8, "random", "mixed",
                                            torch.bfloat16, seed)
    y_in = y.clone()
    expected = _reference(y, x, pool, tables, slots, max_rank)
    slices = hidden_in // 256  # per-token workspace: [K slices of 256 elements, T, max_rank] floats
    poison = torch.full((slices * num_tokens * max_rank,), float("nan"), device="cuda")
    del poison
    _run(y, x, pool, tables, slots, max_rank, KernelConfig(fused=False))
    _assert_matches(y, y_in, expected, slots, tables.ranks, torch.bfloat16, f"seed {seed}")


@pytest.mark.parametrize("num_tokens", [32, 1024], ids=["per_token", "tiled"])
def test_unchecked_entry_gives_the_same_bits(num_tokens, per_token_path):
    """``lora_add_unchecked`` (the hooks' entry) runs the same kernels as the checked ``lora_add``."""
    y, x, pool, (tables,), slots = _problem(num_tokens, 4096, 1024, 16, 8, "random", "mixed_rank0", torch.bfloat16,
                                            secrets.randbits(31))
    segments = build_segments(slots, tables.ranks.shape[0])
    backend = cuda_ops.CudaLoraBackend(per_token_path)
    args = (x, pool, tables.a_offsets, tables.b_offsets, tables.ranks, segments, 16)
    checked, unchecked = y.clone(), y.clone()
    backend.lora_add(checked, *args)
    backend.lora_add_unchecked(unchecked, *args)
    assert not torch.equal(checked, y), "the call must change y"
    assert torch.equal(checked, unchecked)


def test_shared_memory_limit_follows_growing_max_rank():
    """The per-token expand needs more than 48 KB of shared memory above max_rank 64; the launcher raises the
    kernel's limit once per size increase (not per launch): a larger max_rank after a smaller one, then the
    smaller one again, all compute the right thing."""
    for max_rank in (100, 1024, 100):
        seed = secrets.randbits(31)
        y, x, pool, (tables,), slots = _problem(3, 512, 256, max_rank, 2, "one", "full", torch.float32, seed)
        y_in = y.clone()
        expected = _reference(y, x, pool, tables, slots, max_rank)
        _run(y, x, pool, tables, slots, max_rank)
        _assert_matches(y, y_in, expected, slots, tables.ranks, torch.float32, f"max_rank {max_rank}, seed {seed}")


@pytest.mark.parametrize("num_tokens", [64, 4096], ids=["per_token", "tiled"])
def test_repeated_calls_are_deterministic(num_tokens, per_token_path):
    """Same inputs twice give the same bits: no race between blocks (no atomics are used)."""
    y, x, pool, (tables,), slots = _problem(num_tokens, 4096, 4096, 16, 16, "random", "full", torch.bfloat16,
                                            secrets.randbits(31))
    outputs = []
    for _ in range(2):
        out = y.clone()
        _run(out, x, pool, tables, slots, 16, per_token_path)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90")
@pytest.mark.parametrize("written_last", ["x", "y", "ranks"])
@pytest.mark.parametrize("hidden_in", [4096, 14336], ids=["cluster8", "cluster16"])
def test_dependent_launch_reads_what_the_kernel_before_wrote(hidden_in, written_last):
    """In a CUDA graph (back-to-back launches), x, y or a rank table written by the kernel just before the fused
    call must be what the call reads, at every replay (with PDL allowed: the fused kernel must not be placed early
    without waiting, as a dependent launch would be)."""
    backend = cuda_ops.CudaLoraBackend(KernelConfig(programmatic_launch=True, fused=True))
    seed = secrets.randbits(31)
    num_slots, max_rank = 64, 16
    y, x, pool, (tables,), slots = _problem(32, hidden_in, 4096, max_rank, num_slots, "distinct", "mixed_rank0",
                                            torch.bfloat16, seed)
    segments = build_segments(slots, num_slots)
    sources = {"x": x.clone(), "y": y.clone(), "ranks": tables.ranks.clone()}
    buffers = {name: torch.zeros_like(tensor) for name, tensor in sources.items()}
    order = [name for name in sources if name != written_last] + [written_last]

    def step():
        for name in order:  # kernels (not copies), so the LoRA launch directly follows one
            torch.mul(sources[name], 1, out=buffers[name])
        backend.lora_add(buffers["y"], buffers["x"], pool, tables.a_offsets, tables.b_offsets, buffers["ranks"],
                         segments, max_rank)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(seed)
    for replay in range(8):
        sources["x"].copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        sources["y"].copy_(torch.randn(y.shape, generator=gen).to(y.dtype))
        # each slot's factors hold its rank's rows: any lower rank reads a part of them
        lower = (tables.ranks.cpu() * torch.rand(num_slots, generator=gen)).round().to(torch.int32)
        sources["ranks"].copy_(lower)
        graph.replay()
        torch.cuda.synchronize()
        live = dataclasses.replace(tables, ranks=sources["ranks"])
        expected = _reference(sources["y"], sources["x"], pool, live, slots, max_rank)
        _assert_matches(buffers["y"], sources["y"], expected, slots, sources["ranks"], torch.bfloat16,
                        f"replay {replay}, seed {seed}")


@pytest.mark.parametrize("num_tokens", [64, 512], ids=["per_token", "tiled"])
def test_cuda_graph_replay_follows_new_slots_offsets_and_ranks(num_tokens, per_token_path):
    """A captured call reads the slots, offsets and ranks in place: new values in the same tensors are followed."""
    backend = ops.backend_for("cuda", "cuda", per_token_path)
    seed = secrets.randbits(31)
    max_rank, num_slots = 32, 8
    y, x, pool, table_sets, slots = _problem(num_tokens, 2048, 4096, max_rank, num_slots, "random", "mixed_rank0",
                                             torch.bfloat16, seed, table_sets=2)
    live = Tables(table_sets[0].a_offsets.clone(), table_sets[0].b_offsets.clone(), table_sets[0].ranks.clone())
    y_start = y.clone()
    slot_buffer = slots.clone()

    def step():
        segments = ops.build_segments(slot_buffer, num_slots)
        backend.lora_add(y, x, pool, live.a_offsets, live.b_offsets, live.ranks, segments, max_rank)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, sort workspace)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(seed)
    for replay, mapping in enumerate(("random", "one", "requests", "none", "distinct")):
        source = table_sets[replay % 2]
        live.a_offsets.copy_(source.a_offsets)
        live.b_offsets.copy_(source.b_offsets)
        live.ranks.copy_(source.ranks)
        slot_buffer.copy_(_slots(mapping, num_tokens, num_slots, gen).repeat(num_tokens)[:num_tokens].to(torch.int32))
        y.copy_(y_start)
        graph.replay()
        torch.cuda.synchronize()
        expected = _reference(y_start, x, pool, source, slot_buffer, max_rank)
        _assert_matches(y, y_start, expected, slot_buffer, source.ranks, torch.bfloat16,
                        f"{mapping}, tables {replay % 2}, seed {seed}")


@pytest.mark.parametrize("num_tokens", [64, 512], ids=["per_token", "tiled"])
def test_torch_compile_fullgraph_no_recompile(num_tokens):
    """torch.compile traces the op (fake impl) once; new slots and new table values reuse the compiled code."""
    backend = ops.backend_for("cuda", "cuda")
    seed = secrets.randbits(31)
    max_rank, num_slots = 16, 8
    y, x, pool, table_sets, slots = _problem(num_tokens, 2048, 1024, max_rank, num_slots, "random", "mixed",
                                             torch.bfloat16, seed, table_sets=2)

    def step(y, x, tables, segments):
        backend.lora_add(y, x, pool, tables.a_offsets, tables.b_offsets, tables.ranks, segments, max_rank)
        return y

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(seed)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for call, mapping in enumerate(("random", "one", "requests", "distinct")):
            tables = table_sets[call % 2]
            new_slots = _slots(mapping, num_tokens, num_slots, gen).repeat(num_tokens)[:num_tokens]
            new_slots = new_slots.to(torch.int32).cuda()
            segments = ops.build_segments(new_slots, num_slots)
            out = compiled(y.clone(), x, tables, segments)
            expected = _reference(y, x, pool, tables, new_slots, max_rank)
            _assert_matches(out, y, expected, new_slots, tables.ranks, torch.bfloat16,
                            f"{mapping}, tables {call % 2}, seed {seed}")


# max_rank 64, ranks 1-64: each chunk's blocks take the group of its own rank (1, 2 or 4 slices or column chunks) and
# of its output's width: the first output has 3 column chunks at 16 bits (a rank-8 chunk takes 2 there), the second
# one, the third one narrower than a chunk
PER_RANK_GROUPS_CASE = (96, 1000, [768, 200, 8], 64, 12, "random", "mixed")
GROUP_CASES = [
    # tokens, hidden_in, widths, max_rank, slots, mapping, ranks
    (32, 4096, [4096, 1024, 1024], 16, 32, "distinct", "mixed_rank0"),  # Llama-3-8B q/k/v at decode
    (1, 4096, [14336, 14336], 16, 4, "distinct", "full"),  # gate/up
    (24, 14336, [4096, 1024], 16, 6, "random", "mixed_rank0"),  # a wide input: clusters of 16, written outputs
    (17, 1024, [2048, 8, 512], 8, 3, "one", "full"),  # an output narrower than one column chunk
    (64, 2048, [1024, 2048], 64, 8, "random", "mixed"),
    (100, 5120, [5120, 1024, 1024], 13, 7, "requests", "mixed_rank0"),
    (300, 512, [256, 264, 256, 128], 160, 8, "random", "mixed"),  # 4 outputs, 3 Bt tiles, above 256 tokens
    PER_RANK_GROUPS_CASE,
    (5, 8, [16, 8], 2, 2, "random", "full"),
]


def _group_problem(num_tokens, hidden_in, widths, max_rank, num_slots, mapping, ranks, dtype, seed):
    """x, the pool, [G, S] tables (one row per output) and slots for one grouped call."""
    gen = torch.Generator().manual_seed(seed)
    rank_sets = [_random_ranks(ranks, num_slots, max_rank, gen) for _ in widths]
    pool, tables = _pool(rank_sets, hidden_in, widths, dtype, gen)
    x = torch.randn(num_tokens, hidden_in, generator=gen).to(dtype).cuda()
    slots = _slots(mapping, num_tokens, num_slots, gen).to(torch.int32).cuda()
    stacked = Tables(*(torch.stack([getattr(t, field.name) for t in tables]) for field in dataclasses.fields(Tables)))
    return x, pool, tables, stacked, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: "-".join(map(str, c)).replace(", ", "_"))
def test_lora_delta_matches_float64_reference(case, dtype, per_token_path):
    """Each output's columns hold its own projection's update, zeros where a token has none; the memory the output
    is made in was all NaN just before (the caching allocator hands the freed block back)."""
    seed = secrets.randbits(31)
    widths, max_rank = case[2], case[3]
    x, pool, tables, stacked, slots = _group_problem(*case, dtype, seed)
    segments = build_segments(slots, stacked.ranks.shape[1])
    poison = torch.full((x.shape[0], sum(widths)), float("nan"), dtype=dtype, device="cuda")
    del poison
    backend = cuda_ops.CudaLoraBackend(per_token_path)
    delta = backend.lora_delta(x, pool, stacked.a_offsets, stacked.b_offsets, stacked.ranks, segments, max_rank,
                               widths)
    assert delta.shape == (x.shape[0], sum(widths)) and delta.dtype == dtype
    first = 0
    for g, width in enumerate(widths):
        zeros = torch.zeros(x.shape[0], width, dtype=dtype, device="cuda")
        expected = _reference(zeros, x, pool, tables[g], slots, max_rank)
        _assert_matches(delta[:, first : first + width], zeros, expected, slots, tables[g].ranks, dtype,
                        f"output {g}, seed {seed}")
        first += width


@pytest.mark.parametrize("case", GROUP_CASES[:5] + [PER_RANK_GROUPS_CASE],
                         ids=lambda c: "-".join(map(str, c)).replace(", ", "_"))
def test_grouped_call_gives_the_bits_of_separate_calls(case, per_token_path):
    """Per-token path: output g of one grouped call is bit for bit ``lora_add`` into zeros with table row g. The
    expand's blocks choose their column chunks by their output's width, not the widest output's: with max_rank 64,
    a rank-32 chunk of 2-4 tokens split its rows over warps differently in the two calls (PER_RANK_GROUPS_CASE)."""
    x, pool, tables, stacked, slots = _group_problem(*case, torch.bfloat16, secrets.randbits(31))
    widths, max_rank = case[2], case[3]
    segments = build_segments(slots, stacked.ranks.shape[1])
    backend = cuda_ops.CudaLoraBackend(per_token_path)
    delta = backend.lora_delta_unchecked(x, pool, stacked.a_offsets, stacked.b_offsets, stacked.ranks, segments,
                                         max_rank, widths)
    separate = []
    for g, width in enumerate(widths):
        y = torch.zeros(x.shape[0], width, dtype=torch.bfloat16, device="cuda")
        backend.lora_add(y, x, pool, tables[g].a_offsets, tables[g].b_offsets, tables[g].ranks, segments, max_rank)
        separate.append(y)
    assert torch.equal(delta, torch.cat(separate, dim=1))


def test_lora_delta_in_a_cuda_graph_and_compiled_follows_new_tables(per_token_path):
    """Captured once and compiled once: new slots and new table values in the same tensors are followed."""
    backend = ops.backend_for("cuda", "cuda", per_token_path)
    seed = secrets.randbits(31)
    widths, max_rank, num_slots, num_tokens = [2048, 512, 512], 16, 8, 48
    x, pool, tables, stacked, slots = _group_problem(num_tokens, 1024, widths, max_rank, num_slots, "random",
                                                     "mixed_rank0", torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed)
    other_ranks = torch.stack([_random_ranks("mixed_rank0", num_slots, max_rank, gen) for _ in widths]).cuda()
    live_ranks = stacked.ranks.clone()
    slot_buffer = slots.clone()

    def step():
        segments = ops.build_segments(slot_buffer, num_slots)
        return backend.lora_delta(x, pool, stacked.a_offsets, stacked.b_offsets, live_ranks, segments, max_rank,
                                  widths)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, sort workspace)
        step()
        compiled()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for replay, mapping in enumerate(("random", "one", "distinct", "none")):
            ranks = other_ranks.to(torch.int32) if replay % 2 else stacked.ranks
            # a lower rank reads a prefix of the same factors: still a valid adapter of that rank
            live_ranks.copy_(torch.minimum(ranks, stacked.ranks))
            slot_buffer.copy_(_slots(mapping, num_tokens, num_slots, gen).repeat(num_tokens)[:num_tokens].to(torch.int32))
            graph.replay()
            results = {"graph": captured, "compiled": compiled()}
            torch.cuda.synchronize()
            first = 0
            for g, width in enumerate(widths):
                zeros = torch.zeros(num_tokens, width, dtype=torch.bfloat16, device="cuda")
                row = Tables(stacked.a_offsets[g], stacked.b_offsets[g], live_ranks[g].clone())
                expected = _reference(zeros, x, pool, row, slot_buffer, max_rank)
                for name, delta in results.items():
                    _assert_matches(delta[:, first : first + width], zeros, expected, slot_buffer, row.ranks,
                                    torch.bfloat16, f"{name}, {mapping}, output {g}, seed {seed}")
                first += width


def _kernel_names(call) -> set[str]:
    """Names of the CUDA kernels ``call()`` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    return {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def _kernel_grids(call, tmp_path) -> dict[str, list[int]]:
    """The grid of each CUDA kernel ``call()`` launches, by name (the profiler's trace records it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    profile.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"]: e["args"]["grid"] for e in events if e.get("cat") == "kernel"}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90")
@pytest.mark.parametrize(
    "setting, num_tokens, hidden_in, hidden_out, max_rank, kernel",
    [("1", 32, 4096, 14336, 16, "fused 8 false"), ("1", 64, 4096, 14336, 16, "fused 8 false"),
     ("1", 32, 4096, 4096, 16, "fused 8 true"), ("1", 32, 14336, 4096, 16, "fused 16 true"),
     ("0", 32, 4096, 14336, 16, "two"), ("1", 32, 4096, 14336, 128, "two"), ("1", 65, 4096, 14336, 16, "two")],
    ids=["gate", "64_tokens", "q", "down", "switched_off", "rank128_too_large", "65_tokens"],
)
def test_decode_call_takes_the_fused_path_where_it_fits(setting, num_tokens, hidden_in, hidden_out, max_rank,
                                                        kernel):
    """Llama-3-8B projections at decode run one cluster kernel at rank 16 up to 64 tokens (their slices fit shared
    memory): clusters of 16 for the down projection (its A and x slices would take 72 KB per block in clusters of
    8), of 8 for q and gate, Bt staged in shared memory except for gate's wide output (read from L2: five blocks
    per multiprocessor rather than two); the shrink and expand kernels at rank 128, above 64 tokens or with
    ``KernelConfig(fused=False)``; each computes the right thing."""
    kernels = KernelConfig(fused=setting == "1")
    seed = secrets.randbits(31)
    y, x, pool, (tables,), slots = _problem(num_tokens, hidden_in, hidden_out, max_rank, 128, "distinct", "full",
                                            torch.bfloat16, seed)
    y_in = y.clone()
    expected = _reference(y, x, pool, tables, slots, max_rank)
    names = " ".join(_kernel_names(lambda: _run(y, x, pool, tables, slots, max_rank, kernels)))
    fused = kernel != "two"
    assert ("fused_chunk_kernel" in names) == fused, names
    assert ("shrink_chunk_kernel" in names) == (not fused), names
    if fused:
        _, cluster, staged = kernel.split()
        assert re.search(rf"fused_chunk_kernel<[^>]*, {cluster}, {staged}>", names), names
    _assert_matches(y, y_in, expected, slots, tables.ranks, torch.bfloat16, f"seed {seed}")


@pytest.mark.parametrize("setting", ["list", "grid", "all_tiled"])
def test_a_mixed_step_call_splits_its_positions_between_the_paths(setting, tmp_path):
    """Above 256 tokens, the slots with more than ``SHORT_RUN_TOKENS`` tokens (prefill chunks) run on the tiled
    kernels and the others (decode tokens) on the per-token ones, which walk the list of their chunks
    (``short_run_chunks``) or launch a block per position of the call; ``KernelConfig(short_runs=False)`` runs every
    position tiled. Each computes the right thing."""
    kernels = KernelConfig(short_runs=setting != "all_tiled", short_run_chunks=setting == "list", fused=False)
    seed = secrets.randbits(31)
    y, x, pool, (tables,), slots = _problem(900, 4096, 14336, 16, 64, "mixed_step", "full", torch.bfloat16, seed)
    y_in = y.clone()
    expected = _reference(y, x, pool, tables, slots, 16)
    grids = _kernel_grids(lambda: _run(y, x, pool, tables, slots, 16, kernels), tmp_path)
    names = " ".join(grids)
    assert "shrink_tiled_kernel" in names and "expand_tiled_kernel" in names, names
    assert ("shrink_chunk_kernel" in names) == (setting != "all_tiled"), names
    # The short half's grids: a block per position of the call, or fewer blocks that walk the chunk list.
    per_token_x = {grid[0] for name, grid in grids.items() if "_chunk_kernel" in name}
    if setting == "list":
        assert per_token_x and max(per_token_x) < 900, grids
    elif setting == "grid":
        assert per_token_x == {900}, grids
    _assert_matches(y, y_in, expected, slots, tables.ranks, torch.bfloat16, f"seed {seed}")


def _many_chunks_slots(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """A third of the tokens a few per slot (about 2.7) or base tokens, the rest in four prefill runs, shuffled."""
    short = num_tokens // 3
    rest = num_tokens - short
    runs = [rest * 4 // 10, rest * 3 // 10, rest * 2 // 10]
    runs = torch.tensor(runs + [rest - sum(runs)])
    prefill = torch.repeat_interleave(torch.randint(0, num_slots, (4,), generator=gen), runs)
    slots = torch.cat([torch.randint(-1, num_slots, (short,), generator=gen), prefill])
    return slots[torch.randperm(num_tokens, generator=gen)].to(torch.int32).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens, max_rank, hidden_in, hidden_out", [
    (2400, 16, 4096, 14336), (2400, 64, 14336, 4096), (900, 8, 1000, 1008),
    (2400, 128, 4096, 4096),  # the largest tiled rank: the expand's two Bt buffers and the shrink's second pass
])
def test_walking_the_short_run_chunks_changes_nothing(num_tokens, max_rank, hidden_in, hidden_out, dtype):
    """The per-token kernels of a split call give the same bits whether two waves of blocks walk the list of the
    short runs' chunks or a block serves each position of the call, and both match the reference. A third of the
    tokens are a few per slot over 300 slots (about 300 chunks); on a 132-multiprocessor GPU the grids hold from 19
    blocks along the list (each walks many entries, past prefill runs and base tokens) to 900 (blocks past the
    list's end)."""
    seed = secrets.randbits(31)
    gen = torch.Generator().manual_seed(seed)
    y, x, pool, (tables,), _ = _problem(num_tokens, hidden_in, hidden_out, max_rank, 300, "none", "mixed_rank0", dtype,
                                        seed)
    slots = _many_chunks_slots(num_tokens, 300, gen)
    outputs = []
    for short_run_chunks in (True, False):
        out = y.clone()
        _run(out, x, pool, tables, slots, max_rank, KernelConfig(short_run_chunks=short_run_chunks))
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1]), f"seed {seed}"
    expected = _reference(y, x, pool, tables, slots, max_rank)
    _assert_matches(outputs[0], y, expected, slots, tables.ranks, dtype, f"seed {seed}")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90")
def test_a_compiled_step_follows_the_kernel_config_it_is_called_with():
    """The config's choices are arguments of the op, so constants of a compiled graph: a step compiled with the
    fused kernel and then called with ``fused=False`` launches the shrink and expand kernels (it does not keep the
    first config), and both compute the right thing."""
    seed = secrets.randbits(31)
    y, x, pool, (tables,), slots = _problem(32, 4096, 4096, 16, 64, "distinct", "full", torch.bfloat16, seed)
    segments = build_segments(slots, 64)
    expected = _reference(y, x, pool, tables, slots, 16)

    def step(backend, out):
        backend.lora_add(out, x, pool, tables.a_offsets, tables.b_offsets, tables.ranks, segments, 16)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for fused in (True, False):
        backend = cuda_ops.CudaLoraBackend(KernelConfig(fused=fused))
        compiled(backend, y.clone())  # compiles outside the profiled call
        out = y.clone()
        names = " ".join(_kernel_names(lambda: compiled(backend, out)))
        assert ("fused_chunk_kernel" in names) == fused and ("shrink_chunk_kernel" in names) != fused, names
        _assert_matches(out, y, expected, slots, tables.ranks, torch.bfloat16, f"fused={fused}, seed {seed}")


@pytest.mark.parametrize("num_tokens", [24, 600], ids=["per_token", "tiled"])
def test_tokens_in_leading_dimensions_are_flattened(num_tokens):
    """The eager hooks pass the module's own ``[B, T, H]`` input and output: the binding takes the tokens from the
    leading dimensions, bit for bit as the same call on ``[B * T, H]`` views, and refuses mismatched counts."""
    seed = secrets.randbits(31)
    y, x, pool, (tables,), slots = _problem(num_tokens, 256, 512, 16, 8, "random", "random", torch.bfloat16, seed)
    segments = build_segments(slots, 8)
    backend = cuda_ops.CudaLoraBackend()
    args = (pool, tables.a_offsets, tables.b_offsets, tables.ranks, segments, 16)
    flat = y.clone()
    backend.lora_add_unchecked(flat, x, *args)
    batched = y.clone().view(4, num_tokens // 4, 512)
    backend.lora_add_unchecked(batched, x.view(4, num_tokens // 4, 256), *args)
    assert torch.equal(batched.view(num_tokens, 512), flat), f"seed {seed}"
    _assert_matches(flat, y, _reference(y, x, pool, tables, slots, 16), slots, tables.ranks, torch.bfloat16,
                    f"seed {seed}")
    with pytest.raises(ValueError, match="different token counts"):
        backend.lora_add_unchecked(y.view(2, num_tokens // 2, 512)[:1], x.view(2, num_tokens // 2, 256), *args)


def test_unsupported_inputs_raise_value_error():
    y, x, pool, (tables,), slots = _problem(4, 64, 64, 8, 2, "random", "full", torch.bfloat16, 0)
    segments = build_segments(slots, 2)
    backend = cuda_ops.CudaLoraBackend()
    args = (tables.a_offsets, tables.b_offsets, tables.ranks, segments)
    with pytest.raises(ValueError, match="multiples of 8"):
        backend.lora_add(y[:, :60].contiguous(), x, pool, *args, 8)
    with pytest.raises(ValueError, match="one dtype"):
        backend.lora_add(y, x, pool.half(), *args, 8)
    with pytest.raises(ValueError, match="not supported"):
        backend.lora_add(y.double(), x.double(), pool.double(), *args, 8)
    with pytest.raises(ValueError, match="int32"):
        backend.lora_add(y, x, pool, tables.a_offsets, tables.b_offsets, tables.ranks.long(), segments, 8)
    with pytest.raises(ValueError, match="int64"):
        backend.lora_add(y, x, pool, tables.a_offsets.int(), tables.b_offsets, tables.ranks, segments, 8)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        backend.lora_add(y, x, pool, tables.a_offsets[:1], tables.b_offsets, tables.ranks, segments, 8)
    with pytest.raises(ValueError, match="max_rank"):
        backend.lora_add(y, x, pool, *args, cuda_ops.MAX_RANK + 1)
    with pytest.raises(ValueError, match="aligned"):  # checked in C++: a view starting mid-vector
        backend.lora_add(y, x, pool[1:], *args, 8)
    # The unchecked entry keeps the binding's memory-safety checks.
    stray = dataclasses.replace(segments, sorted_slots=segments.sorted_slots.cpu())
    with pytest.raises(ValueError, match="sorted_slots"):
        backend.lora_add_unchecked(y, x, pool, tables.a_offsets, tables.b_offsets, tables.ranks, stray, 8)


# One call of the unchecked entry with one table made wrong, in a process of its own: a crash must not take the
# test session with it. Prints "raised <type>" or "returned".
_WRONG_TABLE_CALL = r"""
import sys, torch
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops.segments import build_segments

y = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
x = torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")
pool = torch.zeros(8192, dtype=torch.bfloat16, device="cuda")
tables = {"a_offsets": torch.zeros(2, dtype=torch.int64, device="cuda"),
          "b_offsets": torch.full((2,), 4096, dtype=torch.int64, device="cuda"),
          "lora_ranks": torch.full((2,), 8, dtype=torch.int32, device="cuda")}
segments = build_segments(torch.tensor([0, 1, 0, -1], dtype=torch.int32, device="cuda"), 2)
backend = cuda_ops.CudaLoraBackend()
name, change, entry = sys.argv[1], sys.argv[2], sys.argv[3]
if entry == "delta":  # two outputs of 32 columns: [2, S] tables
    tables = {key: torch.stack([table, table]) for key, table in tables.items()}
tables[name] = {"dtype": lambda t: t.to(torch.int32 if t.dtype == torch.int64 else torch.int64),
                "length": lambda t: t[:1], "device": lambda t: t.cpu()}[change](tables[name])
try:
    if entry == "delta":
        backend.lora_delta_unchecked(x, pool, tables["a_offsets"], tables["b_offsets"], tables["lora_ranks"],
                                     segments, 8, [32, 32])
    else:
        backend.lora_add_unchecked(y, x, pool, tables["a_offsets"], tables["b_offsets"], tables["lora_ranks"],
                                   segments, 8)
    torch.cuda.synchronize()
    print("returned")
except Exception as error:
    print("raised", type(error).__name__, error)
"""


def _call_with_wrong_table(name: str, change: str, entry: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRONG_TABLE_CALL, name, change, entry], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("entry", ["add", "delta"])
@pytest.mark.parametrize(
    "name, change",
    [("a_offsets", "device"), ("a_offsets", "dtype"), ("a_offsets", "length"), ("lora_ranks", "dtype"),
     ("b_offsets", "length")],
)
def test_unchecked_entry_raises_on_a_wrong_table(name, change, entry):
    """The binding's own checks keep the unchecked entries memory-safe: ValueError naming the table, no crash.

    (A dtype or length error once killed the process: its message streamed an integer; see punica_ops.cpp.)
    """
    result = _call_with_wrong_table(name, change, entry)
    assert result.returncode == 0, f"the process died (status {result.returncode}): {result.stderr[-2000:]}"
    assert result.stdout.startswith(f"raised ValueError punica_hf::lora_{entry}: {name}"), result.stdout
