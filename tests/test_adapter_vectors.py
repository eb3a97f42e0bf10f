"""DoRA, LoRA bias (``lora_bias=True``) and ``bias="lora_only"`` / ``"all"`` adapters equal PEFT row by row.

Every adapter is saved by PEFT with random factors and vectors (``vector_adapters``); the oracle for a row is a
PeftModel with that row's adapter alone (a ``bias="lora_only"`` adapter rewrites its PeftModel's base biases), or
the untouched base model. Batches mix these adapters with plain LoRA rows and base rows.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import tiny_llama
from vector_adapters import (
    MODELS,
    left_padded_batch,
    make_base,
    peft_oracles,
    row_lengths,
    save_adapters,
    save_vector_adapter,
)

from punica_hf import MultiLoraModel, layers
from punica_hf.formats import AdapterWeights, LoraAdapterConfig, ModuleLora, convert_adapter, load_adapter_weights
from punica_hf.layers import LoraHook
from punica_hf.serving import Engine, EngineConfig, SamplingParams

ATOL = 2e-5


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request, tmp_path_factory):
    base = make_base(request.param)
    paths = save_adapters(request.param, base, tmp_path_factory.mktemp(request.param))
    oracles = peft_oracles(base, paths)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=len(paths), max_rank=8)
    model.load_adapters(paths)
    return request.param, base, paths, oracles, model


def mixed_rows(paths) -> list[str | None]:
    """Every adapter, twice for the first, and a base row."""
    names = list(paths)
    return [names[0], None, *names[1:], names[0]]


@torch.no_grad()
def assert_rows_match(model, oracles, rows, input_ids, attention_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
    real = attention_mask.bool()
    base_logits = oracles[None](input_ids=input_ids, attention_mask=attention_mask).logits
    for row, adapter in enumerate(rows):
        expected = oracles[adapter](input_ids=input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
        if adapter is not None:  # the adapter really changes this row
            assert (expected[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3


def test_mixed_batch_logits_match_peft_row_by_row(setup, monkeypatch):
    _, _, paths, oracles, model = setup
    rows = mixed_rows(paths)
    grouped_calls = []
    group_delta = LoraHook._group_delta
    monkeypatch.setattr(LoraHook, "_group_delta", lambda self, *a: grouped_calls.append(1) or group_delta(self, *a))
    assert_rows_match(model, oracles, rows, *left_padded_batch(row_lengths(len(rows))))
    if setup[0] == "llama":  # q/k/v and gate/up compute their updates in one call, the vectors follow each member
        assert grouped_calls


@torch.no_grad()
def test_generate_matches_peft_row_by_row(setup):
    _, _, paths, oracles, model = setup
    rows = mixed_rows(paths)
    input_ids, attention_mask = left_padded_batch(row_lengths(len(rows)), seed=1)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    tokens = model.generate(**kwargs, adapter_ids=rows)
    for row, adapter in enumerate(rows):
        assert tokens[row].tolist() == oracles[adapter].generate(**kwargs)[row].tolist(), adapter


def test_more_adapters_than_slots_keep_their_vectors_through_the_host_tier_and_the_source(setup):
    """Two slots for every adapter in turn: each is evicted and placed again, from the host tier and (with no host
    tier) read again from its folder; its vectors come back with it."""
    _, base, paths, oracles, _ = setup
    input_ids, attention_mask = left_padded_batch([6, 4], seed=2)
    one_adapter = 0  # a host tier that holds one adapter at a time: the others are read again from their folders
    for name, path in paths.items():
        scratch = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
        scratch.load_adapters({name: path})
        one_adapter = max(one_adapter, scratch.adapter_stats["host_bytes_used"])
    for host_pool_bytes in (None, one_adapter):
        model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8, host_pool_bytes=host_pool_bytes)
        model.load_adapters(paths)
        names = list(paths)
        for _ in range(2):
            for first, second in zip(names, names[1:] + names[:1]):
                assert_rows_match(model, oracles, [first, second], input_ids, attention_mask)
        stats = model.adapter_stats
        assert stats["evictions"] > 0
        assert stats["disk_loads" if host_pool_bytes else "host_loads"] > 0


def test_converted_files_carry_the_vectors(setup, tmp_path):
    _, base, paths, oracles, _ = setup
    converted = {adapter: convert_adapter(path, tmp_path / f"{adapter}.safetensors") for adapter, path in paths.items()}
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=len(paths), max_rank=8)
    model.load_adapters(converted)
    assert_rows_match(model, oracles, mixed_rows(paths), *left_padded_batch(row_lengths(len(paths) + 2), seed=3))


def test_a_copy_of_the_model_keeps_the_vectors(setup):
    _, _, paths, oracles, model = setup
    assert_rows_match(copy.deepcopy(model), oracles, mixed_rows(paths), *left_padded_batch([4] * (len(paths) + 2)))


def test_a_dtype_change_after_loading_keeps_the_vectors(tmp_path):
    base = make_base("llama")
    names = ["dora", "lora_only", "plain"]
    paths = {name: save_vector_adapter(base, tmp_path / name, seed, **MODELS["llama"][1][name])
             for seed, name in enumerate(names)}
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)  # "plain" placed later, from the host
    model.load_adapters(paths)
    model.to(torch.float64)
    oracles = {name: oracle.double() for name, oracle in peft_oracles(base, paths).items()}
    assert_rows_match(model, oracles, ["dora", None, "lora_only"], *left_padded_batch([5, 3, 4], seed=5))
    assert_rows_match(model, oracles, ["plain", "dora"], *left_padded_batch([5, 3], seed=6))


def test_a_scale_beyond_the_layers_dtype_is_refused(tmp_path):
    """A DoRA magnitude whose scale float16 cannot hold would turn the layer's output into inf."""
    base = make_base("llama").half()
    path = save_vector_adapter(base.float(), tmp_path / "dora", 0, r=2, use_dora=True, target_modules=["q_proj"])
    weights = load_adapter_weights(path)
    q_proj = "model.layers.0.self_attn.q_proj"
    huge = dataclasses.replace(weights.modules[q_proj], magnitude=torch.full((32,), 1e9))
    model = MultiLoraModel(make_base("llama").half(), max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match=f"module {q_proj} has values of magnitude up to .* in its output_scale"):
        model.load_adapters({"x": dataclasses.replace(weights, modules={**weights.modules, q_proj: huge})})
    assert not model._injection.hooks


