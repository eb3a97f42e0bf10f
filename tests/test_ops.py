"""The per-forward segment metadata, the pool layout, the PyTorch reference op against per-token float64 math, and
how the backend and the kernel choices are picked and passed to the ops (CPU)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import pytest
import torch

from punica_hf import ops
from punica_hf.layers import LoraContext
from punica_hf.ops import attention, cuda, torch_ops
from punica_hf.ops.segments import CHUNK_TOKENS, PER_TOKEN_MAX_TOKENS, build_segments


def _random_slots(num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-1, num_slots, (num_tokens,), generator=generator)


@pytest.mark.parametrize("num_tokens,num_slots", [(1, 1), (1, 5), (7, 3), (40, 8), (64, 64), (3, 50)])
def test_segments_group_every_token_with_its_slot(num_tokens, num_slots):
    generator = torch.Generator().manual_seed(num_tokens * 100 + num_slots)
    slots = _random_slots(num_tokens, num_slots, generator)
    segments = build_segments(slots, num_slots)

    assert sorted(segments.sorted_token_ids.tolist()) == list(range(num_tokens))
    assert segments.sorted_slots.dtype == torch.int32
    assert segments.sorted_slots.tolist() == slots[segments.sorted_token_ids.long()].tolist()
    # Slots in increasing order, each slot's tokens in token order (a stable sort), tokens without adapter last.
    keys = [(slot if slot >= 0 else num_slots, token) for token, slot in enumerate(slots.tolist())]
    assert segments.sorted_token_ids.tolist() == [token for _, token in sorted(keys)]


def _chunk_starts_by_hand(table: list[int]) -> list[int]:
    """Where the kernels' chunks start (csrc/chunks.cuh, find_chunk): a position with a slot whose slot differs
    from the previous position's, or at a multiple of the chunk size; the chunk ends before the next such."""
    starts = []
    for p, slot in enumerate(table):
        if slot >= 0 and (p % CHUNK_TOKENS == 0 or table[p - 1] != slot):
            starts.append(p)
    return starts


def test_chunk_size_and_tiled_threshold_are_the_kernels():
    """The chunk list is built in Python for chunks the CUDA kernels define, and left empty at sizes the kernels
    never tile: one chunk size and one threshold in both."""
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    assert int(re.search(r"constexpr int kChunk = (\d+);", (csrc / "chunks.cuh").read_text()).group(1)) == CHUNK_TOKENS
    threshold = re.search(r"constexpr int kPerTokenMaxTokens = (\d+);", (csrc / "lora_add.cu").read_text())
    assert int(threshold.group(1)) == PER_TOKEN_MAX_TOKENS
    small = build_segments(torch.tensor([1, 2, 2, -1, 3] * 51 + [4]), 6)  # 256 tokens: never tiled
    assert small.short_run_chunk_starts.tolist() == [256] * 256


@pytest.mark.parametrize("seed", range(20))
def test_chunk_starts_of_random_steps(seed):
    """Random slots over random sizes (single tokens, runs of a few tokens, runs longer than ``SHORT_RUN_TOKENS``,
    base tokens): the chunk list holds exactly the positions where a chunk of the short runs starts, once, in
    increasing order."""
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(PER_TOKEN_MAX_TOKENS + 1, 600, (1,), generator=generator))
    slots = torch.randint(-1, int(torch.randint(1, 40, (1,), generator=generator)), (count,), generator=generator)
    segments = build_segments(slots, 40)
    expected = _chunk_starts_by_hand(segments.short_run_slots.tolist())
    assert segments.short_run_chunk_starts.tolist() == expected + [count] * (count - len(expected))


def test_segments_split_positions_by_the_size_of_their_run():
    """A mixed step: one slot's long prefill, single decode tokens of many slots, a run of exactly the threshold,
    base tokens. Positions of runs above ``SHORT_RUN_TOKENS`` keep their slot in ``long_run_slots`` only, the
    others in ``short_run_slots`` only, base tokens in neither."""
    from punica_hf.ops.segments import SHORT_RUN_TOKENS

    slots = torch.tensor([5] * 300 + list(range(10, 30)) + [7] * SHORT_RUN_TOKENS + [-1] * 9 + [9] * (SHORT_RUN_TOKENS + 1))
    slots = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(0))]
    segments = build_segments(slots, 32)
    sorted_slots = segments.sorted_slots.tolist()
    long_run, short_run = segments.long_run_slots.tolist(), segments.short_run_slots.tolist()
    for slot, long_slot, short_slot in zip(sorted_slots, long_run, short_run):
        is_long = slot in (5, 9)
        assert long_slot == (slot if is_long else -1) and short_slot == (-1 if is_long else slot)
    assert segments.long_run_slots.dtype == segments.short_run_slots.dtype == torch.int32
    # The list the per-token kernels walk: where their chunks of the short runs start, then T to the end.
    expected = _chunk_starts_by_hand(short_run)
    starts = segments.short_run_chunk_starts
    assert starts.tolist() == expected + [slots.numel()] * (slots.numel() - len(expected))
    assert starts.dtype == torch.int32 and len(expected) >= 20  # every single decode token starts a chunk


