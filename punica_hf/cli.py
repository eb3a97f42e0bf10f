"""The ``punica-hf`` command line: ``demo``, ``generate``, ``dashboard`` and ``convert``.

Every command runs inside ``main``, which turns any error into one line on stderr and exit code 1 (2 for a bad
command line), unless ``--debug`` asks for the traceback. ``generate`` and ``dashboard`` build one batch whose
rows each name their adapter (or the base model) and stream it through a ``BatchStreamer`` into a live view.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich import filesize
from rich.table import Table
from rich.text import Text
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from . import __version__, demo, ops
from .convert import DTYPES, SUFFIX, adapter_name, convert_adapter
from .jsonl import read_jsonl
from .loader import load_adapter_weights
from .model import MultiLoraModel
from .streaming import BatchStreamer, BatchView, Request

BASE = "base"  # the adapter name that means "no adapter" in --prompt and the views
DEMO_MODEL = "demo"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPAINT_SECONDS = 0.05  # live views repaint at most this often; the final state is always painted


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, --version and usage errors; the message is already printed
        return int(exit_request.code or 0)
    console, errors = Console(), Console(stderr=True)
    try:
        args.run(args, console)
    except KeyboardInterrupt:
        errors.print("interrupted", style="red")
        return 130
    except Exception as error:
        if args.debug:
            raise
        errors.print(f"error: {_one_line(error)}", style="red", markup=False, highlight=False, soft_wrap=True)
        return 1
    return 0


def _one_line(error: Exception) -> str:
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    message = " ".join(str(message).split()) or type(error).__name__
    return f"{message} (run with --debug for the traceback)"


# ------------------------------------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (the full usage is a ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and example epilogs."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="punica-hf",
        description="Serve many LoRA adapters in one batch on one Hugging Face model: every row of a batch "
        "can use its own adapter (or none).",
        epilog="examples:\n"
        "  punica-hf demo\n"
        "  punica-hf generate --model demo --prompt reverse:lora --prompt base:lora\n"
        "  punica-hf dashboard\n"
        "  punica-hf convert ./my-peft-adapter my-adapter.safetensors\n\n"
        "Run `punica-hf COMMAND --help` for the options of each command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"punica-hf {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # --debug is accepted after the command too; SUPPRESS keeps a subcommand from resetting the global value
    debug_anywhere = argparse.ArgumentParser(add_help=False)
    debug_anywhere.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def command(name: str, run: Callable, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=summary, description=f"{summary}. {description}", epilog=f"examples:\n{epilog}",
            parents=[debug_anywhere], formatter_class=_HelpFormatter,
        )
        sub.set_defaults(run=run)
        return sub

    demo_parser = command(
        "demo", run_demo,
        "run one mixed batch on the packaged demo model and its adapters",
        "Loads the tiny demo model and its task adapters, runs ONE batch where every row uses another adapter "
        "(or the base model), and prints each row's prompt, adapter and answer.",
        "  punica-hf demo\n  punica-hf demo --device cpu",
    )
    _add_device_arguments(demo_parser)

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

    convert_parser = command(
        "convert", run_convert,
        "convert PEFT adapters into punica_hf's fast-loading serving format",
        "Reads PEFT LoRA adapters (folders, Hub repo ids or converted files) and writes one .safetensors file "
        "per adapter with the scaling folded in, loadable by MultiLoraModel.load_adapters and "
        "--adapter NAME=FILE.safetensors.",
        "  punica-hf convert ./my-peft-adapter my-adapter.safetensors\n"
        "  punica-hf convert ./adapters/* converted/            # one converted/<name>.safetensors each\n"
        "  punica-hf convert org/some-lora converted/ --dtype bf16 --revision main",
    )
    convert_parser.add_argument(
        "sources", nargs="+", metavar="SRC",
        help="a PEFT adapter folder, a Hub repo id, or a converted .safetensors file (to change its dtype)",
    )
    convert_parser.add_argument(
        "destination", metavar="DST",
        help="with one SRC: the output file (if it ends in .safetensors) or a folder; with several: a folder "
        "that receives <name>.safetensors per source (created if missing)",
    )
    convert_parser.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32",
        help="dtype of the stored factors: fp32 (default) gives outputs identical to the PEFT adapter, bf16 and "
        "fp16 halve the file",
    )
    convert_parser.add_argument(
        "--base-model", metavar="NAME",
        help="base model recorded in the file (default: base_model_name_or_path of the adapter config)",
    )
    convert_parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of Hub sources")
    convert_parser.add_argument("--subfolder", help="folder inside each source (Hub repo or local folder)")
    convert_parser.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache folder for Hub sources")
    return parser


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto",
        help="auto (CUDA if available, with punica_hf's kernels; else CPU), cpu, cuda or cuda:N (default: auto)",
    )
    parser.add_argument(
        "--dtype", choices=["auto", *TORCH_DTYPES], default="auto",
        help="model dtype; auto = bfloat16 on CUDA and float32 on CPU, float32 always for the demo model "
        "(default: auto)",
    )


def _add_generation_arguments(parser: argparse.ArgumentParser, model_default: str | None) -> None:
    parser.add_argument(
        "--model", required=model_default is None, default=model_default, metavar="ID_OR_PATH",
        help="base model: a Hub id or local folder for AutoModelForCausalLM and AutoTokenizer, or 'demo' for the "
        "packaged demo model and its byte tokenizer"
        + (f" (default: {model_default})" if model_default else ""),
    )
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH", type=_name_and_path,
        help="load an adapter under NAME from a PEFT folder, Hub repo id or converted .safetensors file "
        "(repeatable); with --model demo and no --adapter, the demo adapters are loaded",
    )
    parser.add_argument(
        "--prompt", action="append", default=[], metavar="NAME:TEXT", type=_prompt_request,
        help=f"a request: TEXT generated with adapter NAME, or with the base model for NAME '{BASE}' (repeatable; "
        "one batch row each)",
    )
    parser.add_argument(
        "--prompts-jsonl", metavar="FILE", type=Path,
        help='more requests, one JSON object a line: {"adapter": NAME or null, "prompt": TEXT}',
    )
    parser.add_argument(
        "--max-new-tokens", type=_positive_int, default=32, metavar="N",
        help="tokens to generate per row at most (default: 32)",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T",
        help="sampling temperature, with --do-sample (default: 1.0)",
    )
    parser.add_argument(
        "--top-p", type=float, metavar="P", help="sample from the smallest token set of probability P, with --do-sample"
    )
    parser.add_argument(
        "--top-k", type=_positive_int, metavar="K", help="sample among the K most likely tokens only, with --do-sample"
    )
    parser.add_argument("--seed", type=int, metavar="N", help="random seed, for reproducible sampling")
    parser.add_argument(
        "--max-rank", type=_positive_int, metavar="R",
        help="largest LoRA rank the adapter slots hold (default: the largest rank among the adapters)",
    )
    parser.add_argument(
        "--chat-template", action="store_true",
        help="wrap each prompt as a user message with the tokenizer's chat template (instruct models)",
    )
    _add_device_arguments(parser)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def _name_and_path(value: str) -> tuple[str, str]:
    name, separator, path = value.partition("=")
    if not (separator and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _prompt_request(value: str) -> Request:
    name, separator, text = value.partition(":")
    if not (separator and name and text):
        raise argparse.ArgumentTypeError(f"expected NAME:TEXT (NAME an adapter or '{BASE}'), got {value!r}")
    return Request(prompt=text, adapter=None if name == BASE else name)


# ------------------------------------------------------------------------------------------------ commands
def run_demo(args: argparse.Namespace, console: Console) -> None:
    adapter_sources = _demo_adapter_sources()
    device = _resolve_device(args.device)
    with console.status(f"loading the demo model and {len(adapter_sources)} adapters on {device}"):
        base = _load_demo_model(device, _resolve_dtype(args.dtype, device, DEMO_MODEL))
        model = MultiLoraModel(base, max_adapters=len(adapter_sources))
        model.load_adapters(adapter_sources)
    # one row per task, each on another example word, and a base-model row that copies its word
    rows = [(task, spec.examples[i % len(spec.examples)]) for i, (task, spec) in enumerate(demo.TASKS.items())]
    rows.append((None, next(iter(demo.TASKS.values())).examples[0]))

    with console.status(f"running one batch of {len(rows)} rows"):
        start = time.perf_counter()
        answers = demo.generate_answers(model, [word for _, word in rows], adapter_ids=[task for task, _ in rows])
        seconds = time.perf_counter() - start

    table = Table(
        title="punica-hf demo: one batch, one adapter per row",
        caption=f"{len(rows)} rows in {seconds:.2f} s on {device} (LoRA ops: {ops.backend_for(device)})",
    )
    for column in ("prompt", "adapter", "task", "answer", "expected"):
        table.add_column(column)
    for (task, word), answer in zip(rows, answers):
        expected = demo.TASKS[task].answer(word) if task else word
        description = demo.TASKS[task].description if task else "copy the word (no adapter)"
        mark = Text(" ✓", style="green") if answer == expected else Text(" ✗", style="red")
        table.add_row(
            demo.make_prompt(word), task or BASE, description, Text(answer, style="bold"), Text(expected) + mark
        )
    console.print(table)


def run_generate(args: argparse.Namespace, console: Console) -> None:
    _stream_batch(args, console, _requests(args), BatchView.table)


def run_dashboard(args: argparse.Namespace, console: Console) -> None:
    requests = _requests(args)
    if not requests and args.model == DEMO_MODEL:  # every demo adapter and the base model, on each example word
        words = next(iter(demo.TASKS.values())).examples
        requests = [Request(word, adapter) for adapter in [*demo.TASKS, None] for word in words]
    _stream_batch(args, console, requests, BatchView.panels)


def run_convert(args: argparse.Namespace, console: Console) -> None:
    destination = Path(args.destination)
    if len(args.sources) > 1 and destination.suffix == SUFFIX:
        raise ValueError(f"{len(args.sources)} sources need a folder as DST, not the file {destination}")
    names = [adapter_name(source) for source in args.sources]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise ValueError(f"several sources would be written to the same file name: {', '.join(clashes)}")
    options = dict(
        dtype=DTYPES[args.dtype], base_model=args.base_model,
        revision=args.revision, subfolder=args.subfolder, cache_dir=args.cache_dir,
    )
    written = []
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    with progress:
        bar = progress.add_task("converting", total=len(args.sources))
        for source, name in zip(args.sources, names):
            progress.update(bar, description=f"converting {name}")
            written.append((source, convert_adapter(source, destination, **options)))
            progress.advance(bar)
        progress.update(bar, description="converted")

    table = Table(title=f"converted {len(written)} adapter(s) ({args.dtype})")
    for column in ("source", "file", "size"):
        table.add_column(column)
    for source, path in written:
        table.add_row(Text(str(source)), Text(str(path)), filesize.decimal(path.stat().st_size))
    console.print(table)


# ------------------------------------------------------------------------------------------------ generation
@dataclass(frozen=True)
class TextCodec:
    """How one model's prompts become a left-padded batch and its tokens become text."""

    encode_batch: Callable[[list[str], torch.device], tuple[torch.Tensor, torch.Tensor]]  # ids, mask [B, T]
    decode: Callable[[list[int]], str]
    eos_token_ids: frozenset[int]
    pad_token_id: int


