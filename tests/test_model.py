"""MultiLoraModel is a drop-in for the model it wraps: attributes, modes, dtype moves, the usual kwargs."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import left_padded_batch, make_base_and_adapters
from helpers import save_peft_adapter, tiny_llama
from opaque_kernels import route_to_opaque_kernels
from transformers import CompileConfig

from punica_hf import MultiLoraModel

INPUT_IDS = torch.tensor([[5, 17, 42, 8, 23], [61, 2, 9, 77, 30]])


@pytest.fixture
def wrapped(tmp_path):
    base = tiny_llama()
    untouched = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    model.load_adapters({"qv": save_peft_adapter(untouched, tmp_path / "qv", r=4, target_modules=["q_proj", "v_proj"])})
    return model, untouched


def test_attributes_are_the_wrapped_models(wrapped):
    model, _ = wrapped
    assert model.config is model.model.config
    assert model.generation_config is model.model.generation_config
    assert model.device == model.model.device
    assert model.get_input_embeddings() is model.model.get_input_embeddings()


def test_eval_and_train_reach_the_wrapped_model(wrapped):
    model, _ = wrapped
    assert model.train() is model and model.model.training
    assert model.eval() is model and not model.model.training


@torch.no_grad()
def test_without_adapter_ids_it_is_the_untouched_base_model(wrapped):
    model, untouched = wrapped
    torch.testing.assert_close(model(input_ids=INPUT_IDS).logits, untouched(input_ids=INPUT_IDS).logits, atol=0, rtol=0)
    kwargs = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(INPUT_IDS, **kwargs), untouched.generate(INPUT_IDS, **kwargs))


@torch.no_grad()
def test_usual_kwargs_pass_through(wrapped):
    model, untouched = wrapped
    out = model(input_ids=INPUT_IDS, labels=INPUT_IDS, adapter_ids=[None, None])
    expected = untouched(input_ids=INPUT_IDS, labels=INPUT_IDS)
    torch.testing.assert_close(out.loss, expected.loss)
    assert model(INPUT_IDS, adapter_ids=["qv", None], return_dict=False)[0].shape == (2, 5, 100)


@torch.no_grad()
def test_to_moves_the_lora_pool_with_the_model(wrapped):
    model, untouched = wrapped
    reference = model(input_ids=INPUT_IDS, adapter_ids=["qv", None]).logits
    model.to(torch.float64)
    (tables,) = [pool.tables for pool in model._store.pools.values()]
    assert tables.pool.dtype == torch.float64 and tables.ranks.dtype == torch.int32
    logits = model(input_ids=INPUT_IDS, adapter_ids=["qv", None]).logits
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits.float(), reference, atol=1e-5, rtol=1e-5)
    assert (logits[0] - untouched.double()(input_ids=INPUT_IDS[:1]).logits[0]).abs().max() > 1e-3


@torch.no_grad()
def test_per_token_adapter_ids_equal_per_row_ids_when_rows_are_uniform(wrapped):
    model, _ = wrapped
    per_row = model(input_ids=INPUT_IDS, adapter_ids=torch.tensor([0, -1])).logits
    per_token = torch.tensor([[0] * 5, [-1] * 5])
    torch.testing.assert_close(model(input_ids=INPUT_IDS, adapter_ids=per_token).logits, per_row, atol=0, rtol=0)


@torch.no_grad()
def test_compiled_generate_applies_an_adapter_that_hooks_new_modules(tmp_path):
    """A static-cache generate() compiles the decode step (here on the CPU, through the PyTorch ops, whose graph
    breaks give one compiled frame per module). An adapter loaded after that compile that hooks modules no earlier
    adapter targeted must change the next compiled generate exactly as it changes an eager one."""
    base, paths = make_base_and_adapters("llama", tmp_path)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)
    model.load_adapters({"attn": paths["attn"]})
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers' switch to compile generate() off CUDA (for tests)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6], torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=attention_mask)
    try:
        for adapters in (["attn", None, "attn", None, "attn", "attn"], ["all", "attn", None, "all", "attn", "all"]):
            if "all" in adapters:
                model.load_adapters({"all": paths["all"]})  # hooks gate/up/down, which "attn" left alone
            eager = model.generate(input_ids, adapter_ids=adapters, **kwargs)
            compiled = model.generate(input_ids, adapter_ids=adapters, cache_implementation="static",
                                      compile_config=compile_config, **kwargs)
            assert torch.equal(compiled, eager), adapters
    finally:
        torch._dynamo.reset()




def test_names_of_parameters_buffers_and_modules_are_the_state_dicts(wrapped):
    """One view of names: named_parameters()/named_buffers() give the wrapped model's keys, those of state_dict(),
    alone and inside a parent module; get_parameter takes them; an optimizer over parameters() trains the wrapped
    model's weights (the adapters' pools are no parameters)."""
    model, untouched = wrapped
    state = model.state_dict()
    parameters = dict(model.named_parameters())
    assert list(parameters) == [name for name, _ in untouched.named_parameters()]
    assert set(parameters) <= set(state) and all(state[name].data_ptr() == p.data_ptr() for name, p in parameters.items())
    persistent = {name for name, _ in model.named_buffers()} & set(state)
    assert set(state) == set(parameters) | persistent
    assert all(model.get_parameter(name) is p for name, p in parameters.items())
    assert [p for p in model.parameters()] == list(parameters.values())
    assert next(name for name, m in model.named_modules() if m is model.model.model.layers[0]) == "model.layers.0"

    parent = torch.nn.ModuleDict({"lm": model})
    assert {name for name, _ in parent.named_parameters()} == {f"lm.{name}" for name in parameters}
    assert set(parent.state_dict()) == {f"lm.{name}" for name in state}

    ids = INPUT_IDS[:1]
    with torch.no_grad():
        before = model(ids, adapter_ids=["qv"]).logits
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, adapter_ids=["qv"]).logits.sum().backward()
    optimizer.step()
    with torch.no_grad():
        assert not torch.allclose(model(ids, adapter_ids=["qv"]).logits, before)