def test_segments_to_moves_every_tensor():
    segments = build_segments(torch.tensor([2, -1, 0, 2]), 3)
    moved = segments.to(torch.device("meta"))
    assert moved.num_slots == 3
    for field in dataclasses.fields(segments):
        value = getattr(segments, field.name)
        if isinstance(value, torch.Tensor):
            assert getattr(moved, field.name).shape == value.shape, field.name
            assert getattr(moved, field.name).device == torch.device("meta"), field.name


def test_pack_factors_aligns_and_keeps_every_factor():
    generator = torch.Generator().manual_seed(0)
    factors = [torch.randn(rows, cols, generator=generator) for rows, cols in [(3, 40), (1, 8), (5, 24)]]
    pool, offsets = torch_ops.pack_factors(factors, gaps=[0, 70, 1], fill=float("nan"))
    assert all(offset % torch_ops.POOL_ALIGNMENT == 0 for offset in offsets)
    assert offsets[1] >= offsets[0] + factors[0].numel() + 70 and offsets[2] >= offsets[1] + factors[1].numel() + 1
    for factor, offset in zip(factors, offsets):
        assert torch.equal(torch_ops.factor_view(pool, offset, *factor.shape), factor)
    assert pool.isnan().sum() == pool.numel() - sum(f.numel() for f in factors)
    with pytest.raises(ValueError, match="outside the pool"):
        torch_ops.factor_view(pool, offsets[2], 6, 24)


def _pool_problem(ranks: list[int], hidden_in: int, hidden_out: int, dtype: torch.dtype, generator: torch.Generator):
    """Dense factors per slot (A [r, in], B [out, r]) and the same factors in one NaN-filled pool.

    Factors go in random order with random gaps between them; slots of rank 0 get offsets into a NaN block at the
    pool's end (a read through them would show up as NaN). Returns (dense A list, dense B list, pool, a_offsets,
    b_offsets), offsets as int64 tensors.
    """
    lora_a = [torch.randn(r, hidden_in, generator=generator).to(dtype) for r in ranks]
    lora_b = [torch.randn(hidden_out, r, generator=generator).to(dtype) for r in ranks]
    factors = [f for r, a, b in zip(ranks, lora_a, lora_b) if r > 0 for f in (a, b.T)]
    order = torch.randperm(len(factors), generator=generator).tolist()
    nan_block = torch.full((1, torch_ops.POOL_ALIGNMENT), float("nan"), dtype=dtype)
    gaps = torch.randint(0, 3 * torch_ops.POOL_ALIGNMENT, (len(factors) + 1,), generator=generator).tolist()
    pool, placed = torch_ops.pack_factors([factors[i] for i in order] + [nan_block], gaps, fill=float("nan"))
    offsets = [0] * len(factors)
    for position, i in enumerate(order):
        offsets[i] = placed[position]
    a_offsets, b_offsets, next_factor = [], [], 0
    for r in ranks:
        if r > 0:
            a_offsets.append(offsets[next_factor])
            b_offsets.append(offsets[next_factor + 1])
            next_factor += 2
        else:
            a_offsets.append(placed[-1])
            b_offsets.append(placed[-1])
    return lora_a, lora_b, pool, torch.tensor(a_offsets), torch.tensor(b_offsets)


