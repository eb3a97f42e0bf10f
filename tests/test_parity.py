"""Mixed batches equal PEFT row by row: logits and generate(), on five architectures.

For every architecture, four PEFT adapters exercising different LoRA features are loaded side by side into
one MultiLoraModel. Each row of a left-padded ragged batch uses its own adapter (or none); the oracle for a
row is PEFT's PeftModel with that row's adapter active on the same batch, and the untouched base model for
rows without adapter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from punica_hf import MultiLoraModel

VOCAB = 96
ATOL = 2e-5


@dataclass(frozen=True)
class Architecture:
    make_model: callable
    attention_targets: list[str]
    mlp_targets: list[str]
    regex_target: str


def _llama_like(config_cls, model_cls):
    def make():
        config = config_cls(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        )
        return model_cls(config)

    return make


ARCHITECTURES = {
    "llama": Architecture(
        _llama_like(LlamaConfig, LlamaForCausalLM),
        ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"], r".*\.(k_proj|up_proj)",
    ),
    "qwen2": Architecture(
        _llama_like(Qwen2Config, Qwen2ForCausalLM),
        ["q_proj", "v_proj"], ["gate_proj", "down_proj"], r"model\.layers\.1\..*_proj",
    ),
    "gpt2": Architecture(
        lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        ["c_attn", "attn.c_proj"], ["c_fc", "mlp.c_proj"], r".*\.c_(attn|fc)",
    ),
    "phi3": Architecture(
        lambda: Phi3ForCausalLM(
            Phi3Config(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
            )
        ),
        ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"], r".*\.(qkv_proj|down_proj)",
    ),
    "opt": Architecture(
        lambda: OPTForCausalLM(
            OPTConfig(
                vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=1,
            )
        ),
        ["q_proj", "k_proj", "v_proj", "out_proj"], ["fc1", "fc2"], r".*\.(v_proj|fc1)",
    ),
}


def _adapter_configs(arch: Architecture) -> dict[str, LoraConfig]:
    """Four adapters, each exercising other PEFT features: plain, rsLoRA + patterns, layers_to_transform, regex."""
    first_mlp = arch.mlp_targets[0]
    return {
        "attn": LoraConfig(r=4, lora_alpha=8, target_modules=arch.attention_targets),
        "all": LoraConfig(
            r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear",
            rank_pattern={first_mlp: 2}, alpha_pattern={first_mlp: 3.0},
        ),
        "mlp_layer1": LoraConfig(r=6, lora_alpha=12, target_modules=arch.mlp_targets, layers_to_transform=[1]),
        "regex": LoraConfig(r=3, lora_alpha=5, target_modules=arch.regex_target),
    }


@dataclass
class Setup:
    model: MultiLoraModel
    base: torch.nn.Module
    peft: PeftModel
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_adapters: list[str | None]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def setup(request, tmp_path_factory) -> Setup:
    arch = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    base = arch.make_model().eval()
    base.generation_config.eos_token_id = None  # fixed-length generations: rows are compared token by token
    base.generation_config.pad_token_id = 0
    folder = tmp_path_factory.mktemp(request.param)
    paths = {}
    for name, config in _adapter_configs(arch).items():
        config.init_lora_weights = False  # random A and B, so every adapter really changes the outputs
        config.fan_in_fan_out = request.param == "gpt2"
        get_peft_model(copy.deepcopy(base), config).save_pretrained(folder / name)
        paths[name] = folder / name

    peft = PeftModel.from_pretrained(copy.deepcopy(base), paths["attn"], adapter_name="attn").eval()
    for name in list(paths)[1:]:
        peft.load_adapter(paths[name], adapter_name=name)
    untouched_base = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=6, max_rank=8)
    assert model.load_adapters(paths) == {name: slot for slot, name in enumerate(paths)}

    lengths = [7, 4, 9, 9, 2, 6]
    input_ids = torch.randint(2, VOCAB, (len(lengths), max(lengths)))
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):  # left padding, as batched decoder-only generation expects
        attention_mask[row, -length:] = 1
        input_ids[row, :-length] = 0
    row_adapters = ["attn", None, "all", "mlp_layer1", "regex", "attn"]
    return Setup(model, untouched_base, peft, input_ids, attention_mask, row_adapters)


def _oracle(setup: Setup, adapter: str | None):
    """A callable running PEFT with ``adapter`` active, or the untouched base model for None."""
    if adapter is None:
        return setup.base
    setup.peft.set_adapter(adapter)
    return setup.peft


def _rows_by_adapter(setup: Setup) -> dict[str | None, list[int]]:
    rows: dict[str | None, list[int]] = {}
    for row, adapter in enumerate(setup.row_adapters):
        rows.setdefault(adapter, []).append(row)
    return rows


@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(setup):
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    logits = setup.model(**batch, adapter_ids=setup.row_adapters).logits
    base_logits = setup.base(**batch).logits
    real = setup.attention_mask.bool()
    for adapter, rows in _rows_by_adapter(setup).items():
        expected = _oracle(setup, adapter)(**batch).logits
        for row in rows:
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
            if adapter is not None:  # the adapter really changes this row, so equality above means something
                assert (logits[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3


@torch.no_grad()
def test_indices_and_names_are_the_same_mapping(setup):
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    by_name = setup.model(**batch, adapter_ids=setup.row_adapters).logits
    indices = torch.tensor([-1 if a is None else setup.model.adapters[a] for a in setup.row_adapters])
    torch.testing.assert_close(setup.model(**batch, adapter_ids=indices).logits, by_name, atol=0, rtol=0)


GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "greedy_static_cache": dict(do_sample=False, cache_implementation="static"),
    "beam_search": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, top_k=0, temperature=1.3, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
@torch.no_grad()
def test_generate_matches_peft_row_by_row(setup, mode):
    kwargs = dict(GENERATION_MODES[mode], max_new_tokens=6, attention_mask=setup.attention_mask)
    expand = kwargs.get("num_return_sequences", 1)
    torch.manual_seed(1234)
    generated = setup.model.generate(setup.input_ids, adapter_ids=setup.row_adapters, **kwargs)
    for adapter, rows in _rows_by_adapter(setup).items():
        torch.manual_seed(1234)  # same batch shape and seed: sampling draws the same random numbers per row
        expected = _oracle(setup, adapter).generate(setup.input_ids, **kwargs)
        for row in rows:
            out_rows = slice(row * expand, (row + 1) * expand)
            assert torch.equal(generated[out_rows], expected[out_rows]), f"row {row} ({adapter}) differs"
