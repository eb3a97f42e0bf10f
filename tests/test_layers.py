"""LoraHook on Linear and Conv1D over a device pool: per-token adapters, flattened inputs, slot reuse, the
allocator and the chunk layout the pool is made of."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import save_peft_adapter
from opaque_kernels import route_to_opaque_kernels
from torch import nn
from transformers.pytorch_utils import Conv1D

from punica_hf import MultiLoraModel
from punica_hf.formats import ModuleLora
from punica_hf.layers import GROUP_MAX_TOKENS, LoraContext, LoraHook, find_projection_groups
from punica_hf.ops import build_segments
from punica_hf.store.pool import ALIGN, ChunkLayout, DevicePool, ExtentAllocator

IN, OUT, SLOTS, MAX_RANK = 16, 24, 3, 6


def _hooked(kind: str, ranks=((0, 6), (2, 2))):
    """A Linear or Conv1D with a hook, slots filled with random factors ``{slot: rank}``; pool poisoned."""
    torch.manual_seed(0)
    module = nn.Linear(IN, OUT) if kind == "linear" else Conv1D(OUT, IN)
    pool = DevicePool(torch.device("cpu"), torch.float32, capacity=4096, rows={"m": 0, "other": 1}, num_slots=SLOTS)
    pool.tables.pool.fill_(float("nan"))  # anything read outside a placed chunk shows up as NaN
    row = pool.rows["m"]
    context = LoraContext()
    hook = LoraHook(module, IN, OUT, pool.tables, row, context, MAX_RANK)
    factors = {}
    for slot, rank in ranks:
        factors[slot] = ModuleLora(torch.randn(rank, IN), torch.randn(OUT, rank))
        layout = ChunkLayout.plan({"m": factors[slot]}, pool.rows)
        start = pool.allocator.allocate(layout.size)
        chunk = torch.empty(layout.size)
        layout.fill(chunk, {"m": factors[slot]})
        pool.place(slot, layout, start, chunk)
    return module, hook, context, factors, pool


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("shape", [(2, 5), (10,)], ids=["batch_seq", "flattened"])
def test_each_token_gets_its_own_adapter(kind, shape):
    module, _, context, factors, _ = _hooked(kind)
    x = torch.randn(*shape, IN)
    token_slots = torch.tensor([0, -1, 2, 2, 0, 1, -1, 0, 2, 0])  # slot 1 holds no adapter in this module
    context.begin(build_segments(token_slots, SLOTS))
    y = module(x)
    context.end()

    with torch.no_grad():
        base = module(x).reshape(-1, OUT)  # no context: the hook adds nothing
    flat_x = x.reshape(-1, IN)
    for t, slot in enumerate(token_slots.tolist()):
        expected = base[t]
        if slot in factors:
            expected = expected + factors[slot].lora_b @ (factors[slot].lora_a @ flat_x[t])
        torch.testing.assert_close(y.reshape(-1, OUT)[t], expected, atol=1e-5, rtol=1e-5)


def test_a_reused_slot_holds_nothing_of_its_previous_owner():
    module, _, context, factors, pool = _hooked("linear")
    other = pool.rows["other"]  # a second module row: the new owner of slot 0 does not target row "m"
    layout = ChunkLayout.plan({"other": factors[2]}, {"other": other})
    start = pool.allocator.allocate(layout.size)
    chunk = torch.empty(layout.size)
    layout.fill(chunk, {"other": factors[2]})
    pool.place(0, layout, start, chunk)
    assert pool.tables.ranks[pool.rows["m"]].tolist() == [0, 0, 2]
    x = torch.randn(3, IN)
    context.begin(build_segments(torch.tensor([0, 0, 0]), SLOTS))
    y = module(x)
    context.end()
    torch.testing.assert_close(y, nn.functional.linear(x, module.weight, module.bias), atol=0, rtol=0)


def test_removed_hook_gives_the_module_back():
    module, hook, context, _, _ = _hooked("linear")
    assert module.forward is hook and not module._forward_hooks  # a forward attribute, not a module hook
    hook.remove()
    assert "forward" not in module.__dict__
    x = torch.randn(2, IN)
    context.begin(build_segments(torch.tensor([0, 2]), SLOTS))
    torch.testing.assert_close(module(x), nn.functional.linear(x, module.weight, module.bias), atol=0, rtol=0)


def test_hooks_chain_with_other_forward_wrappers():
    """A forward already on the instance (accelerate's device hooks) is called by the hook and put back on removal;
    one installed over the hook afterwards keeps working once the hook is removed (the hook then passes through)."""
    torch.manual_seed(0)
    calls = []

    def wrap(module, name):
        inner = module.forward

        def forward(*args, **kwargs):
            calls.append(name)
            return inner(*args, **kwargs)

        module.forward = forward
        return forward

    module, _, context, factors, pool = _hooked("linear")
    module.forward.remove()
    before = wrap(module, "before")
    hook = LoraHook(module, IN, OUT, pool.tables, pool.rows["m"], context, MAX_RANK)
    wrap(module, "after")
    x = torch.randn(2, IN)
    plain = nn.functional.linear(x, module.weight, module.bias)
    context.begin(build_segments(torch.tensor([0, -1]), SLOTS))
    y = module(x)
    torch.testing.assert_close(y[0], plain[0] + factors[0].lora_b @ (factors[0].lora_a @ x[0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1], plain[1], atol=0, rtol=0)
    assert calls == ["after", "before"]
    hook.remove()  # "after" still calls it: it stays in the chain, adding nothing
    torch.testing.assert_close(module(x), plain, atol=0, rtol=0)
    assert calls[2:] == ["after", "before"]
    context.end()
    module.forward = before  # "after" removed: a new hook over "before" gives it back on removal
    LoraHook(module, IN, OUT, pool.tables, pool.rows["m"], context, MAX_RANK).remove()
    assert module.forward is before


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_an_input_passed_by_keyword_gets_its_update(kind):
    module, _, context, _, _ = _hooked(kind)
    x = torch.randn(3, IN)
    context.begin(build_segments(torch.tensor([0, 2, -1]), SLOTS))
    by_position = module(x)
    by_keyword = module(**{"input" if kind == "linear" else "x": x})
    context.end()
    torch.testing.assert_close(by_keyword, by_position, atol=0, rtol=0)
    assert not torch.equal(by_keyword, module(x))  # outside the forward: no update


def test_token_count_mismatch_is_a_clear_error():
    module, _, context, _, _ = _hooked("linear")
    context.begin(build_segments(torch.tensor([0, 2]), SLOTS))
    with pytest.raises(ValueError, match="3 tokens but the batch's adapter mapping has 2"):
        module(torch.randn(3, IN))


class _Attention(nn.Module):
    """q/k/v projections of one input, called the way a test asks (shared input, cross-attention, twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(IN, OUT), nn.Linear(IN, 8), nn.Linear(IN, 16)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> list[torch.Tensor]:
        source = x if memory is None else memory
        return [self.q_proj(x), self.k_proj(source), self.v_proj(source)]


def _hooked_group(targets=("q_proj", "k_proj", "v_proj")):
    """An ``_Attention`` whose q/k/v form one group; ``targets`` get hooks and random factors in slots 0 and 2."""
    torch.manual_seed(0)
    block = _Attention()
    names = ["q_proj", "k_proj", "v_proj"]
    pool = DevicePool(torch.device("cpu"), torch.float32, capacity=8192, rows={n: i for i, n in enumerate(names)},
                      num_slots=SLOTS)
    pool.tables.pool.fill_(float("nan"))
    linear = {n: (IN, getattr(block, n).out_features, torch.device("cpu")) for n in names}
    groups = find_projection_groups(linear, pool.rows)
    assert len({id(g) for g in groups.values()}) == 1 and groups["q_proj"].out_features == [OUT, 8, 16]
    context = LoraContext()
    factors = {slot: {} for slot in (0, 2)}
    for name in targets:
        module = getattr(block, name)
        LoraHook(module, IN, module.out_features, pool.tables, pool.rows[name], context, MAX_RANK, groups[name])
        for slot in factors:
            factors[slot][name] = ModuleLora(torch.randn(2 + slot, IN), torch.randn(module.out_features, 2 + slot))
    for slot, by_module in factors.items():
        layout = ChunkLayout.plan(by_module, pool.rows)
        start = pool.allocator.allocate(layout.size)
        chunk = torch.empty(layout.size)
        layout.fill(chunk, by_module)
        pool.place(slot, layout, start, chunk)
    return block, context, factors, groups["q_proj"]


def _expected(block, factors, name, x, token_slots):
    module = getattr(block, name)
    rows = nn.functional.linear(x, module.weight, module.bias).clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot in factors and name in factors[slot]:
            rows[t] += factors[slot][name].lora_b @ (factors[slot][name].lora_a @ x[t])
    return rows


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj")], ids=["all", "q_v"])
def test_grouped_projections_each_get_their_own_update(targets):
    """One grouped call serves every member (a member without a hook leaves its columns unused)."""
    block, context, factors, group = _hooked_group(targets)
    x = torch.randn(4, IN)
    token_slots = torch.tensor([2, -1, 0, 2])
    context.begin(build_segments(token_slots, SLOTS))
    outputs = dict(zip(["q_proj", "k_proj", "v_proj"], block(x)))
    assert len(context.group_deltas) == 1  # computed once, by the first member
    context.end()
    assert group.shares_input and not context.group_deltas
    for name, output in outputs.items():
        torch.testing.assert_close(output, _expected(block, factors, name, x, token_slots), atol=1e-5, rtol=1e-5)


def test_above_decode_sizes_each_member_computes_its_own():
    """Past GROUP_MAX_TOKENS (prefill) no grouped call is made; every member still gets its update."""
    block, context, factors, group = _hooked_group()
    token_slots = torch.randint(-1, SLOTS, (GROUP_MAX_TOKENS + 1,))
    x = torch.randn(GROUP_MAX_TOKENS + 1, IN)
    context.begin(build_segments(token_slots, SLOTS))
    outputs = block(x)
    assert not context.group_deltas
    context.end()
    for name, output in zip(["q_proj", "k_proj", "v_proj"], outputs):
        torch.testing.assert_close(output, _expected(block, factors, name, x, token_slots), atol=1e-4, rtol=1e-5)
    assert group.shares_input


def test_projections_are_grouped_whatever_the_environment(base, tmp_path, monkeypatch):
    """Grouping is always on (no environment switch): q/k/v and up get their groups, and the grouped calls give
    the adapter's update to the rows that use it and none to the others."""
    adapter = save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])
    input_ids = torch.tensor([[5, 17, 42, 8], [61, 2, 9, 77]])
    monkeypatch.setenv("PUNICA_HF_GROUP_PROJECTIONS", "0")  # the switch that was: no longer read
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    wrapped.load_adapters({"a": adapter})
    grouped = {name: hook.group for name, hook in wrapped._injection.hooks.items()}
    assert grouped and all(group is not None for group in grouped.values()), grouped
    with torch.no_grad():
        logits = wrapped(input_ids=input_ids, adapter_ids=["a", None]).logits
        plain = base(input_ids=input_ids).logits
    assert not torch.allclose(logits[0], plain[0], atol=1e-3)  # row 0's adapter changed it
    torch.testing.assert_close(logits[1], plain[1], atol=1e-5, rtol=1e-5)  # row 1 has none