def test_a_cast_into_a_dtype_that_cannot_hold_an_adapter_is_refused_before_anything_moves(tmp_path):
    """A float32 model with a DoRA adapter whose scale float16 cannot hold: ``.half()`` is refused, naming the
    adapter, whether the adapter sits on the device or only on the host, and the model stays float32 with its
    outputs; an adapter kept only as its source (dropped from the host tier) is checked when it is read again, at
    its use."""
    base = make_base("llama")
    adapters = MODELS["llama"][1]
    path = save_vector_adapter(base, tmp_path / "dora", 0, r=2, use_dora=True, target_modules=["q_proj"])
    weights = load_adapter_weights(path)
    q_proj = "model.layers.0.self_attn.q_proj"
    huge = dataclasses.replace(weights, modules={
        **weights.modules, q_proj: dataclasses.replace(weights.modules[q_proj], magnitude=torch.full((32,), 1e9))})
    plain = save_vector_adapter(base, tmp_path / "plain", 1, **adapters["plain"])
    batch = left_padded_batch([5, 3], seed=10)
    for resident in (["huge", "plain"], ["plain"]):  # one slot: "huge" loaded first, then evicted to the host
        model = MultiLoraModel(copy.deepcopy(base), max_adapters=len(resident), max_rank=8)
        model.load_adapters({"huge": huge, "plain": plain})
        with torch.no_grad():
            before = model(input_ids=batch[0], attention_mask=batch[1], adapter_ids=["plain", None]).logits
        with pytest.raises(ValueError, match=r"cannot cast the model's adapters to torch.float16: adapter 'huge' has "
                                             r"values of magnitude up to .*; unload it first"):
            model.half()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        with torch.no_grad():
            after = model(input_ids=batch[0], attention_mask=batch[1], adapter_ids=["plain", None]).logits
        assert torch.equal(before, after)
    # the last model: "plain" in its one slot, "huge" on the host; dropped there, it is kept only as its source
    model._store.host.drop(model.adapters["huge"])
    model.half()
    with torch.no_grad(), pytest.raises(ValueError, match=f"adapter 'huge': module {q_proj} has values of magnitude"):
        model(input_ids=batch[0], attention_mask=batch[1], adapter_ids=["huge", None])


def test_plain_lora_makes_no_vector_tables_and_a_dora_adapter_asks_for_new_graphs(tmp_path):
    base = make_base("llama")
    adapters = MODELS["llama"][1]
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"plain": save_vector_adapter(base, tmp_path / "plain", 0, **adapters["plain"])})
    tables = {id(hook.tables): hook.tables for hook in model._injection.hooks.values()}
    assert all(t.vector_table_count == 0 for t in tables.values())  # plain LoRA applies no vectors: no ops
    layout = model.layout_version
    model.load_adapters({"dora": save_vector_adapter(base, tmp_path / "dora", 1, **adapters["dora_rs"])})
    assert model.layout_version != layout  # hooks already there now apply vectors: captured graphs are stale
    with_vectors = {name for name, hook in model._injection.hooks.items() if hook.row in hook.tables.vectors}
    assert with_vectors == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}


