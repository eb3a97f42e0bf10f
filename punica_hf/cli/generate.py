"""``punica-hf generate`` and ``punica-hf dashboard``: one batch of prompts on different adapters, streamed live."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.live import Live

from .. import demo
from ..formats import load_adapter_weights
from ..formats.jsonl import read_jsonl
from ..model import MultiLoraModel
from . import ranks
from .common import (
    BASE, DEMO_MODEL, AppendUniqueName, adapter_name_and_path, add_device_arguments, demo_adapter_sources, load_model,
    positive_int, resolve_device, resolve_dtype,
)
from .streaming import BatchStreamer, BatchView, Request

REPAINT_SECONDS = 0.05  # live views repaint at most this often; the final state is always painted


def register(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this module's subcommand(s) through ``command(name, run, summary, description, epilog)``."""
    generate_parser = command(
        "generate", run_generate,
        "generate for prompts on different adapters in one batch, streamed live",
        "Loads a model and adapters, runs every --prompt as one row of ONE batch with its own adapter, and "
        "streams every row's tokens into a live table.",
        "  punica-hf generate --model demo --prompt reverse:lora --prompt upper:lora --prompt base:lora\n"
        "  punica-hf generate --model meta-llama/Llama-3.2-1B-Instruct --chat-template \\\n"
        "      --adapter sql=./sql-lora --adapter chat=./chat.safetensors \\\n"
        "      --prompt 'sql:List all users' --prompt 'chat:Hello!' --prompt 'base:Hello!'\n"
        "  punica-hf generate --model ./my-model --adapter a=./a --prompts-jsonl requests.jsonl --do-sample --seed 0",
    )
    _add_generation_arguments(generate_parser, model_default=None)

    dashboard_parser = command(
        "dashboard", run_dashboard,
        "watch requests on different adapters generate side by side",
        "A live view of one batch: a panel per request with its text so far and tokens/s, and the batch's "
        "overall tokens/s. Takes the options of `generate`; without prompts it runs the demo model on every demo "
        "adapter and the base model.",
        "  punica-hf dashboard\n"
        "  punica-hf dashboard --model ./my-model --adapter a=./a --adapter b=./b --prompt a:Hi --prompt b:Hi",
    )
    _add_generation_arguments(dashboard_parser, model_default=DEMO_MODEL)


def _add_generation_arguments(parser: argparse.ArgumentParser, model_default: str | None) -> None:
    parser.add_argument(
        "--model", required=model_default is None, default=model_default, metavar="ID_OR_PATH",
        help="base model: a Hub id or local folder for AutoModelForCausalLM and AutoTokenizer, or 'demo' for the "
        "packaged demo model and its byte tokenizer"
        + (f" (default: {model_default})" if model_default else ""),
    )
    parser.add_argument(
        "--adapter", action=AppendUniqueName, default=[], metavar="NAME=PATH", type=_adapter_option,
        help="load an adapter under NAME from a PEFT folder, Hub repo id or converted .safetensors file "
        f"(repeatable, each NAME once, not '{BASE}'); with --model demo and no --adapter, the demo adapters are "
        "loaded",
    )
    parser.add_argument(
        "--prompt", action="append", default=[], metavar="NAME:TEXT", type=_prompt_request,
        help=f"a request: TEXT generated with adapter NAME, or with the base model for NAME '{BASE}' (repeatable; "
        "one batch row each); with --model demo, TEXT is a word, as in reverse:lora or reverse:lora=",
    )
    parser.add_argument(
        "--prompts-jsonl", metavar="FILE", type=Path,
        help='more requests, one JSON object a line: {"adapter": NAME or null, "prompt": TEXT}',
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=32, metavar="N",
        help="tokens to generate per row at most (default: 32)",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T",
        help="sampling temperature, with --do-sample (default: 1.0)",
    )
    parser.add_argument(
        "--top-p", type=_probability, metavar="P",
        help="sample from the smallest token set of probability P (0 < P <= 1), with --do-sample",
    )
    parser.add_argument(
        "--top-k", type=positive_int, metavar="K", help="sample among the K most likely tokens only, with --do-sample"
    )
    parser.add_argument("--seed", type=int, metavar="N", help="random seed, for reproducible sampling")
    parser.add_argument(
        "--max-rank", type=positive_int, metavar="R",
        help="largest LoRA rank the adapter slots hold (default: the largest rank among the adapters)",
    )
    parser.add_argument(
        "--chat-template", action="store_true",
        help="wrap each prompt as a user message with the tokenizer's chat template (instruct models)",
    )
    add_device_arguments(parser)
    ranks.add_tp_arguments(parser)


def _adapter_option(value: str) -> tuple[str, str]:
    """``NAME=PATH``, with a NAME that ``--prompt NAME:TEXT`` can address: not the base model's, without ':'."""
    name, path = adapter_name_and_path(value)
    if ":" in name:
        raise argparse.ArgumentTypeError(f"adapter names cannot hold ':' (--prompt NAME:TEXT), got {name!r}")
    return name, path


