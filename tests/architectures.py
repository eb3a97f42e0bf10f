"""Tiny random models of five architectures and four PEFT adapters each, for parity tests on CPU and GPU."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
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

VOCAB = 96
@dataclass(frozen=True)
class Architecture:
    make_model: Callable[[], torch.nn.Module]
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


def make_base_and_adapters(name: str, folder: Path) -> tuple[torch.nn.Module, dict[str, Path]]:
    """A seeded random base model of architecture ``name`` and its four adapters saved with PEFT in ``folder``."""
    arch = ARCHITECTURES[name]
    torch.manual_seed(0)
    base = arch.make_model().eval()
    base.generation_config.eos_token_id = None  # fixed-length generations: rows are compared token by token
    base.generation_config.pad_token_id = 0
    paths = {}
    for adapter, config in _adapter_configs(arch).items():
        config.init_lora_weights = False  # random A and B, so every adapter really changes the outputs
        config.fan_in_fan_out = name == "gpt2"
        get_peft_model(copy.deepcopy(base), config).save_pretrained(folder / adapter)
        paths[adapter] = folder / adapter
    return base, paths


def left_padded_batch(lengths: list[int], generator: torch.Generator | None = None):
    """Random prompts of the given lengths, left-padded with token 0: ``(input_ids, attention_mask)``."""
    input_ids = torch.randint(2, VOCAB, (len(lengths), max(lengths)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, -length:] = 1
        input_ids[row, :-length] = 0
    return input_ids, attention_mask