def _stream_batch(
    args: argparse.Namespace, console: Console, requests: list[Request], render: Callable[[BatchView], object]
) -> None:
    """Load the model and adapters, run every request in one batch and paint ``render(view)`` live."""
    if not requests:
        raise ValueError("no prompts: give --prompt NAME:TEXT or --prompts-jsonl FILE")
    adapter_sources = dict(args.adapter)
    if args.model == DEMO_MODEL and not adapter_sources:
        adapter_sources = _demo_adapter_sources()
    unknown = sorted({r.adapter for r in requests if r.adapter is not None} - set(adapter_sources))
    if unknown:
        raise ValueError(
            f"prompts name adapter(s) {', '.join(map(repr, unknown))} that no --adapter loads "
            f"(loaded: {', '.join(adapter_sources) or 'none'}; use '{BASE}' for the base model)"
        )
    # Adapters are read before the base model loads, so a bad adapter fails in a second, not after minutes.
    adapters = {name: load_adapter_weights(source) for name, source in adapter_sources.items()}
    device = _resolve_device(args.device)
    with console.status(f"loading {args.model} on {device}"):
        dtype = _resolve_dtype(args.dtype, device, args.model)
        model, codec = _load_model(args.model, device, dtype, args.chat_template)
        served = MultiLoraModel(
            model,
            max_adapters=max(1, len(adapters)),
            max_rank=args.max_rank or max((weights.max_rank for weights in adapters.values()), default=1),
        )
        served.load_adapters(adapters)

    if args.seed is not None:
        torch.manual_seed(args.seed)
    input_ids, attention_mask = codec.encode_batch([request.prompt for request in requests], device)
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


