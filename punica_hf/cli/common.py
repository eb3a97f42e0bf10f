"""Pieces every command shares: device and dtype choice, model and demo loading, argument types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig
from transformers.utils import logging as transformers_logging

from .. import demo

BASE = "base"  # the adapter name that means "no adapter" in --prompt and the views
DEMO_MODEL = "demo"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto",
        help="auto (CUDA if available, with punica_hf's kernels; else CPU), cpu, cuda or cuda:N (default: auto)",
    )
    parser.add_argument(
        "--dtype", choices=["auto", *TORCH_DTYPES], default="auto",
        help="model dtype; auto = bfloat16 on CUDA and float32 on CPU, float32 always for the demo model "
        "(default: auto)",
    )


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def milliseconds(value: str) -> int:
    if not value.isdigit() or int(value) > 10_000:
        raise argparse.ArgumentTypeError(f"expected milliseconds, an integer from 0 to 10000, got {value!r}")
    return int(value)


def seconds(value: str) -> int:
    if not value.isdigit() or int(value) > 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds, an integer from 0 to 86400, got {value!r}")
    return int(value)


def name_and_path(value: str) -> tuple[str, str]:
    name, separator, path = value.partition("=")
    if not (separator and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def adapter_name_and_path(value: str) -> tuple[str, str]:
    """``NAME=PATH`` with a NAME other than ``BASE``, the base model's."""
    name, path = name_and_path(value)
    if name == BASE:
        raise argparse.ArgumentTypeError(f"the name {BASE!r} is reserved for the base model; pick another name")
    return name, path


class AppendUniqueName(argparse.Action):
    """``action="append"`` for ``NAME=...`` options whose ``type`` makes ``(name, value)`` pairs: a name given
    twice is a usage error, since one of its two values would be silently dropped."""

    def __call__(self, parser, namespace, pair: tuple[str, str], option_string=None) -> None:
        pairs = list(getattr(namespace, self.dest) or [])
        earlier = dict(pairs).get(pair[0])
        if earlier is not None:
            raise argparse.ArgumentError(self, f"the name {pair[0]!r} is given twice ({earlier} and {pair[1]})")
        setattr(namespace, self.dest, [*pairs, pair])


@dataclass(frozen=True)
class TextCodec:
    """How one model's prompts become a left-padded batch and its tokens become text."""

    encode_batch: Callable[[list[str], torch.device], tuple[torch.Tensor, torch.Tensor]]  # ids, mask [B, T]
    decode: Callable[[list[int]], str]
    eos_token_ids: frozenset[int]
    pad_token_id: int


def load_model(model_id: str, device: torch.device, dtype: torch.dtype, chat_template: bool, tp: int = 1):
    """``(model, codec)`` for the demo model or a transformers causal LM and its tokenizer; ``tp`` > 1: the model
    split over that many ranks by transformers' tensor parallelism (on the device transformers gives this rank)."""
    if model_id == DEMO_MODEL:
        if chat_template:
            raise ValueError("the demo model has no chat template; leave out --chat-template")
        codec = TextCodec(
            encode_batch=lambda prompts, device: demo.batch_prompts(list(map(demo_input, prompts)), device),
            decode=demo.decode,
            eos_token_ids=frozenset({demo.EOS_ID}), pad_token_id=demo.PAD_ID,
        )
        return load_demo_model(device, dtype), codec

    check_model_folder(model_id)
    transformers_logging.set_verbosity_error()  # keep the live view free of generation-config chatter
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    tokenizer.padding_side = "left"  # decoder-only batches generate from the right end of every row
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tp > 1:
        split = DistributedConfig(tp_plan="auto", tp_size=tp)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, distributed_config=split).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos_token_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}

    def encode_batch(prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if chat_template:
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                for prompt in prompts
            ]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat_template)
        return batch["input_ids"].to(device), batch["attention_mask"].to(device)

    codec = TextCodec(
        encode_batch=encode_batch,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        eos_token_ids=frozenset(eos_token_ids),
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, codec


def check_model_folder(model_id: str) -> None:
    """``FileNotFoundError`` naming the folder when ``model_id`` is meant as a path (it starts with '/', './', '../'
    or '~', or its first part is on disk) and is not a folder: transformers would say it is not a valid Hub repo id.
    """
    path = Path(model_id).expanduser()
    first_part_exists = len(path.parts) > 1 and Path(path.parts[0]).exists()
    meant_as_path = model_id.startswith(("/", "./", "../", "~")) or first_part_exists
    if meant_as_path and not path.is_dir():
        problem = "a file, not a model folder" if path.exists() else "no such folder"
        raise FileNotFoundError(f"--model {model_id}: {problem}")


def demo_input(prompt: str) -> str:
    """The demo model's input word in a prompt, given bare (``lora``) or in the demo's prompt format (``lora=``, as
    ``punica-hf demo`` shows it): ``demo.batch_prompts`` adds the ``=`` itself."""
    return prompt.removesuffix("=")


def load_demo_model(device: torch.device, dtype: torch.dtype):
    bar_was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a loading bar for a 3 MB model is noise
    try:
        return demo.load_base_model(device, dtype)
    finally:
        if bar_was_enabled:
            transformers_logging.enable_progress_bar()


def demo_adapter_sources() -> dict[str, Path]:
    sources = demo.adapter_paths()
    missing = [str(path) for path in sources.values() if not path.is_dir()]
    if missing:
        raise FileNotFoundError(
            f"the demo adapters are not built (missing {', '.join(missing)}); build them with "
            "examples/train_demo_model.py"
        )
    return sources


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    return device


def resolve_dtype(name: str, device: torch.device, model_id: str) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if model_id == DEMO_MODEL or device.type == "cpu":
        return torch.float32
    return torch.bfloat16
