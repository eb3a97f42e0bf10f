"""Build the demo shipped in punica_hf/demo/: a tiny byte-level Llama and one PEFT LoRA adapter per task.

1. Pretrain a ~1M-parameter Llama to copy words (``"lora=lora"``), so that it is a usable base that knows the prompt
   format but none of the tasks.
2. For each task in ``punica_hf.demo.TASKS``, train a LoRA adapter with PEFT on top of the frozen base.
3. Evaluate every model (base and each adapter) on every task with greedy decoding on held-out words, and write the
   table to punica_hf/demo/ACCURACY.json.

Deterministic (fixed seeds, deterministic algorithms) and CPU-only; takes a few minutes on two cores:

    pip install -e .   # or PYTHONPATH=.
    python examples/train_demo_model.py [--output-dir DIR]   # default: punica_hf/demo/
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging

from punica_hf.demo import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TASKS,
    VOCAB_SIZE,
    WORD_ALPHABET,
    demo_dir,
    encode,
    generate_answers,
    is_held_out,
    left_pad,
    make_prompt,
    random_word,
    sample_words,
)

SEED = 0
BATCH_SIZE = 64
PRETRAIN_STEPS = 800
PRETRAIN_LEARNING_RATE = 3e-3
ADAPTER_STEPS = 600
ADAPTER_LEARNING_RATE = 3e-3
WARMUP_STEPS = 50
EVAL_WORDS_PER_TASK = 200
EVAL_SEED = 1234
# Where the adapters' configs say their base lives; a neutral name rather than the path of this machine's checkout.
BASE_MODEL_NAME = "punica_hf/demo/base"
# Pretraining copies words of every kind, so the base is not specialised to the tasks' lowercase words, and so that
# the output rows of upper-case letters are trained: LoRA on the projections cannot teach the model new tokens.
DIGITS = "0123456789"
PRETRAIN_ALPHABETS = (WORD_ALPHABET, WORD_ALPHABET.upper(), DIGITS, WORD_ALPHABET + WORD_ALPHABET.upper() + DIGITS)

BASE_CONFIG = LlamaConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, so the demo also exercises narrower k/v projections
    max_position_embeddings=64,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)
LORA_RANK = 16
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def training_batch(pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Left-padded ``BOS prompt answer EOS`` sequences; the loss covers only the answer and its EOS."""
    sequences, labels = [], []
    for task_input, answer in pairs:
        prompt_ids = [BOS_ID, *encode(make_prompt(task_input))]
        answer_ids = [*encode(answer), EOS_ID]
        sequences.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    return {
        "input_ids": left_pad(sequences, PAD_ID),
        "attention_mask": left_pad([[1] * len(sequence) for sequence in sequences], 0),
        "labels": left_pad(labels, -100),
    }