def _probability(value: str) -> float:
    """A top-p: a number in (0, 1] (as the server takes it)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}")
    return number


def _prompt_request(value: str) -> Request:
    name, separator, text = value.partition(":")
    if not (separator and name and text):
        raise argparse.ArgumentTypeError(f"expected NAME:TEXT (NAME an adapter or '{BASE}'), got {value!r}")
    return Request(prompt=text, adapter=None if name == BASE else name)


def run_generate(args: argparse.Namespace, console: Console) -> None:
    _stream_batch(args, console, _requests(args), BatchView.table)


def run_dashboard(args: argparse.Namespace, console: Console) -> None:
    requests = _requests(args)
    if not requests and args.model == DEMO_MODEL:  # every demo adapter and the base model, on each example word
        words = next(iter(demo.TASKS.values())).examples
        requests = [Request(word, adapter) for adapter in [*demo.TASKS, None] for word in words]
    _stream_batch(args, console, requests, BatchView.panels)


def _stream_batch(
    args: argparse.Namespace, console: Console, requests: list[Request], render: Callable[[BatchView], object]
) -> None:
    """Load the model and adapters, run every request in one batch and paint ``render(view)`` live."""
    if not requests:
        raise ValueError("no prompts: give --prompt NAME:TEXT or --prompts-jsonl FILE")
    adapter_sources = dict(args.adapter)
    if args.model == DEMO_MODEL and not adapter_sources:
        adapter_sources = demo_adapter_sources()
    unknown = sorted({r.adapter for r in requests if r.adapter is not None} - set(adapter_sources))
    if unknown:
        raise ValueError(
            f"prompts name adapter(s) {', '.join(map(repr, unknown))} that no --adapter loads "
            f"(loaded: {', '.join(adapter_sources) or 'none'}; use '{BASE}' for the base model)"
        )
    if args.tp > 1:
        ranks.check_tp_arguments(args)
        if not args.as_tp_rank:  # this process starts the ranks; each runs the rest of this function
            ranks.launch(args.argv, args.tp)
            return
        if ranks.join(args.tp) != 0:
            console = Console(quiet=True)  # only rank 0 prints
        try:
            _run_batch(args, console, requests, render, adapter_sources)
        finally:
            ranks.leave()
    else:
        _run_batch(args, console, requests, render, adapter_sources)


def _run_batch(
    args: argparse.Namespace, console: Console, requests: list[Request], render: Callable[[BatchView], object],
    adapter_sources: dict,
) -> None:
    # Adapters are read before the base model loads, so a bad adapter fails in a second, not after minutes.
    adapters = {name: load_adapter_weights(source) for name, source in adapter_sources.items()}
    device = resolve_device(args.device)
    with console.status(f"loading {args.model} on {device}"):
        dtype = resolve_dtype(args.dtype, device, args.model)
        model, codec = load_model(args.model, device, dtype, args.chat_template, args.tp)
        if args.tp > 1:
            device = model.device  # where transformers put this rank's share
        served = MultiLoraModel(
            model,
            max_adapters=max(1, len(adapters)),
            max_rank=args.max_rank or max((weights.max_rank for weights in adapters.values()), default=1),
        )
        served.load_adapters(adapters)

    seed = ranks.shared_seed(args.seed) if args.tp > 1 else args.seed
    if seed is not None:
        torch.manual_seed(seed)
    input_ids, attention_mask = codec.encode_batch([request.prompt for request in requests], device)
    empty = [number for number, tokens in enumerate(attention_mask.sum(dim=1).tolist(), start=1) if tokens == 0]
    if empty:  # the model would fail on it with an error about shapes
        request = requests[empty[0] - 1]
        raise ValueError(f"prompt {empty[0]} ({request.prompt!r}, adapter {request.adapter or BASE}) has no tokens "
                         f"once tokenized" + (f" ({len(empty)} prompts have none)" if len(empty) > 1 else ""))
    streamer = BatchStreamer(len(requests), codec.eos_token_ids)
    view = BatchView(requests, streamer, codec.decode)
    with Live(render(view), console=console, auto_refresh=False, vertical_overflow="visible") as live:
        last_paint = 0.0

        def repaint() -> None:
            nonlocal last_paint
            if time.perf_counter() - last_paint >= REPAINT_SECONDS:
                live.update(render(view), refresh=True)
                last_paint = time.perf_counter()

        streamer.on_update = repaint
        served.generate(
            input_ids,
            attention_mask=attention_mask,
            adapter_ids=[request.adapter for request in requests],
            streamer=streamer,
            pad_token_id=codec.pad_token_id,
            eos_token_id=sorted(codec.eos_token_ids),
            **_decoding_options(args),
        )
        live.update(render(view), refresh=True)
    if not console.is_terminal:
        console.line()  # rich ends a live view with a newline only on a terminal


def _requests(args: argparse.Namespace) -> list[Request]:
    """The requests of ``--prompt`` and ``--prompts-jsonl``, in that order."""
    requests = list(args.prompt)
    if args.prompts_jsonl is not None:
        requests += _read_requests_jsonl(args.prompts_jsonl)
    return requests


def _read_requests_jsonl(path: Path) -> list[Request]:
    requests = []
    for number, entry in read_jsonl(path):
        if not (isinstance(entry.get("prompt"), str) and isinstance(entry.get("adapter"), (str, type(None)))):
            raise ValueError(f'{path}:{number}: expected {{"adapter": NAME or null, "prompt": TEXT}}, got {entry!r}')
        adapter = entry.get("adapter")
        requests.append(Request(entry["prompt"], None if adapter in (None, BASE) else adapter))
    return requests


def _decoding_options(args: argparse.Namespace) -> dict:
    if not args.do_sample:
        return dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature)
    if args.top_p is not None:
        options["top_p"] = args.top_p
    if args.top_k is not None:
        options["top_k"] = args.top_k
    return options