def test_members_with_different_inputs_compute_their_own():
    """Cross-attention: q reads x, k and v read memory. Each gets the update of its own input, and the group stops
    sharing for good."""
    block, context, factors, group = _hooked_group()
    x, memory = torch.randn(3, IN), torch.randn(3, IN)
    token_slots = torch.tensor([0, 2, -1])
    for _ in range(2):
        context.begin(build_segments(token_slots, SLOTS))
        q, k, v = block(x, memory)
        context.end()
        torch.testing.assert_close(q, _expected(block, factors, "q_proj", x, token_slots), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, _expected(block, factors, "k_proj", memory, token_slots), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, _expected(block, factors, "v_proj", memory, token_slots), atol=1e-5, rtol=1e-5)
        assert not group.shares_input


def test_a_block_called_twice_in_one_forward_uses_each_input():
    """The same members on a new input later in the forward (a shared block): the group is computed again."""
    block, context, factors, group = _hooked_group()
    first, second = torch.randn(2, IN), torch.randn(2, IN)
    token_slots = torch.tensor([2, 0])
    context.begin(build_segments(token_slots, SLOTS))
    outputs = [block(first), block(second)]
    context.end()
    for x, results in zip((first, second), outputs):
        for name, output in zip(["q_proj", "k_proj", "v_proj"], results):
            torch.testing.assert_close(output, _expected(block, factors, name, x, token_slots), atol=1e-5, rtol=1e-5)
    assert group.shares_input


