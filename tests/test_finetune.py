"""examples/finetune: data preparation and LoRA fine-tuning end to end, into adapters that MultiLoraModel serves.

``finetune.py`` runs as a user would run it (a subprocess, a few optimizer steps on the CPU) on a tiny Llama with a
byte-level tokenizer built here, and on the demo model punica_hf ships when its files are present.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from punica_hf import MultiLoraModel

FINETUNE_DIR = Path(__file__).resolve().parents[1] / "examples" / "finetune"
FINETUNE_SCRIPT = FINETUNE_DIR / "finetune.py"
DATA_SCRIPT = FINETUNE_DIR / "create-finetune-data.py"
DEMO_BASE_CONFIG = Path(__file__).resolve().parents[1] / "punica_hf" / "demo" / "base" / "config.json"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
ADAPTER_NAME = "sums"
# Few steps but a large learning rate, so that LoRA B (zero at the start) moves visibly away from zero.
FINETUNE_ARGS = ["--max-steps", "3", "--lr", "1e-2", "--batch-size", "4", "--rank", "4", "--alpha", "8"]


def load_script(path: Path):
    """Import an example script as a module (its file name need not be a valid module name)."""
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is being built
    spec.loader.exec_module(module)
    return module


def run_script(script: Path, *args: str, home: Path) -> subprocess.CompletedProcess:
    # Offline and with an empty Hugging Face cache, whatever the machine running the tests has.
    env = {**os.environ, "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def sum_examples() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{a + 1}=", "response": str(2 * a + 1)} for a in range(10)]


def save_tiny_llama_with_tokenizer(folder: Path) -> Path:
    """A random tiny Llama and a byte-level BPE tokenizer (no merges, BOS added) saved as a model folder."""
    byte_vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab = {**byte_vocab, **{token: len(byte_vocab) + offset for offset, token in enumerate(SPECIAL_TOKENS)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def assert_adapter_changes_only_its_row(base, adapter_dir: Path, input_ids, attention_mask) -> None:
    """The fine-tuned adapter loads into MultiLoraModel and changes the logits of its row only."""
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    lora_b = [tensor for key, tensor in weights.items() if "lora_B" in key]
    assert lora_b and all(tensor.abs().sum() > 0 for tensor in lora_b), "training left LoRA B at zero"

    with torch.no_grad():
        base_logits = base(input_ids=input_ids, attention_mask=attention_mask).logits
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    assert model.load_adapters({ADAPTER_NAME: adapter_dir}) == {ADAPTER_NAME: 0}
    with torch.no_grad():
        logits = model(
            input_ids=input_ids.repeat(2, 1),
            attention_mask=attention_mask.repeat(2, 1),
            adapter_ids=[ADAPTER_NAME, None],
        ).logits

    torch.testing.assert_close(logits[1:], base_logits, rtol=0, atol=1e-5)
    assert (logits[:1] - base_logits).abs().max() > 1e-3


def test_finetune_hub_style_model_serves_with_multilora(tmp_path):
    model_dir = save_tiny_llama_with_tokenizer(tmp_path / "tiny-llama")
    data = write_jsonl(tmp_path / "sums.jsonl", sum_examples())
    adapter_dir = tmp_path / ADAPTER_NAME

    result = run_script(
        FINETUNE_SCRIPT, "--model", str(model_dir), "--data", str(data), "--output", str(adapter_dir), *FINETUNE_ARGS,
        home=tmp_path,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--adapter {ADAPTER_NAME}={adapter_dir}" in result.stdout
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(["3+4="], return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert_adapter_changes_only_its_row(base, adapter_dir, prompt["input_ids"], prompt["attention_mask"])


@pytest.mark.skipif(not DEMO_BASE_CONFIG.exists(), reason="the demo base model has not been built")
def test_finetune_demo_model_serves_with_multilora(tmp_path):
    from punica_hf import demo

    words = ["lora", "punica", "adapter", "model", "serve", "batch", "token", "layer", "query", "value"]
    examples = [{"prompt": word, "response": word[::-1]} for word in words]
    data = write_jsonl(tmp_path / "reverse.jsonl", examples)
    adapter_dir = tmp_path / ADAPTER_NAME

    result = run_script(
        FINETUNE_SCRIPT, "--model", "demo", "--data", str(data), "--output", str(adapter_dir), *FINETUNE_ARGS,
        home=tmp_path,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    input_ids, attention_mask = demo.batch_prompts(["lora"])
    assert_adapter_changes_only_its_row(demo.load_base_model(), adapter_dir, input_ids, attention_mask)


def test_training_examples_mask_the_prompt_and_pad_on_the_right():
    finetune = load_script(FINETUNE_SCRIPT)

    class ByteTokenizer:  # BOS = 1, bytes as themselves, EOS = 2
        eos_token_id, pad_token_id = 2, 0

        def prompt_ids(self, text):
            return [1, *text.encode()]

        def response_ids(self, text):
            return [*text.encode(), 2]

    examples = [
        {"prompt": "ab", "response": "c"},
        {"prompt": "a", "response": "bcde"},
        {"prompt": "abcdef", "response": "g"},
    ]
    tokenized = finetune.tokenize_examples(examples, ByteTokenizer(), max_length=5)

    # The third prompt fills max_length alone, so it is dropped; the second is cut to max_length.
    assert tokenized == [
        {"input_ids": [1, 97, 98, 99, 2], "labels": [-100, -100, -100, 99, 2]},
        {"input_ids": [1, 97, 98, 99, 100], "labels": [-100, -100, 98, 99, 100]},
    ]
    batch = finetune.RightPaddingCollator(pad_token_id=0)([tokenized[0], {"input_ids": [1, 97], "labels": [-100, 98]}])
    assert batch["input_ids"].tolist() == [[1, 97, 98, 99, 2], [1, 97, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 99, 2], [-100, 98, -100, -100, -100]]


def test_create_data_from_local_jsonl_with_a_preset_template(tmp_path):
    records = [
        {"question": f"How many heads does table t{i} have?", "context": f"CREATE TABLE t{i} (heads INTEGER)",
         "answer": f"SELECT COUNT(heads) FROM t{i}"}
        for i in range(3)
    ]
    output = tmp_path / "sql.jsonl"

    result = run_script(
        DATA_SCRIPT, "--preset", "sqlctx", "--from-jsonl", str(write_jsonl(tmp_path / "raw.jsonl", records)),
        "--output", str(output), "--limit", "2", home=tmp_path,
    )

    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 2
    for line, record in zip(lines, records):
        assert set(line) == {"prompt", "response"}
        assert record["question"] in line["prompt"] and record["context"] in line["prompt"]
        assert line["response"] == record["answer"]
    data_module = load_script(DATA_SCRIPT)
    assert lines[0]["prompt"] == data_module.PRESETS["sqlctx"].prompt_template.format(**records[0])


def test_create_data_from_local_jsonl_with_own_field_names(tmp_path):
    records = [{"instruction": "Say hi", "output": "hi", "id": 1}, {"instruction": "Say bye", "output": "bye", "id": 2}]
    output = tmp_path / "mine.jsonl"

    result = run_script(
        DATA_SCRIPT, "--from-jsonl", str(write_jsonl(tmp_path / "raw.jsonl", records)), "--output", str(output),
        "--prompt-field", "instruction", "--response-field", "output", home=tmp_path,
    )

    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()] == [
        {"prompt": "Say hi", "response": "hi"},
        {"prompt": "Say bye", "response": "bye"},
    ]


def test_create_data_reports_a_missing_field(tmp_path):
    output = tmp_path / "out.jsonl"
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"question": "q"}])

    result = run_script(
        DATA_SCRIPT, "--preset", "gsm8k", "--from-jsonl", str(raw), "--output", str(output), home=tmp_path
    )

    assert result.returncode == 1
    assert "no field 'answer'" in result.stderr and "Traceback" not in result.stderr
    assert not output.exists()


def test_create_data_offline_without_local_file_says_how_to_convert_one(tmp_path):
    output = tmp_path / "gsm8k.jsonl"

    result = run_script(DATA_SCRIPT, "--preset", "gsm8k", "--output", str(output), home=tmp_path)

    assert result.returncode == 2
    assert "--from-jsonl" in result.stderr and "openai/gsm8k" in result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists()
