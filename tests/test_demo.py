"""The packaged demo (punica_hf/demo): its files, its prompt format, and that each adapter really does its own task.

The answers are checked on fresh held-out words (never seen in training), drawn with a seed the training script's
own evaluation does not use.
"""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from punica_hf import MultiLoraModel, demo

HELD_OUT_WORDS = demo.sample_words(20, seed=20261202, held_out=True)
SHIPPED_SIZE_LIMIT_BYTES = 6_000_000


def accuracy(answers: list[str], task_name: str, words: list[str]) -> float:
    correct = [answer == demo.TASKS[task_name].answer(word) for answer, word in zip(answers, words)]
    return sum(correct) / len(correct)


@pytest.fixture(scope="module")
def peft_answers() -> dict[str, list[str]]:
    """Answers on ``HELD_OUT_WORDS`` of plain PEFT, one adapter at a time, and of the base model (key "base")."""
    answers = {"base": demo.generate_answers(demo.load_base_model(), HELD_OUT_WORDS)}
    for task_name, path in demo.adapter_paths().items():
        model = PeftModel.from_pretrained(demo.load_base_model(), path).eval()
        answers[task_name] = demo.generate_answers(model, HELD_OUT_WORDS)
    return answers


def test_packaged_files_exist_and_are_small():
    shipped = [demo.base_model_path() / "config.json", demo.base_model_path() / "model.safetensors"]
    for path in demo.adapter_paths().values():
        shipped += [path / "adapter_config.json", path / "adapter_model.safetensors"]
    assert all(path.is_file() for path in shipped)
    assert sum(path.stat().st_size for path in shipped) < SHIPPED_SIZE_LIMIT_BYTES


def test_adapters_are_plain_lora_checkpoints_of_the_packaged_base():
    base_config = json.loads((demo.base_model_path() / "config.json").read_text())
    assert base_config["model_type"] == "llama" and base_config["vocab_size"] == demo.VOCAB_SIZE
    assert set(demo.adapter_paths()) == set(demo.TASKS) and len(demo.TASKS) >= 3
    for path in demo.adapter_paths().values():
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        assert config["base_model_name_or_path"] == "punica_hf/demo/base"  # not the path of the machine that trained
        weight_names = load_file(path / "adapter_model.safetensors").keys()
        assert weight_names and all(".lora_A." in name or ".lora_B." in name for name in weight_names)


def test_recorded_accuracy_shows_adapters_solve_their_tasks_and_the_base_does_not():
    report = json.loads((demo.demo_dir() / "ACCURACY.json").read_text())
    for task_name in demo.TASKS:
        assert report["accuracy"][task_name][task_name] >= 0.9
        assert report["accuracy"]["base"][task_name] < 0.3


def test_tokenizer_round_trips_and_stops_at_eos():
    ids = demo.encode("lora=arol")
    assert all(0 <= token_id < 256 for token_id in ids)
    assert demo.decode([demo.BOS_ID, *ids, demo.EOS_ID, *demo.encode("junk"), demo.PAD_ID]) == "lora=arol"
    assert demo.decode(torch.tensor([demo.PAD_ID, *ids])) == "lora=arol"


def test_batch_prompts_pads_on_the_left():
    input_ids, attention_mask = demo.batch_prompts(["ab", "abcd"])
    assert input_ids.tolist() == [
        [demo.PAD_ID, demo.PAD_ID, demo.BOS_ID, *demo.encode("ab=")],
        [demo.BOS_ID, *demo.encode("abcd=")],
    ]
    assert attention_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def test_held_out_words_are_disjoint_from_training_words():
    training_words = demo.sample_words(200, seed=0, held_out=False)
    assert all(demo.is_held_out(word) for word in HELD_OUT_WORDS)
    assert not set(training_words) & set(HELD_OUT_WORDS)


def test_base_model_copies_the_word_and_solves_no_task(peft_answers):
    for task_name in demo.TASKS:
        assert accuracy(peft_answers["base"], task_name, HELD_OUT_WORDS) < 0.3
    copied = [answer == word for answer, word in zip(peft_answers["base"], HELD_OUT_WORDS)]
    assert sum(copied) / len(copied) >= 0.8


@pytest.mark.parametrize("task_name", list(demo.TASKS))
def test_each_adapter_solves_its_own_task_with_peft(peft_answers, task_name):
    assert accuracy(peft_answers[task_name], task_name, HELD_OUT_WORDS) >= 0.8


def test_one_mixed_batch_through_multi_lora_model_gives_each_row_its_adapters_answer(peft_answers):
    model = MultiLoraModel(demo.load_base_model(), max_adapters=len(demo.TASKS), max_rank=16)
    slots = model.load_adapters(demo.adapter_paths())
    # Rows take turns: each adapter, then the base model (-1), over and over; no two neighbours share an adapter.
    row_adapters = [*demo.TASKS, "base"]
    row_adapter_names = [row_adapters[row % len(row_adapters)] for row in range(len(HELD_OUT_WORDS))]
    adapter_ids = torch.tensor([slots.get(name, -1) for name in row_adapter_names])

    answers = demo.generate_answers(model, HELD_OUT_WORDS, adapter_ids=adapter_ids)

    # Every row gets what plain PEFT gives for that word with that one adapter (or with none) ...
    assert answers == [peft_answers[name][row] for row, name in enumerate(row_adapter_names)]
    # ... which is the task's answer for the adapter rows and a copy of the word for the base rows.
    expected = [
        word if name == "base" else demo.TASKS[name].answer(word)
        for name, word in zip(row_adapter_names, HELD_OUT_WORDS)
    ]
    assert sum(answer == want for answer, want in zip(answers, expected)) >= 0.8 * len(expected)