def test_chunk_bytes_are_proportional_to_rank():
    def size(rank: int) -> int:
        factors = {"q": ModuleLora(torch.zeros(rank, 4096), torch.zeros(4096, rank))}
        return ChunkLayout.plan(factors, {"q": 0}).size

    assert size(8) == 8 * 8192 and size(32) == 4 * size(8) and size(64) == 8 * size(8)
    small = ChunkLayout.plan({"q": ModuleLora(torch.zeros(3, 40), torch.zeros(24, 3))}, {"q": 0})
    assert all(p.a_offset % ALIGN == 0 and p.b_offset % ALIGN == 0 for p in small.modules.values())


def test_extent_allocator_first_fit_and_merging():
    allocator = ExtentAllocator(100)
    a, b, c = allocator.allocate(30), allocator.allocate(30), allocator.allocate(30)
    assert (a, b, c) == (0, 30, 60) and allocator.allocate(20) is None and allocator.used == 90
    allocator.free(b, 30)
    assert allocator.allocate(40) is None  # 30 + 10 free, not contiguous
    allocator.free(a, 30)  # merges with b's extent: 60 contiguous
    assert allocator.allocate(60) == 0
    allocator.free(0, 60)
    allocator.free(c, 30)  # everything merges back into one extent
    assert allocator.used == 0 and allocator.allocate(100) == 0


