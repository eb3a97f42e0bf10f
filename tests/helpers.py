"""Plain helpers shared by the test modules (``from helpers import tiny_llama, save_peft_adapter``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_LLAMA = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama(seed: int = 0, **config_overrides) -> LlamaForCausalLM:
    """A tiny random Llama (vocab 100, hidden 32, 2 layers, GQA 4/2 heads) in eval mode, same weights per seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config_overrides})).eval()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token rows of any lengths, each padded on the left with id 0."""
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(rows):
        input_ids[row, width - len(tokens) :] = torch.tensor(tokens)
        attention_mask[row, width - len(tokens) :] = 1
    return input_ids, attention_mask


def save_peft_adapter(
    base: torch.nn.Module,
    path: str | Path,
    *,
    seed: int = 0,
    save_kwargs: dict | None = None,
    **lora_config_kwargs,
) -> Path:
    """Save a PEFT LoRA adapter with random (non-zero) A and B for ``base`` into ``path``; ``base`` is untouched.

    ``lora_config_kwargs`` go to ``LoraConfig`` (``init_lora_weights=False`` is always set); ``seed`` picks the
    random factors, so adapters saved with different seeds differ; ``save_kwargs`` go to ``save_pretrained``.
    Returns ``path``.
    """
    path = Path(path)
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_config_kwargs))
    peft_model.save_pretrained(path, **(save_kwargs or {}))
    return path


def save_word_level_model(folder: Path) -> tuple[Path, dict[str, Path]]:
    """``(model folder, {name: PEFT folder})`` under ``folder``: a tiny Llama saved with a word-level tokenizer
    ("w2".."w99", EOS "</s>" = 1, no pad token, a chat template "w7 TEXT w8"), as a Hub model would be, and one
    adapter "a"."""
    model = tiny_llama()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(folder / "model")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 100)}}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}"
    tokenizer.save_pretrained(folder / "model")
    adapter = save_peft_adapter(model, folder / "adapter", r=4, target_modules=["q_proj", "v_proj"])
    return folder / "model", {"a": adapter}


def save_attn_and_mlp_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    """Two adapters of ``base`` under ``root``: "attn" (r=4 on q, v, o) and "mlp" (r=8 on gate, down)."""
    return {
        "attn": save_peft_adapter(base, root / "attn", r=4, target_modules=["q_proj", "v_proj", "o_proj"], seed=1),
        "mlp": save_peft_adapter(base, root / "mlp", r=8, target_modules=["gate_proj", "down_proj"], seed=2),
    }


@dataclass
class ModelState:
    """What a refused call must leave alone in a ``MultiLoraModel`` (see ``capture_state``)."""

    input_ids: torch.Tensor
    adapter_ids: list
    adapters: dict[str, int]
    modules: list[tuple[str, type]]
    buffers: dict[str, torch.Tensor]
    logits: torch.Tensor


def lora_tensors(model) -> dict[str, torch.Tensor]:
    """Copies of a ``MultiLoraModel``'s LoRA state: each device's slot tables and free extents, and each resident
    adapter's chunk of the pool (the rest of a pool is unwritten memory)."""
    tensors = {}
    for device, pool in model._store.pools.items():
        tables = pool.tables
        for name in ("a_offsets", "b_offsets", "ranks"):
            tensors[f"{device}.{name}"] = getattr(tables, name).clone()
        tensors[f"{device}.free"] = torch.tensor(pool.allocator._free)
    for adapter in model._store._resident.values():
        for device, start in adapter.chunk_starts.items():
            size = adapter.layouts[device].size
            chunk = model._store.pools[device].tables.pool[start : start + size]
            tensors[f"{device}.{adapter.name}.slot{adapter.slot}"] = chunk.clone()
    return tensors


def capture_state(model, input_ids: torch.Tensor, adapter_ids: list) -> ModelState:
    """The adapter table, module tree (names and types), every buffer and the LoRA pools and tables, and the logits of
    ``input_ids`` run with ``adapter_ids`` (a mixed batch) of a ``MultiLoraModel``."""
    with torch.no_grad():
        logits = model(input_ids, adapter_ids=adapter_ids).logits
    return ModelState(
        input_ids=input_ids,
        adapter_ids=list(adapter_ids),
        adapters=model.adapters,
        modules=[(name, type(module)) for name, module in model.model.named_modules()],
        buffers={
            **{name: buffer.detach().clone() for name, buffer in model.model.named_buffers()},
            **lora_tensors(model),
        },
        logits=logits,
    )


def assert_state_unchanged(model, before: ModelState) -> None:
    after = capture_state(model, before.input_ids, before.adapter_ids)
    assert after.adapters == before.adapters
    assert after.modules == before.modules
    assert after.buffers.keys() == before.buffers.keys()
    for name, tensor in before.buffers.items():
        assert torch.equal(after.buffers[name], tensor), f"buffer {name} changed"
    assert torch.equal(after.logits, before.logits)


@dataclass
class PeftOracleSetup:
    """A ``MultiLoraModel`` with adapters beside PEFT's model holding the same ones, and the bare base model."""

    model: object  # MultiLoraModel
    base: torch.nn.Module
    peft: object  # PeftModel
    paths: dict[str, Path]

    def oracle(self, adapter: str | None):
        """The model PEFT computes ``adapter``'s rows with (the base model for None)."""
        if adapter is None:
            return self.base
        self.peft.set_adapter(adapter)
        return self.peft

    def mixed_logits(self, input_ids, attention_mask, rows, atol: float):
        """The mixed batch's logits, checked equal to PEFT's one adapter at a time on every real position; returns
        (logits, the base model's logits, the real positions' mask)."""
        logits = self.model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
        base_logits = self.base(input_ids, attention_mask=attention_mask).logits
        real = attention_mask.bool()
        for row, adapter in enumerate(rows):
            expected = self.oracle(adapter)(input_ids, attention_mask=attention_mask).logits
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=atol, rtol=0)
        return logits, base_logits, real
