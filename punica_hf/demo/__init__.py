"""The packaged demo: a tiny byte-level Llama plus LoRA adapters that each do a different job on the same input.

Every prompt is a lowercase word followed by "=", e.g. ``"lora="``. The base model was pretrained to copy the word
(``"lora=lora"``); each adapter was trained with PEFT to answer its own task instead (``reverse`` -> ``"arol"``,
``upper`` -> ``"LORA"``, ``sort`` -> ``"alor"``). Nothing in the prompt says which task is meant, so a batch whose rows
use different adapters shows at a glance that each row got its own adapter.

``examples/train_demo_model.py`` builds the files under this folder; it imports the tokenizer, prompt format and data
split from here so that they live in one place.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Byte-level vocabulary: ids 0-255 are UTF-8 bytes, then three special tokens.
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 259

WORD_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
MIN_WORD_LENGTH = 3
MAX_WORD_LENGTH = 8
# Every task's answer is as long as its word, plus the EOS token.
MAX_ANSWER_TOKENS = MAX_WORD_LENGTH + 1


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (no BOS/EOS added)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int] | torch.Tensor) -> str:
    """Text of ``ids`` up to the first EOS; pad and BOS tokens are skipped."""
    text_bytes = bytearray()
    for token_id in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
        if token_id == EOS_ID:
            break
        if token_id < 256:
            text_bytes.append(token_id)
    return text_bytes.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Task:
    description: str
    examples: tuple[str, ...]
    answer: Callable[[str], str]


TASKS: dict[str, Task] = {
    "reverse": Task("reverse the word", ("punica", "lora", "adapter"), lambda word: word[::-1]),
    "upper": Task("upper-case the word", ("punica", "lora", "adapter"), str.upper),
    "sort": Task("sort the letters", ("punica", "lora", "adapter"), lambda word: "".join(sorted(word))),
}


def make_prompt(task_input: str) -> str:
    """The prompt for one input; the model's answer follows the "="."""
    return f"{task_input}="


def is_held_out(word: str) -> bool:
    """Whether ``word`` belongs to the evaluation split (about 1 word in 8), which training never sees.

    The split is a property of the word itself, so tests can draw fresh held-out words with any seed.
    """
    return zlib.crc32(word.encode("utf-8")) % 8 == 0


def random_word(rng: random.Random, alphabet: str = WORD_ALPHABET) -> str:
    length = rng.randint(MIN_WORD_LENGTH, MAX_WORD_LENGTH)
    return "".join(rng.choice(alphabet) for _ in range(length))


def sample_words(count: int, seed: int, held_out: bool) -> list[str]:
    """``count`` distinct random words from the held-out split (or from the training split)."""
    rng = random.Random(seed)
    words: dict[str, None] = {}  # insertion-ordered set, so the result is deterministic
    while len(words) < count:
        word = random_word(rng)
        if is_held_out(word) == held_out:
            words[word] = None
    return list(words)


def left_pad(sequences: Sequence[Sequence[int]], pad_value: int) -> torch.Tensor:
    """Stack ``sequences`` into one ``[len(sequences), longest]`` tensor, padding on the left."""
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor([[pad_value] * (longest - len(sequence)) + list(sequence) for sequence in sequences])


def batch_prompts(task_inputs: Sequence[str], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of the prompts for ``task_inputs``, BOS first, left-padded for ``generate``."""
    prompts = [[BOS_ID, *encode(make_prompt(task_input))] for task_input in task_inputs]
    input_ids = left_pad(prompts, PAD_ID)
    attention_mask = left_pad([[1] * len(prompt) for prompt in prompts], 0)
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def generate_answers(model, task_inputs: Sequence[str], **generate_kwargs) -> list[str]:
    """Greedy answers of ``model`` (anything with HF ``generate``) for ``task_inputs``.

    Extra keyword arguments go to ``generate``, e.g. ``adapter_ids`` for a ``MultiLoraModel``.
    """
    input_ids, attention_mask = batch_prompts(task_inputs, device=model.device)
    output_ids = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=MAX_ANSWER_TOKENS,
        do_sample=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        **generate_kwargs,
    )
    return [decode(row) for row in output_ids[:, input_ids.shape[1]:]]


def demo_dir() -> Path:
    return Path(__file__).resolve().parent


def base_model_path() -> Path:
    return demo_dir() / "base"


def adapter_paths() -> dict[str, Path]:
    """PEFT folder of each task's adapter, by task name."""
    return {task_name: demo_dir() / "adapters" / task_name for task_name in TASKS}


def load_base_model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The packaged base model (a ``LlamaForCausalLM``) in eval mode."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_model_path(), dtype=dtype)
    return model.to(device).eval()