def count_vector_ops(monkeypatch) -> list[int]:
    """A one-element list counting the hooks' scale-and-shift ops from now on."""
    calls = [0]
    original = layers.scale_and_shift

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "scale_and_shift", counted)
    return calls


def test_layers_whose_last_vector_adapter_is_gone_run_no_vector_op(tmp_path, monkeypatch):
    """Unloading the last DoRA adapter of a layer takes its scale-and-shift op out of the forward (a server that
    once served one does not pay for it for good), and asks for new graphs; an adapter unloaded while held keeps
    its op until released; a DoRA adapter loaded again applies its vectors as PEFT does."""
    base = make_base("llama")
    adapters = MODELS["llama"][1]
    paths = {"plain": save_vector_adapter(base, tmp_path / "plain", 0, **adapters["plain"]),
             "dora": save_vector_adapter(base, tmp_path / "dora", 1, **adapters["dora_rs"])}
    oracles = peft_oracles(base, paths)
    batch = left_padded_batch([5, 3, 4], seed=7)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    calls = count_vector_ops(monkeypatch)
    assert_rows_match(model, oracles, ["plain", None, "dora"], *batch)
    assert calls[0] > 0
    held = model.acquire(["dora"])
    layout = model.layout_version
    model.unload_adapter("dora")
    calls[0] = 0
    assert_rows_match(model, oracles, ["plain", None], *left_padded_batch([5, 3], seed=8))
    assert calls[0] > 0 and model.layout_version == layout  # held: still applied
    held.release()
    assert model.layout_version != layout  # graphs captured with the ops are stale
    calls[0] = 0
    assert_rows_match(model, oracles, ["plain", None, "plain"], *batch)
    assert calls[0] == 0
    model.load_adapters({"dora": paths["dora"]})
    assert_rows_match(model, oracles, ["dora", "plain", None], *batch)
    assert calls[0] > 0


def test_a_failed_load_of_a_vector_adapter_leaves_no_vector_op(tmp_path, monkeypatch):
    """A DoRA load that fails after its vector tables were made (here, interrupted while its host copy is built)
    changes nothing: the forward runs no scale-and-shift op and the plain adapter's rows equal PEFT's."""
    base = make_base("llama")
    adapters = MODELS["llama"][1]
    paths = {"plain": save_vector_adapter(base, tmp_path / "plain", 0, **adapters["plain"]),
             "dora": save_vector_adapter(base, tmp_path / "dora", 1, **adapters["dora_rs"])}
    oracles = peft_oracles(base, {"plain": paths["plain"]})
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"plain": paths["plain"]})
    layout = model.layout_version

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model._store), "_host_chunks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.load_adapters({"dora": paths["dora"]})
    monkeypatch.undo()
    calls = count_vector_ops(monkeypatch)
    assert_rows_match(model, oracles, ["plain", None], *left_padded_batch([5, 3], seed=9))
    assert calls[0] == 0 and model.layout_version == layout and set(model.adapters) == {"plain"}


def test_bias_all_that_changes_a_bias_outside_its_modules_is_refused(tmp_path):
    base = make_base("llama")
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.bias.add_(1.0)  # k_proj: not one of the adapter's modules
    path = save_vector_adapter(changed, tmp_path / "all", 0, **MODELS["llama"][1]["bias_all"])
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match=r"changes the bias of model\.layers\.0\.self_attn\.k_proj"):
        model.load_adapters({"all": path})
    assert not model._injection.hooks and not model.adapter_stats["registered"]  # nothing changed


def test_vectors_on_a_model_without_biases(tmp_path):
    """No base bias: DoRA is a scale alone (no shift table), LoRA bias a shift alone (PEFT serves it there too)."""
    base = tiny_llama()
    targets = ["q_proj", "down_proj"]
    paths = {
        "dora": save_vector_adapter(base, tmp_path / "dora", 3, r=4, use_dora=True, target_modules=targets),
        "lora_bias": save_vector_adapter(base, tmp_path / "lora_bias", 4, r=4, lora_bias=True, target_modules=targets),
    }
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"dora": paths["dora"]})
    hook = model._injection.hooks["model.layers.0.self_attn.q_proj"]
    scale, shift = hook.tables.vectors[hook.row]
    assert scale is not None and shift is None
    model.load_adapters({"lora_bias": paths["lora_bias"]})
    rows = ["dora", None, "lora_bias"]
    assert_rows_match(model, peft_oracles(base, paths), rows, *left_padded_batch([5, 3, 4], seed=4))