def _per_token_reference(y, x, lora_a, lora_b, ranks, slots):
    """float64, one token at a time, from the dense factors: the definition."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0 and ranks[slot] > 0:
            out[t] += lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double())
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_torch_lora_add_matches_per_token_math(dtype, tolerance, num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    ranks, max_rank, h_in, h_out = [8, 0, 3, 5, 0, 1], 8, 24, 40
    lora_a, lora_b, pool, a_offsets, b_offsets = _pool_problem(ranks, h_in, h_out, dtype, generator)
    x = torch.randn(num_tokens, h_in, generator=generator).to(dtype)
    y = torch.randn(num_tokens, h_out, generator=generator).to(dtype)
    slots = _random_slots(num_tokens, len(ranks), generator)
    lora_ranks = torch.tensor(ranks, dtype=torch.int32)

    expected = _per_token_reference(y, x, lora_a, lora_b, ranks, slots)
    out = y.clone()
    segments = build_segments(slots, len(ranks))
    torch_ops.lora_add(out, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)

    assert torch.isfinite(out).all(), "a read outside the adapters' factors (NaN) reached the output"
    error = (out.double() - expected).norm() / expected.norm()
    assert error < tolerance
    no_adapter = (slots < 0) | (lora_ranks[slots.clamp(min=0)] == 0)
    assert torch.equal(out[no_adapter], y[no_adapter]), "rows without an adapter must stay untouched"


def test_torch_lora_add_rejects_rank_above_max_rank():
    generator = torch.Generator().manual_seed(1)
    _, _, pool, a_offsets, b_offsets = _pool_problem([4], 8, 8, torch.float32, generator)
    segments = build_segments(torch.tensor([0]), 1)
    y = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="max_rank=2"):
        torch_ops.lora_add(y, torch.ones(1, 8), pool, a_offsets, b_offsets, torch.tensor([4], dtype=torch.int32),
                           segments, max_rank=2)
    assert torch.equal(y, torch.zeros(1, 8))


def test_backend_for_picks_the_reference_on_cpu_and_refuses_cuda_there():
    assert isinstance(ops.backend_for(torch.device("cpu")), ops.TorchLoraBackend)
    assert isinstance(ops.backend_for("cpu", "torch"), ops.TorchLoraBackend)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.backend_for(torch.device("cpu"), "cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.backend_for(torch.device("cpu"), "fastest")


def test_backend_env_is_read_once_when_the_context_is_made(monkeypatch):
    """PUNICA_HF_BACKEND is the user's override, read when a model (its LoraContext) is made: a later change of
    the environment changes nothing for that model, and a bad value is refused at once, naming the variable."""
    monkeypatch.setenv("PUNICA_HF_BACKEND", "cuda")
    context = LoraContext()
    monkeypatch.setenv("PUNICA_HF_BACKEND", "torch")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        context.backend(torch.device("cpu"))  # still the cuda the context was made with
    assert isinstance(LoraContext(backend="torch").backend(torch.device("cpu")), ops.TorchLoraBackend)
    monkeypatch.setenv("PUNICA_HF_BACKEND", "fastest")
    with pytest.raises(ValueError, match="PUNICA_HF_BACKEND must be one of"):
        LoraContext()
    with pytest.raises(ValueError, match="backend must be one of"):
        LoraContext(backend="fastest")


def test_a_copied_context_decides_its_backends_again_with_the_same_settings(monkeypatch):
    """A pickled context (a model saved and loaded in another process) must not carry backend objects whose kernels
    were loaded in the process that made them: the copy decides again, with the same request and kernel config."""
    config = ops.KernelConfig(short_runs=False)
    context = LoraContext(config, "torch")
    context.backend(torch.device("cpu"))
    chosen = []
    monkeypatch.setattr(ops, "backend_for", lambda *args: chosen.append(args) or ops.TorchLoraBackend())
    copied = pickle.loads(pickle.dumps(context))
    copied.backend(torch.device("cpu"))
    copied.backend(torch.device("cpu"))
    assert chosen == [(torch.device("cpu"), "torch", config)]


def test_kernel_config_is_frozen_and_typed():
    config = ops.KernelConfig(fused=False)
    assert (config.programmatic_launch, config.fused, config.short_runs) == (True, False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fused = True
    with pytest.raises(ValueError, match="KernelConfig.short_runs must be a bool"):
        ops.KernelConfig(short_runs=0)
    with pytest.raises(ValueError, match="KernelConfig"):
        LoraContext(kernels={"fused": False})


def _op_schemas() -> dict[str, list[str]]:
    """Argument names of each op as csrc/punica_ops.cpp registers it."""
    source = (Path(__file__).resolve().parents[1] / "csrc" / "punica_ops.cpp").read_text()
    registrations = re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', source)
    schemas = {}
    for pieces in registrations:
        schema = "".join(re.findall(r'"([^"]*)"', pieces))
        name, arguments = re.match(r"(\w+)\((.*)\) ->", schema).groups()
        schemas[name] = [argument.split()[-1] for argument in arguments.split(",")]
    return schemas


def test_op_schemas_carry_the_kernel_choices_and_the_fakes_mirror_them(monkeypatch):
    """The kernel choices are arguments of the ops themselves (so compiled graphs are keyed by them), the schema has
    nothing the kernels do not read, and each fake implementation (what torch.compile traces) takes exactly the
    schema's arguments."""
    schemas = _op_schemas()
    assert schemas["lora_add"][-6:] == ["short_run_chunk_starts", "max_rank", "programmatic_launch", "fused",
                                        "short_runs", "short_run_chunks"]
    assert schemas["lora_delta"][-3:] == ["max_rank", "programmatic_launch", "fused"]
    assert schemas["paged_attention"][-2:] == ["scale", "splits"]
    assert not {"segment_starts", "segment_slots"} & set(schemas["lora_add"])
    fakes = {}
    monkeypatch.setattr(torch.library, "register_fake", lambda name: lambda fn: fakes.setdefault(name, fn))
    cuda._register_fake()
    for name, arguments in schemas.items():
        assert list(inspect.signature(fakes[f"punica_hf::{name}"]).parameters) == arguments, name


