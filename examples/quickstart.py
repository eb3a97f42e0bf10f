"""Quickstart: three LoRA adapters and the base model in one batch, on the CPU, in a few seconds.

Offline and self-contained: it builds a tiny random Llama and makes PEFT adapters for it. With a real model,
replace the first part with ``AutoModelForCausalLM.from_pretrained(...)`` and your adapters' folders or Hub ids.
"""

import copy
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from punica_hf import MultiLoraModel


def make_adapters(base: torch.nn.Module, folder: Path) -> dict[str, Path]:
    """Save three PEFT adapters with random weights (rank and targets differ, as they may in real life)."""
    configs = {
        "math": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "sql": LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"),
        "chat": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    }
    paths = {}
    for name, config in configs.items():
        config.init_lora_weights = False  # random B, so each adapter visibly changes the output
        get_peft_model(copy.deepcopy(base), config).save_pretrained(folder / name)
        paths[name] = folder / name
    return paths


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )
    base = LlamaForCausalLM(config).eval()

    with tempfile.TemporaryDirectory() as folder:
        paths = make_adapters(base, Path(folder))
        model = MultiLoraModel(base, max_adapters=8, max_rank=64)
        print("loaded:", model.load_adapters(paths))

        input_ids = torch.randint(1, 256, (4, 6))
        attention_mask = torch.ones_like(input_ids)
        input_ids[3, :2], attention_mask[3, :2] = 0, 0  # a shorter, left-padded prompt
        adapter_ids = ["math", "sql", None, "chat"]  # or torch.tensor([0, 1, -1, 2])

        logits = model(input_ids=input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids).logits
        print("logits:", tuple(logits.shape))
        out = model.generate(
            input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids, max_new_tokens=8, do_sample=False
        )
        for adapter, tokens in zip(adapter_ids, out[:, input_ids.shape[1] :].tolist()):
            print(f"{adapter or 'base':>5}: {tokens}")

        model.unload_adapter("chat")
        print("after unload:", model.adapters)


if __name__ == "__main__":
    main()