def test_compiled_forward_follows_hooks_added_after_it_and_unwrap(base, tmp_path, monkeypatch):
    """A forward compiled as one graph must still see a module hooked after its compile (an adapter on new
    targets: its hooks are new ``forward`` attributes, which Dynamo guards, so it recompiles), and after
    ``unwrap()`` the compiled call runs the base model."""
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    wrapped.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])})
    route_to_opaque_kernels(wrapped, monkeypatch)
    compiles = []

    def backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(wrapped.model, backend=backend, fullgraph=True, dynamic=False)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    try:
        with torch.no_grad():
            for adapters in (["a", None], ["b", "a"]):
                if adapters[0] == "b":  # hooks on o_proj and down_proj, made after the first compile
                    targets = ["o_proj", "down_proj"]
                    wrapped.load_adapters({"b": save_peft_adapter(base, tmp_path / "b", r=4, seed=3,
                                                                  target_modules=targets)})
                slots = torch.tensor(wrapped.acquire(adapters).slots, dtype=torch.int32)
                expected = wrapped.model(input_ids=ids, adapter_ids=slots).logits
                torch.testing.assert_close(compiled(input_ids=ids, adapter_ids=slots).logits, expected, rtol=0,
                                           atol=0)
            assert len(compiles) == 2
            plain = wrapped.unwrap()
            torch.testing.assert_close(compiled(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


def test_the_ops_are_decided_at_load_so_a_first_forward_compiles_whole(base, tmp_path, monkeypatch):
    """Finding the CUDA kernels (file reads, stood in for here) cannot be traced: loading adapters decides the ops of
    their device, so a model compiled before any eager forward is one graph; a copy, which decides again where it
    runs, does so at ``decide_backends()``."""
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    backend = route_to_opaque_kernels(wrapped, monkeypatch, decided=False)
    wrapped.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "o_proj"])})
    assert wrapped._injection.context.backend(torch.device("cpu")) is backend
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    slots = torch.tensor(wrapped.acquire(["a", None]).slots, dtype=torch.int32)
    try:
        for model in (wrapped, copy.deepcopy(wrapped)):
            if model is not wrapped:
                model.decide_backends()
            compiled = torch.compile(model.model, backend="eager", fullgraph=True, dynamic=False)  # raises on a break
            with torch.no_grad():
                torch.testing.assert_close(compiled(input_ids=ids, adapter_ids=slots).logits,
                                           model.model(input_ids=ids, adapter_ids=slots).logits, rtol=0, atol=0)
            torch._dynamo.reset()
    finally:
        torch._dynamo.reset()


def test_hooks_keep_no_instance_dict_and_survive_a_deep_copy(base, tmp_path):
    """A compiled forward guards every hook object at every call; an instance __dict__ adds a guard per method the
    hook calls (Dynamo checks it does not shadow the class's). Hooks and groups keep their state in slots, and a
    deep copy of the wrapped model still carries working hooks with their groups."""
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    targets = ["q_proj", "k_proj", "v_proj"]
    wrapped.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=targets)})
    hooks = list(wrapped._injection.hooks.values())
    assert hooks and all(not hasattr(hook, "__dict__") for hook in hooks)
    assert all(hook.group is not None and not hasattr(hook.group, "__dict__") for hook in hooks)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        expected = wrapped(input_ids=ids, adapter_ids=["a", None]).logits
        copied = copy.deepcopy(wrapped)
        torch.testing.assert_close(copied(input_ids=ids, adapter_ids=["a", None]).logits, expected, rtol=0, atol=0)
        assert not torch.equal(expected[0], wrapped(input_ids=ids, adapter_ids=[None, None]).logits[0])


