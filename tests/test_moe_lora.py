"""LoRA on MoE experts (PEFT ``target_parameters`` on fused expert weights) equals PEFT row by row.

A tiny random Qwen3-MoE (4 experts, 2 per token) with PEFT adapters saved by PEFT: one on both fused expert
parameters and q_proj (with rank and alpha patterns on the parameters), one on down_proj alone, and a plain
attention adapter. Each row of a mixed batch uses its own adapter (or none); the oracle for a row is PeftModel with
that row's adapter alone, or the untouched base model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from architectures import left_padded_batch
from helpers import save_peft_adapter
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    CompileConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from punica_hf import MultiLoraModel
from punica_hf.formats import convert_adapter, load_converted
from punica_hf.moe_layer import EXPERT_PARAMETERS
from punica_hf.serving import Engine, EngineConfig, SamplingParams

ATOL = 2e-5
ROW_ADAPTERS = ["experts", None, "attn", "down_only", "experts", "attn"]


def tiny_qwen3_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every request runs to its max_new_tokens
    return model


# Other architectures with transformers' fused experts: 4 experts, 2 per token, hidden 32, expert width 16.
OTHER_MOE = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
    )),
}


def save_moe_adapters(base, root: Path) -> dict[str, Path]:
    return {
        "experts": save_peft_adapter(
            base, root / "experts", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
            rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 3},
        ),
        "down_only": save_peft_adapter(
            base, root / "down_only", seed=2, r=8, lora_alpha=16, use_rslora=True, target_modules=[],
            target_parameters=["mlp.experts.down_proj"],
        ),
        "attn": save_peft_adapter(base, root / "attn", seed=3, r=4, target_modules=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path_factory.mktemp("moe"))
    untouched = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    return model, untouched, paths


def oracle(untouched, paths, adapter):
    if adapter is None:
        return untouched
    return PeftModel.from_pretrained(copy.deepcopy(untouched), paths[adapter]).eval()


def test_adapter_on_experts_changes_them_and_plain_adapters_leave_them_unhooked(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    experts = [m for name, m in base.named_modules() if name.endswith("mlp.experts")]
    model = MultiLoraModel(base, max_adapters=3, max_rank=8)
    model.load_adapters({"attn": paths["attn"]})
    assert not any("forward" in m.__dict__ for m in experts)  # plain LoRA: the experts run as they were
    model.load_adapters({"down_only": paths["down_only"]})
    assert all("forward" in m.__dict__ for m in experts)
    model.unwrap()
    assert not any("forward" in m.__dict__ for m in experts)  # the experts module is given back untouched


@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(moe):
    model, untouched, paths = moe
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    logits = model(**batch, adapter_ids=ROW_ADAPTERS).logits
    base_logits = untouched(**batch).logits
    real = attention_mask.bool()
    for adapter in set(ROW_ADAPTERS):
        expected = oracle(untouched, paths, adapter)(**batch).logits
        for row in [i for i, a in enumerate(ROW_ADAPTERS) if a == adapter]:
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
            if adapter is not None:
                assert (logits[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3


def test_a_forward_with_gradients_gives_the_experts_weights_pefts_gradients(tmp_path):
    """A forward with gradients on (as on linear layers) runs the experts' LoRA too, and backpropagates into the
    experts' base weights what PEFT's does."""
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    peft = oracle(copy.deepcopy(base), paths, "experts")
    model = MultiLoraModel(base, max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    ours = model.model.model.layers[0].mlp.experts
    theirs = peft.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer  # PEFT's wrapped experts
    for parameter in peft.parameters():
        parameter.requires_grad_(False)
    for name in EXPERT_PARAMETERS:
        getattr(theirs, name).requires_grad_(True)
    input_ids = torch.tensor([[5, 9, 13, 2, 7, 41]])
    model(input_ids, adapter_ids=["experts"]).logits.square().sum().backward()
    peft(input_ids).logits.square().sum().backward()
    for name in EXPERT_PARAMETERS:
        expected = getattr(theirs, name).grad
        assert expected.abs().max() > 1e-3, name
        torch.testing.assert_close(getattr(ours, name).grad, expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_generate_matches_peft_row_by_row(moe):
    model, untouched, paths = moe
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    kwargs = dict(do_sample=False, max_new_tokens=6, attention_mask=attention_mask, pad_token_id=0)
    generated = model.generate(input_ids, adapter_ids=ROW_ADAPTERS, **kwargs)
    for adapter in set(ROW_ADAPTERS):
        expected = oracle(untouched, paths, adapter).generate(input_ids, **kwargs)
        for row in [i for i, a in enumerate(ROW_ADAPTERS) if a == adapter]:
            assert torch.equal(generated[row], expected[row]), f"row {row} ({adapter}) differs"


@torch.no_grad()
def test_more_adapters_than_slots(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    paths["experts_2"] = save_peft_adapter(
        base, tmp_path / "experts_2", seed=4, r=2, target_modules=[], target_parameters=["experts.gate_up_proj"]
    )
    untouched = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    input_ids, attention_mask = left_padded_batch([5, 8, 3])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    real = attention_mask.bool()
    for pair in (["experts", "experts_2"], ["down_only", "attn"], ["experts_2", "down_only"], ["experts", "attn"]):
        rows = [pair[0], pair[1], None]
        logits = model(**batch, adapter_ids=rows).logits
        for row, adapter in enumerate(rows):
            expected = oracle(untouched, paths, adapter)(**batch).logits
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
    assert model.adapter_stats["evictions"] > 0


def test_engine_gives_the_tokens_of_generate(moe):
    model, _, _ = moe
    plan = [("experts", [5, 9, 13, 2], 6), ("attn", [7, 3, 3], 4), (None, [8, 1, 4, 4, 6], 5),
            ("down_only", [11, 12], 7), ("experts", [40, 41, 42, 43, 44, 45], 3)]
    expected = []
    with torch.no_grad():
        for adapter, prompt, n in plan:
            output = model.generate(torch.tensor([prompt]), adapter_ids=[adapter], max_new_tokens=n, do_sample=False,
                                    pad_token_id=0)
            expected.append(output[0, len(prompt):].tolist())
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected


def test_unsupported_experts_layouts_and_settings_are_refused_by_name(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    base.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"experts of model\.layers\.1\.mlp\.experts .*expert biases"):
        model.load_adapters({"down_only": paths["down_only"]})
    assert model.adapters == {}
    router = save_peft_adapter(base, tmp_path / "router", r=2, target_modules=[], target_parameters=["mlp.gate.weight"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight of shape \[4, 32\].*stacked expert"):
        model.load_adapters({"router": router})
    assert model.adapters == {}
    with pytest.raises(ValueError, match="max_rank=1"):
        MultiLoraModel(tiny_qwen3_moe(), max_adapters=2, max_rank=1).load_adapters({"e": paths["experts"]})


@torch.no_grad()
def test_a_converted_moe_adapter_gives_its_peft_folders_logits(moe, tmp_path):
    model, untouched, paths = moe
    input_ids, attention_mask = left_padded_batch([6, 3, 8])
    rows = ["experts", "down_only", None]
    for name in ["experts", "down_only"]:
        model.load_adapters({f"{name}-converted": convert_adapter(paths[name], tmp_path / f"{name}.safetensors")})
    try:
        folder = model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
        converted = model(input_ids, attention_mask=attention_mask,
                          adapter_ids=[None if a is None else f"{a}-converted" for a in rows]).logits
        torch.testing.assert_close(converted, folder, atol=0, rtol=0)
    finally:
        for name in ["experts", "down_only"]:
            model.unload_adapter(f"{name}-converted")


def test_a_converted_moe_file_whose_tensors_disagree_with_its_metadata_is_refused(moe, tmp_path):
    _, _, paths = moe
    path = convert_adapter(paths["experts"], tmp_path / "experts.safetensors")
    with safe_open(path, framework="pt") as file:
        metadata, tensors = file.metadata(), {key: file.get_tensor(key) for key in file.keys()}
    shapes = json.loads(metadata["parameters"])
    key = next(iter(shapes))
    wrong = dict(metadata, parameters=json.dumps({**shapes, key: [shapes[key][0] + 1, *shapes[key][1:]]}))
    save_file(tensors, tmp_path / "wrong.safetensors", metadata=wrong)
    with pytest.raises(ValueError, match=f"parameter {key} has lora_a"):
        load_converted(tmp_path / "wrong.safetensors")
    missing = {k: v for k, v in tensors.items() if not k.endswith(".parameter_lora_b")}
    save_file(missing, tmp_path / "missing.safetensors", metadata=metadata)
    with pytest.raises(ValueError, match="lacks its .parameter_lora_b"):
        load_converted(tmp_path / "missing.safetensors")


@torch.no_grad()
def test_compiled_generate_runs_the_experts_eagerly_with_the_same_tokens(moe):
    model, _, _ = moe
    input_ids, attention_mask = left_padded_batch([6, 3, 8])
    rows = ["experts", "down_only", None]
    kwargs = dict(do_sample=False, max_new_tokens=5, attention_mask=attention_mask, pad_token_id=0)
    eager = model.generate(input_ids, adapter_ids=rows, **kwargs)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers' switch to compile generate() off CUDA (for tests)
    torch._dynamo.reset()
    compiled = model.generate(input_ids, adapter_ids=rows, cache_implementation="static",
                              compile_config=compile_config, **kwargs)
    assert torch.equal(compiled, eager)


def test_lora_on_another_stacked_parameter_of_an_experts_module_is_refused(tmp_path):
    base = tiny_qwen3_moe()
    for layer in base.model.layers:  # a third stacked parameter the experts' forward does not use
        layer.mlp.experts.extra_proj = torch.nn.Parameter(torch.randn(4, 8, 32))
    path = save_peft_adapter(base, tmp_path / "extra", r=2, target_modules=[], target_parameters=["experts.extra_proj"])
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match=r"experts of model\.layers\.0\.mlp\.experts .*gate_up_proj and down_proj only"):
        model.load_adapters({"extra": path})
    assert model.adapters == {}


@pytest.mark.parametrize("arch", sorted(OTHER_MOE))
@torch.no_grad()
def test_other_architectures_mixed_batch_logits_match_peft(arch, tmp_path):
    torch.manual_seed(0)
    base = OTHER_MOE[arch]().eval()
    paths = save_moe_adapters(base, tmp_path)
    untouched = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    logits = model(**batch, adapter_ids=ROW_ADAPTERS).logits
    real = attention_mask.bool()
    for adapter in set(ROW_ADAPTERS):
        expected = oracle(untouched, paths, adapter)(**batch).logits
        for row in [i for i, a in enumerate(ROW_ADAPTERS) if a == adapter]:
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)


def test_moe_adapters_are_refused_under_tensor_parallelism(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    # As a split made by transformers' tensor parallelism looks to the injection (see tensor_parallel.LinearSplit)
    split = SimpleNamespace(problem="split for this test", in_features=32, out_features=32, style="row")
    model._injection.splits = {"model.layers.0.self_attn.q_proj": split}
    with pytest.raises(ValueError, match=r"LoRA on MoE experts \(model\.layers\.0\.mlp\.experts\) is not supported "
                                         r"under tensor parallelism"):
        model.load_adapters({"down_only": paths["down_only"]})
    assert model.adapters == {}


def test_the_engine_leaves_cuda_graphs_off_while_an_moe_adapter_is_loaded(moe, tmp_path):
    from punica_hf.serving import attention

    model, _, paths = moe
    plain = MultiLoraModel(tiny_qwen3_moe(), max_adapters=2, max_rank=8)
    plain.load_adapters({"attn": paths["attn"]})
    for wrapped, graphable in ((model, False), (plain, True)):
        assert wrapped.graphable is graphable
        engine = Engine(wrapped, config=EngineConfig(max_running=4))
        engine.attention = attention.choose(wrapped.model)  # as start() sets it
        # as on a GPU with the default (transformers decides: None) or off
        assert engine._cb_config(torch.device("cuda")).use_cuda_graph is (None if graphable else False)