def train(model, make_pairs, steps: int, learning_rate: float, label: str) -> None:
    """AdamW with a short linear warmup and a linear decay to zero, on fresh batches from ``make_pairs()``."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1, step / WARMUP_STEPS) * (1 - step / steps)
    )
    model.train()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        loss = model(**training_batch(make_pairs())).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            print(f"  {label} step {step}/{steps}  loss {loss.item():.4f}  ({time.perf_counter() - started:.0f} s)")
    model.eval()


def training_words(rng: random.Random, alphabets: tuple[str, ...] = (WORD_ALPHABET,)) -> list[str]:
    """A batch of random words from the training split, each drawn from one of ``alphabets``."""
    words = []
    while len(words) < BATCH_SIZE:
        word = random_word(rng, rng.choice(alphabets))
        if not is_held_out(word):
            words.append(word)
    return words


def load_base(output_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(output_dir / "base", dtype=torch.float32).eval()


def pretrain_base(output_dir: Path) -> None:
    print(f"Pretraining the base model to copy words ({PRETRAIN_STEPS} steps)")
    model = LlamaForCausalLM(BASE_CONFIG)
    print(f"  {sum(parameter.numel() for parameter in model.parameters()):,} parameters")
    rng = random.Random(SEED)
    train(
        model,
        lambda: [(word, word) for word in training_words(rng, PRETRAIN_ALPHABETS)],
        PRETRAIN_STEPS,
        PRETRAIN_LEARNING_RATE,
        "base",
    )
    model.save_pretrained(output_dir / "base")


def train_adapter(output_dir: Path, task_name: str, seed: int) -> None:
    print(f"Training the '{task_name}' adapter ({ADAPTER_STEPS} steps)")
    torch.manual_seed(seed)
    lora_config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        lora_dropout=0.0,
        target_modules=LORA_TARGET_MODULES,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base(output_dir), lora_config)
    answer = TASKS[task_name].answer
    rng = random.Random(seed)
    train(
        model,
        lambda: [(word, answer(word)) for word in training_words(rng)],
        ADAPTER_STEPS,
        ADAPTER_LEARNING_RATE,
        task_name,
    )
    saved_config = model.peft_config["default"]
    saved_config.base_model_name_or_path = BASE_MODEL_NAME
    saved_config.target_modules = sorted(saved_config.target_modules)  # PEFT keeps a set: fix the order in the file
    adapter_dir = output_dir / "adapters" / task_name
    model.save_pretrained(adapter_dir, save_embedding_layers=False)
    (adapter_dir / "README.md").unlink()  # PEFT's blank model-card template; the package does not ship it


def accuracy(model, task_name: str, words: list[str]) -> float:
    answer = TASKS[task_name].answer
    predictions = generate_answers(model, words)
    return sum(prediction == answer(word) for prediction, word in zip(predictions, words)) / len(words)


def evaluate(output_dir: Path) -> dict:
    """Exact-match accuracy of the base and of each adapter on every task, loaded back from the saved files."""
    eval_words = sample_words(EVAL_WORDS_PER_TASK, EVAL_SEED, held_out=True)
    models = {"base": load_base(output_dir)}
    for task_name in TASKS:
        models[task_name] = PeftModel.from_pretrained(load_base(output_dir), output_dir / "adapters" / task_name).eval()
    table = {
        model_name: {task_name: accuracy(model, task_name, eval_words) for task_name in TASKS}
        for model_name, model in models.items()
    }
    example_words = TASKS["reverse"].examples  # every task has the same example words
    examples = {
        model_name: dict(zip(example_words, generate_answers(model, example_words)))
        for model_name, model in models.items()
    }
    return {"held_out_words_per_task": len(eval_words), "eval_seed": EVAL_SEED, "accuracy": table, "examples": examples}


def print_table(report: dict) -> None:
    print(f"\nExact-match accuracy, greedy, {report['held_out_words_per_task']} held-out words per task")
    print(f"{'model':<10}" + "".join(f"{task_name:>10}" for task_name in TASKS))
    for model_name, row in report["accuracy"].items():
        print(f"{model_name:<10}" + "".join(f"{row[task_name]:>10.1%}" for task_name in TASKS))
    print("\nAnswers on the example words:")
    for model_name, answers in report["examples"].items():
        print(f"  {model_name:<10}" + "  ".join(f"{word}={answer}" for word, answer in answers.items()))


def main(output_dir: Path) -> None:
    started = time.perf_counter()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    transformers_logging.disable_progress_bar()
    pretrain_base(output_dir)
    for task_index, task_name in enumerate(TASKS):
        train_adapter(output_dir, task_name, seed=SEED + 1 + task_index)
    report = evaluate(output_dir)
    print_table(report)
    (output_dir / "ACCURACY.json").write_text(json.dumps(report, indent=2) + "\n")
    for path in output_dir.rglob("*.safetensors"):
        path.chmod(0o644)  # they are written owner-only; installed package data must be readable by everyone
    print(f"\nWrote {output_dir} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=demo_dir())
    main(parser.parse_args().output_dir)