def test_the_engine_serves_vector_adapters_as_generate_does(tmp_path):
    """Requests with DoRA and bias adapters interleaved with plain LoRA and base requests in continuous batches give
    generate()'s tokens, which are PEFT's."""
    base = make_base("llama")
    names = ["dora", "lora_only", "plain", "lora_bias"]
    paths = {name: save_vector_adapter(base, tmp_path / name, seed, **MODELS["llama"][1][name])
             for seed, name in enumerate(names)}
    oracles = peft_oracles(base, paths)
    model = MultiLoraModel(base, max_adapters=len(paths), max_rank=8)
    model.load_adapters(paths)
    plan = [(adapter, torch.randint(2, 96, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)).tolist(), 4 + i)
            for i, adapter in enumerate([*names, None, "dora"])]
    expected = []  # generate() of ours and of PEFT agree
    for adapter, prompt, new_tokens in plan:
        kwargs = dict(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        tokens = model.generate(**kwargs, adapter_ids=[adapter])[0, len(prompt):].tolist()
        assert tokens == oracles[adapter].generate(**kwargs)[0, len(prompt):].tolist()
        expected.append(tokens)
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
    assert [list(completion.token_ids) for completion in completions] == expected


def test_dora_on_an_embedding_is_refused_by_name():
    base = tiny_llama()
    embedding = ModuleLora(torch.randn(2, 100), torch.randn(32, 2), magnitude=torch.rand(32) + 0.5)
    weights = AdapterWeights({"model.embed_tokens": embedding}, LoraAdapterConfig(r=2, lora_alpha=2), "memory")
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match=r"linear layers only, not on model\.embed_tokens \(Embedding\)"):
        model.load_adapters({"x": weights})
    assert not model._injection.hooks and not model.adapter_stats["registered"]


def test_a_vector_that_does_not_fit_its_module_is_refused():
    with pytest.raises(ValueError, match=r"magnitude has shape \[16\], expected \[32\]"):
        ModuleLora(torch.randn(2, 32), torch.randn(32, 2), magnitude=torch.rand(16))


def test_a_state_dict_that_changes_weights_under_output_vectors_is_refused(tmp_path):
    """DoRA's scale and a LoRA bias's shift are computed from the base layer's weight and bias at load: a state dict
    that changes them would leave those stale (no longer PEFT's), so it is refused, naming the weight and the
    adapters, and nothing is loaded. The same weights load (a round trip), weights under plain LoRA load, and once
    the adapter is unloaded the change loads too."""
    from helpers import assert_state_unchanged, capture_state

    base = make_base("llama")
    adapters = MODELS["llama"][1]
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"dora": save_vector_adapter(base, tmp_path / "dora", 1, **adapters["dora_rs"]),
                         "plain": save_vector_adapter(base, tmp_path / "plain", 0, **adapters["plain"])})
    state = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    model.load_state_dict(state)  # unchanged: fine
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    changed = {**state, q_proj: state[q_proj] + 0.01}
    before = capture_state(model, *left_padded_batch([4, 3], seed=2)[:1], ["dora", None])
    with pytest.raises(ValueError, match=rf"changes base weights .*: {q_proj} \(adapters \['dora'\]\); unload"):
        model.load_state_dict(changed)
    assert_state_unchanged(model, before)
    assert torch.equal(model.state_dict()[q_proj], state[q_proj])
    no_vectors = "model.layers.0.self_attn.k_proj.weight"  # "plain" targets it, "dora" does not: no vectors there
    model.load_state_dict({**state, no_vectors: state[no_vectors] * 2})
    assert torch.equal(model.state_dict()[no_vectors], state[no_vectors] * 2)
    outer = torch.nn.ModuleDict({"lm": model})  # a parent module's load reaches the same check
    with pytest.raises(ValueError, match=rf"changes base weights .*: {q_proj} \(adapters \['dora'\]\); unload"):
        outer.load_state_dict({f"lm.{key}": tensor for key, tensor in changed.items()})
    assert torch.equal(model.state_dict()[q_proj], state[q_proj])
    outer.load_state_dict({f"lm.{key}": tensor for key, tensor in state.items()})  # its round trip loads
    model.unload_adapter("dora")
    model.load_state_dict(changed)
    assert torch.equal(model.state_dict()[q_proj], changed[q_proj])
