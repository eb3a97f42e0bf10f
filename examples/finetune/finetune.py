"""Fine-tune a LoRA adapter with PEFT and ``transformers.Trainer``, ready to serve with punica_hf.

Input is a JSONL of ``{"prompt": ..., "response": ...}`` lines (``create-finetune-data.py`` writes them). Each
example is ``prompt tokens + response tokens + EOS``; the loss covers only the response and its EOS, so the adapter
learns to answer rather than to repeat prompts. The output folder is a PEFT adapter (``adapter_config.json`` +
``adapter_model.safetensors``) that ``MultiLoraModel.load_adapters`` reads as it is.

    python finetune.py --model meta-llama/Llama-3.2-1B --data gsm8k.jsonl --output adapters/gsm8k --max-steps 500
    python finetune.py --model demo --data tiny.jsonl --output adapters/tiny   # the tiny model punica_hf ships

Runs on a GPU when there is one and on the CPU otherwise; it never reaches the network for anything the model
folder or the Hugging Face cache already holds.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

from punica_hf.formats.jsonl import read_jsonl

# ``--model demo`` picks the byte-level Llama shipped in ``punica_hf/demo/base``.
DEMO_MODEL = "demo"
IGNORE_INDEX = -100  # label value that the causal-LM loss skips
PROMPT_RESPONSE = ("prompt", "response")  # the fields of a line of --data
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersTokenizer:
    """Prompt and response token ids from a transformers tokenizer."""

    def __init__(self, tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token, so the adapter could not learn where an answer ends")
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        # Many causal-LM tokenizers have no pad token; padding is masked out of attention and loss anyway.
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def prompt_ids(self, text: str) -> list[int]:
        # With the tokenizer's special tokens (e.g. BOS), as a prompt is tokenized at serving time.
        return self._tokenizer(text, add_special_tokens=True)["input_ids"]

    def response_ids(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]


class DemoTokenizer:
    """The same interface over ``punica_hf.demo``'s byte-level encoding (BOS, UTF-8 bytes, EOS).

    A prompt is the task input, e.g. ``"lora"``; the demo's prompt format (``"lora="``) is added here, as
    ``punica-hf generate --model demo`` adds it to the prompts it serves.
    """

    def __init__(self) -> None:
        from punica_hf import demo

        self._demo = demo
        self.eos_token_id = demo.EOS_ID
        self.pad_token_id = demo.PAD_ID

    def prompt_ids(self, text: str) -> list[int]:
        return [self._demo.BOS_ID, *self._demo.encode(self._demo.make_prompt(text))]

    def response_ids(self, text: str) -> list[int]:
        return [*self._demo.encode(text), self.eos_token_id]


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU that has it and float32 elsewhere (CPUs train slowly or badly in half)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return DTYPES[name]


def load_model_and_tokenizer(model_name: str, dtype: torch.dtype):
    if model_name == DEMO_MODEL:
        from punica_hf import demo

        return demo.load_base_model(dtype=dtype), DemoTokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype)
    return model, TransformersTokenizer(AutoTokenizer.from_pretrained(model_name))


def read_examples(path: Path) -> list[dict[str, str]]:
    examples = []
    for line_number, record in read_jsonl(path):
        if not all(isinstance(record.get(key), str) for key in PROMPT_RESPONSE):
            raise ValueError(f'{path}:{line_number}: expected {{"prompt": "...", "response": "..."}}')
        examples.append(record)
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def tokenize_examples(examples: list[dict[str, str]], tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """Token ids and labels per example, cut to ``max_length``; labels are ``IGNORE_INDEX`` over the prompt.

    Prompt and response are tokenized apart, so the prompt's tokens are exactly those a served prompt has.
    Examples whose prompt alone fills ``max_length`` have nothing to learn from and are dropped.
    """
    tokenized = []
    for example in examples:
        prompt_ids = tokenizer.prompt_ids(example["prompt"])
        if len(prompt_ids) >= max_length:
            continue
        response_ids = tokenizer.response_ids(example["response"])
        input_ids = (prompt_ids + response_ids)[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
        tokenized.append({"input_ids": input_ids, "labels": labels})
    dropped = len(examples) - len(tokenized)
    if dropped:
        print(f"Dropped {dropped} of {len(examples)} examples whose prompt is {max_length} tokens or longer")
    if not tokenized:
        raise ValueError(f"no example fits in --max-length {max_length}")
    return tokenized


def check_examples_fit(examples: list[dict[str, str]], tokenizer, max_positions: int) -> None:
    """Refuse examples longer than the demo model's positions: it knows single words only (``lora`` -> ``arol``),
    so an example cut to fit would teach it fragments, and the presets' prompts alone are longer than it reads."""
    lengths = [len(tokenizer.prompt_ids(e["prompt"])) + len(tokenizer.response_ids(e["response"])) for e in examples]
    too_long = sum(length > max_positions for length in lengths)
    if too_long:
        raise ValueError(
            f"{too_long} of {len(examples)} examples do not fit the demo model's {max_positions} positions (the "
            f'longest needs {max(lengths)} tokens, one a byte); it takes single words, e.g. {{"prompt": "lora", '
            '"response": "arol"}: the presets are for real models'
        )


