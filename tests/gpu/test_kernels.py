"""The CUDA kernels against a float64 reference, on fresh random inputs with a poisoned output.

Every case draws new inputs (the seed is in the failure message). ``y`` starts random, not zero: rows without
an adapter (slot -1 or rank 0) must come back bit-identical, every other element must match
``y_in + B(Ax)`` computed in float64 by the PyTorch reference ops, and nothing may be NaN/inf. Weights past
each slot's rank hold random values: the kernels must ignore them, as the reference does.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import punica_hf.ops as ops
from punica_hf.ops import cuda as cuda_ops
from punica_hf.ops import torch_ops
from punica_hf.ops.segments import build_segments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Relative error ||out - ref|| / ||ref - y_in||: output rounding of a y of the same size as the update,
# plus fp32 (tf32 in the tiled expand) accumulation.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _slots(mapping: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if mapping == "distinct":  # every token its own adapter
        return torch.randperm(num_slots, generator=gen)[:num_tokens]
    if mapping == "one":  # one adapter for all tokens
        return torch.full((num_tokens,), int(torch.randint(num_slots, (1,), generator=gen)))
    if mapping == "random":  # tokens interleaved over adapters, with -1 rows, some slots empty
        return torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    if mapping == "none":
        return torch.full((num_tokens,), -1)
    if mapping == "requests":  # prefill: contiguous requests of random lengths, one adapter (or none) each
        cuts = torch.sort(torch.randint(0, num_tokens + 1, (num_slots,), generator=gen)).values
        lengths = torch.diff(cuts, prepend=torch.tensor([0]), append=torch.tensor([num_tokens]))
        request_slots = torch.randint(-1, num_slots, (lengths.numel(),), generator=gen)
        return torch.repeat_interleave(request_slots, lengths)
    raise ValueError(mapping)


def _problem(num_tokens, hidden_in, hidden_out, max_rank, num_slots, mapping, ranks, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()

    x = randn(num_tokens, hidden_in)
    lora_a = randn(num_slots, max_rank, hidden_in, scale=hidden_in**-0.5)
    lora_b = randn(num_slots, hidden_out, max_rank, scale=max_rank**-0.5)
    if ranks == "full":
        lora_ranks = torch.full((num_slots,), max_rank)
    else:  # mixed ranks in one batch; "mixed_rank0" also has slots unused in this layer
        low = 0 if ranks == "mixed_rank0" else 1
        lora_ranks = torch.randint(low, max_rank + 1, (num_slots,), generator=gen)
        if ranks == "mixed_rank0":
            lora_ranks[0] = 0
    slots = _slots(mapping, num_tokens, num_slots, gen).to(torch.int32).cuda()
    y = randn(num_tokens, hidden_out)  # poison: every element starts random
    return y, x, lora_a, lora_b, lora_ranks.to(torch.int32).cuda(), slots


def _reference(y, x, lora_a, lora_b, lora_ranks, slots):
    expected = y.double()
    segments = build_segments(slots, lora_a.shape[0], "torch")
    torch_ops.lora_add(expected, x.double(), lora_a.double(), lora_b.double(), lora_ranks, segments)
    return expected


def _assert_matches(y_out, y_in, expected, slots, lora_ranks, dtype, context):
    assert torch.isfinite(y_out).all(), f"non-finite output ({context})"
    safe_slots = slots.clamp(min=0).long()
    updated = (slots >= 0) & (lora_ranks[safe_slots] > 0)
    assert torch.equal(y_out[~updated], y_in[~updated]), f"rows without adapter changed ({context})"
    delta_norm = (expected - y_in.double()).norm()
    if updated.any():
        error = ((y_out.double() - expected).norm() / delta_norm).item()
        assert error < TOLERANCE[dtype], f"relative error {error:.2e} ({context})"


CASES = [
    # tokens, hidden_in, hidden_out, max_rank, slots, mapping, ranks
    (1, 4096, 4096, 16, 4, "distinct", "full"),
    (2, 4096, 4096, 16, 1000, "random", "mixed"),  # more slots than tokens
    (5, 8, 16, 2, 2, "random", "full"),  # smallest hidden sizes
    (16, 4096, 14336, 16, 32, "distinct", "mixed"),
    (64, 1000, 1008, 64, 64, "distinct", "mixed"),  # non-power-of-2 hidden sizes
    (64, 4096, 4096, 16, 8, "random", "mixed_rank0"),
    (64, 2048, 2048, 64, 4, "one", "full"),
    (100, 5120, 13824, 13, 7, "random", "mixed"),  # rank not a multiple of 8: unaligned B rows
    (33, 32768, 4096, 8, 5, "random", "mixed"),
    (40, 4096, 32768, 32, 5, "random", "mixed"),
    (256, 4096, 4096, 128, 256, "distinct", "mixed"),
    (257, 4096, 4096, 16, 16, "requests", "mixed"),  # first size on the tiled path
    (300, 4096, 4096, 160, 8, "random", "mixed"),  # rank above the tiled path's limit: per-token
    (500, 4096, 4096, 16, 4, "none", "full"),
    (600, 2048, 2048, 1, 600, "distinct", "full"),  # tiled, single-token segments, rank 1
    (1024, 1000, 4104, 64, 12, "requests", "mixed_rank0"),
    (1500, 4096, 2048, 24, 3, "one", "full"),
    (4096, 4096, 4096, 16, 16, "requests", "full"),
    (8192, 4096, 1024, 128, 40, "random", "mixed"),  # tiles straddling many segments
    # full ranks in the next two: with few tokens, a low random rank shrinks the update below bf16's rounding
    (3, 512, 256, 320, 4, "random", "full"),  # max_rank above the per-token expand's 256 threads
    (512, 40, 64, 16, 3, "random", "full"),  # tiled, H_in below one 64-wide K step: fewer steps than stages
    # tiled: 9 K steps per split (more than the pipeline's stages) and a 2-step last split ending mid-step,
    # a partial last tile, tiles straddling many segments, rank-0 slots, and a last output tile of 8 columns
    (2100, 4104, 1032, 32, 24, "random", "mixed_rank0"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_lora_add_matches_float64_reference(case, dtype):
    seed = secrets.randbits(31)
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(*case, dtype, seed)
    y_in = y.clone()
    expected = _reference(y, x, lora_a, lora_b, lora_ranks, slots)
    cuda_ops.lora_add(y, x, lora_a, lora_b, lora_ranks, build_segments(slots, lora_a.shape[0], "cuda"))
    _assert_matches(y, y_in, expected, slots, lora_ranks, dtype, f"seed {seed}")


def test_unwritten_workspace_is_ignored():
    """Per-token path: scratch the shrink leaves unwritten (past a slot's rank, tokens without adapter) must not leak.

    The per-token expand reads the partials of every column up to max_rank before it knows the token's rank
    and discards the extra ones; here the workspace is likely to reuse a freed block full of NaN (the caching
    allocator hands back a freed block of the same size), so a leak shows up as NaN rows or a large error.
    """
    seed = secrets.randbits(31)
    num_tokens, hidden_in, max_rank = 64, 2048, 32
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(num_tokens, hidden_in, 1024, max_rank, 8, "random", "mixed",
                                                       torch.bfloat16, seed)
    y_in = y.clone()
    expected = _reference(y, x, lora_a, lora_b, lora_ranks, slots)
    segments = build_segments(slots, lora_a.shape[0], "cuda")
    slices = hidden_in // 256  # per-token workspace: [K slices of 256 elements, T, max_rank] floats
    poison = torch.full((slices * num_tokens * max_rank,), float("nan"), device="cuda")
    del poison
    cuda_ops.lora_add(y, x, lora_a, lora_b, lora_ranks, segments)
    _assert_matches(y, y_in, expected, slots, lora_ranks, torch.bfloat16, f"seed {seed}")


def test_repeated_calls_are_deterministic():
    """Same inputs twice give the same bits: no race between blocks (no atomics are used)."""
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(4096, 4096, 4096, 16, 16, "random", "full", torch.bfloat16,
                                                       secrets.randbits(31))
    segments = build_segments(slots, lora_a.shape[0], "cuda")
    outputs = []
    for _ in range(2):
        out = y.clone()
        cuda_ops.lora_add(out, x, lora_a, lora_b, lora_ranks, segments)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("num_tokens", [64, 512], ids=["per_token", "tiled"])
def test_cuda_graph_replay_follows_new_slots(num_tokens, monkeypatch):
    monkeypatch.setenv("PUNICA_HF_BACKEND", "cuda")
    seed = secrets.randbits(31)
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(num_tokens, 2048, 4096, 32, 8, "random", "mixed",
                                                       torch.bfloat16, seed)
    num_slots = lora_a.shape[0]
    y_start = y.clone()
    slot_buffer = slots.clone()

    def step():
        ops.lora_add(y, x, lora_a, lora_b, lora_ranks, ops.build_segments(slot_buffer, num_slots))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, sort workspace)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(seed)
    for mapping in ("random", "one", "requests", "none"):
        slot_buffer.copy_(_slots(mapping, num_tokens, num_slots, gen).to(torch.int32))
        y.copy_(y_start)
        graph.replay()
        torch.cuda.synchronize()
        expected = _reference(y_start, x, lora_a, lora_b, lora_ranks, slot_buffer)
        _assert_matches(y, y_start, expected, slot_buffer, lora_ranks, torch.bfloat16, f"{mapping}, seed {seed}")


@pytest.mark.parametrize("num_tokens", [64, 512], ids=["per_token", "tiled"])
def test_torch_compile_fullgraph_no_recompile(num_tokens, monkeypatch):
    monkeypatch.setenv("PUNICA_HF_BACKEND", "cuda")
    seed = secrets.randbits(31)
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(num_tokens, 2048, 1024, 16, 8, "random", "mixed",
                                                       torch.bfloat16, seed)
    num_slots = lora_a.shape[0]

    def step(y, x, segments):
        ops.lora_add(y, x, lora_a, lora_b, lora_ranks, segments)
        return y

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(seed)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for mapping in ("random", "distinct_or_one", "requests"):
            new_slots = _slots("one" if mapping == "distinct_or_one" else mapping, num_tokens, num_slots, gen)
            new_slots = new_slots.to(torch.int32).cuda()
            segments = ops.build_segments(new_slots, num_slots)
            assert segments.backend == "cuda"
            out = compiled(y.clone(), x, segments)
            expected = _reference(y, x, lora_a, lora_b, lora_ranks, new_slots)
            _assert_matches(out, y, expected, new_slots, lora_ranks, torch.bfloat16, f"{mapping}, seed {seed}")


def test_unsupported_inputs_raise_value_error():
    y, x, lora_a, lora_b, lora_ranks, slots = _problem(4, 64, 64, 8, 2, "random", "full", torch.bfloat16, 0)
    segments = build_segments(slots, 2, "cuda")
    with pytest.raises(ValueError, match="multiples of 8"):
        cuda_ops.lora_add(y[:, :60].contiguous(), x, lora_a, lora_b[:, :60].contiguous(), lora_ranks, segments)
    with pytest.raises(ValueError, match="one dtype"):
        cuda_ops.lora_add(y.half(), x, lora_a, lora_b, lora_ranks, segments)
    with pytest.raises(ValueError, match="not supported"):
        cuda_ops.lora_add(y.double(), x.double(), lora_a.double(), lora_b.double(), lora_ranks, segments)
    with pytest.raises(ValueError, match="int32"):
        cuda_ops.lora_add(y, x, lora_a, lora_b, lora_ranks.long(), segments)
    big_a = torch.zeros(2, cuda_ops.MAX_RANK + 8, 64, dtype=torch.bfloat16, device="cuda")
    big_b = torch.zeros(2, 64, cuda_ops.MAX_RANK + 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="max rank"):
        cuda_ops.lora_add(y, x, big_a, big_b, lora_ranks, segments)