def _load_model(model_id: str, device: torch.device, dtype: torch.dtype, chat_template: bool):
    """``(model, codec)`` for the demo model or a transformers causal LM and its tokenizer."""
    if model_id == DEMO_MODEL:
        if chat_template:
            raise ValueError("the demo model has no chat template; leave out --chat-template")
        codec = TextCodec(
            encode_batch=demo.batch_prompts, decode=demo.decode,
            eos_token_ids=frozenset({demo.EOS_ID}), pad_token_id=demo.PAD_ID,
        )
        return _load_demo_model(device, dtype), codec

    transformers_logging.set_verbosity_error()  # keep the live view free of generation-config chatter
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    tokenizer.padding_side = "left"  # decoder-only batches generate from the right end of every row
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
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


def _load_demo_model(device: torch.device, dtype: torch.dtype):
    bar_was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a loading bar for a 3 MB model is noise
    try:
        return demo.load_base_model(device, dtype)
    finally:
        if bar_was_enabled:
            transformers_logging.enable_progress_bar()


def _demo_adapter_sources() -> dict[str, Path]:
    sources = demo.adapter_paths()
    missing = [str(path) for path in sources.values() if not path.is_dir()]
    if missing:
        raise FileNotFoundError(
            f"the demo adapters are not built (missing {', '.join(missing)}); build them with "
            "examples/train_demo_model.py"
        )
    return sources


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    return device


def _resolve_dtype(name: str, device: torch.device, model_id: str) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if model_id == DEMO_MODEL or device.type == "cpu":
        return torch.float32
    return torch.bfloat16