class RightPaddingCollator:
    """Batches tokenized examples, padding on the right; padding is masked out of attention and loss."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(example["input_ids"]) for example in batch)

        def padded(key: str, pad_value: int) -> torch.Tensor:
            return torch.tensor([example[key] + [pad_value] * (longest - len(example[key])) for example in batch])

        return {
            "input_ids": padded("input_ids", self.pad_token_id),
            "attention_mask": torch.tensor(
                [[1] * len(example["input_ids"]) + [0] * (longest - len(example["input_ids"])) for example in batch]
            ),
            "labels": padded("labels", IGNORE_INDEX),
        }


def lora_targets(targets: str) -> str | list[str]:
    """``all-linear`` as PEFT's keyword, else the comma-separated module names."""
    return targets if targets == "all-linear" else [name.strip() for name in targets.split(",") if name.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune a LoRA adapter that punica_hf can serve.")
    parser.add_argument("--model", required=True, help=f"Hub id or local folder of a causal LM, or '{DEMO_MODEL}'")
    parser.add_argument("--data", required=True, type=Path, help="JSONL of {\"prompt\", \"response\"} lines")
    parser.add_argument("--output", required=True, type=Path, help="folder to write the PEFT adapter to")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (default: 16)")
    parser.add_argument("--alpha", type=float, default=32, help="LoRA alpha; the update is scaled by alpha / r")
    parser.add_argument(
        "--targets", default="q_proj,v_proj", help="comma-separated module names, or all-linear (default: %(default)s)"
    )
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (default: 0.05)")
    parser.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default: 1)")
    parser.add_argument(
        "--max-steps", type=int, default=-1, help="stop after this many optimizer steps (overrides --epochs)"
    )
    parser.add_argument("--lr", type=float, default=2e-4, help="peak learning rate, decayed linearly (default: 2e-4)")
    parser.add_argument("--batch-size", type=int, default=4, help="examples per step (default: 4)")
    parser.add_argument("--max-length", type=int, default=512, help="cut examples to this many tokens (default: 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto",
        help="dtype of the base weights; auto = bfloat16 on a GPU, else float32",
    )
    args = parser.parse_args(argv)
    for name in ("rank", "batch_size", "max_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not lora_targets(args.targets):
        parser.error("--targets names no module")
    return args


def print_serving_hint(model_name: str, adapter_dir: Path, rank: int) -> None:
    adapter_name = adapter_dir.name
    load_base = (
        "punica_hf.demo.load_base_model()"
        if model_name == DEMO_MODEL
        else f"AutoModelForCausalLM.from_pretrained({model_name!r})"
    )
    adapter_arg = shlex.quote(f"{adapter_name}={adapter_dir}")
    print(
        f"\nSaved the LoRA adapter to {adapter_dir}. Serve it beside other adapters on the same base model, with\n"
        "prompts written as in the training data:\n"
        f"  punica-hf generate --model {shlex.quote(model_name)} --adapter {adapter_arg} \\\n"
        f"      --prompt {shlex.quote(f'{adapter_name}:PROMPT')} --prompt base:PROMPT\n"
        "or from Python:\n"
        f"  model = MultiLoraModel({load_base}, max_adapters=8, max_rank={max(rank, 64)})\n"
        f"  model.load_adapters({{{adapter_name!r}: {str(adapter_dir)!r}}})\n"
        f"  model.generate(input_ids, attention_mask=attention_mask, adapter_ids=[{adapter_name!r}, None, ...])"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype)

    max_length = args.max_length
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and max_length > max_positions:
        print(f"Cutting examples to the model's {max_positions} positions instead of --max-length {max_length}")
        max_length = max_positions
    try:
        examples = read_examples(args.data)
        if args.model == DEMO_MODEL:
            check_examples_fit(examples, tokenizer, max_positions)
        train_dataset = tokenize_examples(examples, tokenizer, max_length)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    set_seed(args.seed)  # before get_peft_model, so that the LoRA A initialisation is reproducible too
    lora_config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=lora_targets(args.targets),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora_config)
    peft_model.print_trainable_parameters()

    on_gpu = torch.cuda.is_available()
    training_args = TrainingArguments(
        # Checkpoints are off (save_strategy="no"), so the Trainer writes nothing here; the adapter goes here below.
        output_dir=str(args.output),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        per_device_train_batch_size=args.batch_size,
        seed=args.seed,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=not on_gpu,
        dataloader_pin_memory=on_gpu,
        remove_unused_columns=False,  # the collator already yields exactly the model's inputs
        label_names=["labels"],
    )
    trainer = Trainer(
        model=peft_model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=RightPaddingCollator(tokenizer.pad_token_id),
    )
    print(f"Training on {len(train_dataset)} examples, {'GPU' if on_gpu else 'CPU'}, {dtype}")
    trainer.train()

    # The embeddings are never trained here; "auto" would look the base model's config up on the Hub to be sure.
    peft_model.save_pretrained(args.output, save_embedding_layers=False)
    print_serving_hint(args.model, args.output, args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