class _RecordingOp:
    def __init__(self, result=None) -> None:
        self.calls, self.result = [], result

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def test_cuda_backend_passes_its_kernel_config_to_every_call(monkeypatch):
    """Each op call carries the backend's KernelConfig as arguments (the ops stand in for the extension here)."""
    monkeypatch.setattr(cuda, "load_extension", lambda verbose=False: None)
    add_op, delta_op = _RecordingOp(), _RecordingOp(torch.zeros(2, 16))
    monkeypatch.setattr(cuda, "_op", add_op)
    monkeypatch.setattr(cuda, "_delta_op", delta_op)
    backend = cuda.CudaLoraBackend(ops.KernelConfig(programmatic_launch=False, short_runs=False, short_run_chunks=True))
    segments = build_segments(torch.tensor([0, -1]), 2)
    tables = (torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    backend.lora_add(torch.zeros(2, 16), torch.zeros(2, 8), torch.zeros(64), *tables, segments, 4)
    grouped = tuple(table.expand(2, 2).contiguous() for table in tables)
    backend.lora_delta(torch.zeros(2, 8), torch.zeros(64), *grouped, segments, 4, [8, 8])
    assert add_op.calls[0][-5:] == (4, False, True, False, True)
    # The split's tables are the segments' own, each in its place (a swap would pass the shape checks).
    assert [id(t) for t in add_op.calls[0][6:11]] == [id(segments.sorted_token_ids), id(segments.sorted_slots),
                                                       id(segments.long_run_slots), id(segments.short_run_slots),
                                                       id(segments.short_run_chunk_starts)]
    cuda.CudaLoraBackend(ops.KernelConfig(short_run_chunks=False)).lora_add(
        torch.zeros(2, 16), torch.zeros(2, 8), torch.zeros(64), *tables, segments, 4)
    assert add_op.calls[1][-2:] == (True, False)
    assert [8, 8] in delta_op.calls[0] and delta_op.calls[0][-3:] == (4, False, True)
    assert not backend.takes_unchecked(torch.float64, 8, 8, 4) and backend.takes_unchecked(torch.float32, 8, 16, 4)


def test_paged_attention_passes_splits_to_the_kernel(monkeypatch):
    """The attention's split count is an argument of the op (0 = the launcher's choice), checked before the call."""
    attention_op = _RecordingOp(torch.zeros(1))
    monkeypatch.setattr(cuda, "_attention_op", attention_op)
    monkeypatch.setattr(attention, "cuda_unsupported", lambda *args: None)  # CPU tensors stand in for CUDA ones
    query, cache = torch.zeros(2, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    args = (query, cache, cache, torch.arange(2), torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), 0.125)
    ops.paged_attention(*args, backend="cuda", splits=3)
    attention.paged_attention_cuda(*args)
    assert [call[-1] for call in attention_op.calls] == [3, 0]
    with pytest.raises(ValueError, match="splits must be an int in"):
        ops.paged_attention(*args, backend="cuda", splits=attention.MAX_SPLITS + 1)
    assert len(attention_op.calls) == 2


def test_model_kernel_config_reaches_the_backend_once_per_device(tmp_path, monkeypatch):
    """MultiLoraModel(kernels=..., backend=...) hands both to the backend choice, made once per device and not
    per forward or per hook."""
    from helpers import save_peft_adapter, tiny_llama

    from punica_hf import MultiLoraModel

    chosen = []

    def recording_backend_for(device, requested="auto", kernels=None):
        chosen.append((torch.device(device), requested, kernels))
        return ops.TorchLoraBackend()

    monkeypatch.setattr(ops, "backend_for", recording_backend_for)
    base = tiny_llama()
    config = ops.KernelConfig(fused=False)
    model = MultiLoraModel(base, max_adapters=2, max_rank=8, kernels=config, backend="torch")
    model.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"])})
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        first = model(input_ids=ids, adapter_ids=["a"]).logits
        second = model(input_ids=ids, adapter_ids=["a"]).logits
    assert torch.equal(first, second)
    assert chosen == [(torch.device("cpu"), "torch", config)]
