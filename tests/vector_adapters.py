"""PEFT adapters with per-output-row vectors (DoRA, LoRA bias, bias="lora_only" / "all") for tiny models with
biases, saved by PEFT itself, for the CPU and GPU parity tests.

PEFT starts the vectors where they change nothing (DoRA's magnitude at the weight norm, an adapter's base-layer
biases at the base model's), so every vector is set to random values before saving: each adapter really uses them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

LLAMA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LLAMA_MLP = ["gate_proj", "up_proj", "down_proj"]

# name -> (tiny base model, {adapter: LoraConfig kwargs}); None rows in batches are the base model
MODELS = {
    "llama": (
        lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, mlp_bias=True,
        )),
        {
            "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=LLAMA_ATTENTION + LLAMA_MLP),
            "dora_rs": dict(r=2, lora_alpha=3, use_rslora=True, use_dora=True, target_modules=["q_proj", "v_proj"]),
            "lora_bias": dict(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj", "up_proj"]),
            "lora_only": dict(r=4, lora_alpha=8, bias="lora_only", target_modules=["k_proj", "o_proj", "down_proj"]),
            "bias_all": dict(r=3, lora_alpha=6, bias="all", target_modules=["v_proj", "gate_proj"]),
            "dora_bias": dict(r=2, lora_alpha=4, use_dora=True, bias="lora_only",
                              target_modules=["q_proj", "down_proj"]),
            "plain": dict(r=4, lora_alpha=8, target_modules=LLAMA_ATTENTION),
        },
    ),
    "gpt2": (  # Conv1D layers: weights stored [in, out]
        lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        {
            "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["c_attn", "c_proj", "c_fc"]),
            "lora_bias": dict(r=4, lora_alpha=8, lora_bias=True, target_modules=["c_attn", "c_fc"]),
            "lora_only": dict(r=4, lora_alpha=8, bias="lora_only", target_modules=["c_attn", "mlp.c_proj"]),
            "plain": dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
        },
    ),
}


def make_base(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    base = MODELS[name][0]().to(dtype).eval()
    base.generation_config.eos_token_id = None  # fixed-length generations: rows are compared token by token
    base.generation_config.pad_token_id = 0
    return base


def save_vector_adapter(base: torch.nn.Module, path: Path, seed: int, **config) -> Path:
    """A PEFT adapter of ``base`` with random factors and random vectors, saved by PEFT into ``path``."""
    torch.manual_seed(seed)
    config.setdefault("fan_in_fan_out", isinstance(base, GPT2LMHeadModel))
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_magnitude_vector" in name or name.endswith(("lora_B.default.bias", "base_layer.bias")):
                parameter.mul_(1 + 0.5 * torch.randn_like(parameter)).add_(0.1 * torch.randn_like(parameter))
    peft_model.save_pretrained(path)
    return path


def save_adapters(name: str, base: torch.nn.Module, folder: Path) -> dict[str, Path]:
    return {
        adapter: save_vector_adapter(base, folder / adapter, seed, **config)
        for seed, (adapter, config) in enumerate(MODELS[name][1].items())
    }


def peft_oracles(base: torch.nn.Module, paths: dict[str, Path]) -> dict[str | None, torch.nn.Module]:
    """One PeftModel per adapter (a bias="lora_only" adapter changes its PeftModel's base biases), and the base."""
    oracles = {name: PeftModel.from_pretrained(copy.deepcopy(base), path).eval() for name, path in paths.items()}
    return {**oracles, None: copy.deepcopy(base)}


def row_lengths(count: int) -> list[int]:
    """``count`` prompt lengths from 2 to 9, varied, for ragged batches."""
    return [(3 + 5 * row) % 8 + 2 for row in range(count)]


def left_padded_batch(lengths: list[int], seed: int = 0):
    """Random prompts of the given lengths, left-padded with token 0: ``(input_ids, attention_mask)``."""
    input_ids = torch.randint(2, 96, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, -length:] = 1
        input_ids[row, :-length] = 0
    return input_ids, attention_mask