def test_eager_forward_on_the_kernels_adds_in_place_once_per_projection(base, tmp_path, monkeypatch):
    """Eager steps are bound by host time per op: on the kernels each hooked projection makes exactly one call,
    with the module's own input and output tensors (no reshape, no grouped call whose members would each launch an
    add), and the logits are the PyTorch ops'."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = save_peft_adapter(base, tmp_path / "a", r=4, target_modules=targets)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    reference = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    reference.load_adapters({"a": adapter})
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    wrapped.load_adapters({"a": adapter})
    backend = route_to_opaque_kernels(wrapped, monkeypatch)
    calls = []
    add, delta = backend.lora_add_unchecked, backend.lora_delta_unchecked

    def spy_add(y, x, *args):
        calls.append(("add", y.shape, x.shape))
        add(y, x, *args)

    monkeypatch.setattr(backend, "lora_add_unchecked", spy_add)
    monkeypatch.setattr(backend, "lora_delta_unchecked", lambda *args: calls.append("delta") or delta(*args))
    with torch.no_grad():
        logits = wrapped(input_ids=ids, adapter_ids=["a", None]).logits
        expected = reference(input_ids=ids, adapter_ids=["a", None]).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == len(wrapped._injection.hooks) == 7 * base.config.num_hidden_layers, calls
    assert all(call[0] == "add" and call[1][:2] == call[2][:2] == (2, 3) for call in calls), calls


def test_compiled_forward_takes_the_tables_once_not_per_hook(base, tmp_path, monkeypatch):
    """Each graph input costs host time at every compiled call: the hooks must add a fixed few, not three each.
    Projections that share their input make one grouped call: q/k/v and gate/up one each, o and down their own."""
    graphs = []

    def count_inputs(model, **kwargs) -> int:
        counted = []

        def backend(graph_module, example_inputs):
            counted.append(len(example_inputs))
            graphs.append(graph_module)
            return graph_module.forward

        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        with torch.no_grad():
            compiled(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), **kwargs)
        torch._dynamo.reset()
        return counted[0]

    base_inputs = count_inputs(copy.deepcopy(base))
    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=targets)})
    num_hooks = len(wrapped._injection.hooks)
    assert num_hooks >= 7 * base.config.num_hidden_layers

    route_to_opaque_kernels(wrapped, monkeypatch)
    slots = torch.tensor(wrapped.acquire(["a", None]).slots, dtype=torch.int32)
    lora_inputs = count_inputs(wrapped.model, adapter_ids=slots)
    # adapter_ids, the pool, two offset tables and the ranks: independent of the number of hooks
    assert lora_inputs - base_inputs <= 5, (base_inputs, lora_inputs, num_hooks)
    calls = [str(node.target) for node in graphs[-1].graph.nodes if node.op == "call_function"]
    layers = base.config.num_hidden_layers
    assert calls.count("punica_hf_test.lora_delta.default") == 2 * layers, calls
    assert calls.count("punica_hf_test.lora_add.default") == 2 * layers, calls


def test_compiled_group_updates_are_added_after_the_gemm_not_folded_into_it(base, tmp_path, monkeypatch):
    """Inductor rewrites ``mm(x, W) + update`` on the GEMM's 2-D result into ``addmm(update, x, W)``, which copies the
    update into the GEMM's output first (one copy kernel per grouped member: 96 per Llama-3-8B decode step). The
    members' updates must reach Inductor in the module output's own shape, as plain adds it fuses into the next
    kernel. On the CPU Inductor folds every add of a GEMM result it can, so an ``addmm`` here means the fold."""
    from torch._inductor.utils import run_and_get_code

    wrapped = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=targets)})
    route_to_opaque_kernels(wrapped, monkeypatch)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    slots = torch.tensor(wrapped.acquire(["a", None]).slots, dtype=torch.int32).unsqueeze(1).expand(2, 3)
    compiled = torch.compile(wrapped.model, fullgraph=True, dynamic=False)
    try:
        with torch.no_grad():
            logits, code = run_and_get_code(lambda: compiled(input_ids=ids, adapter_ids=slots).logits)
            expected = wrapped.model(input_ids=ids, adapter_ids=slots).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    source = "\n".join(code)
    assert source.count("punica_hf_test.lora_delta") >= 2 * base.config.num_hidden_layers, source
    assert "addmm" not in source, [line for line in source.splitlines() if "addmm" in line]
