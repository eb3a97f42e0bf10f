"""``punica-hf serve``: an OpenAI-compatible HTTP server with continuous batching and an adapter per request."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from .common import (
    DEMO_MODEL, AppendUniqueName, add_device_arguments, demo_adapter_sources, load_model, name_and_path, positive_int,
    resolve_device, resolve_dtype,
)


def register(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this module's subcommand(s) through ``command(name, run, summary, description, epilog)``."""
    parser = command(
        "serve", run,
        "serve a model and its LoRA adapters over an OpenAI-compatible HTTP API",
        "Continuous batching in which every request names its adapter in the OpenAI `model` field (or the base "
        "model): POST /v1/completions and /v1/chat/completions (stream: true for server-sent events), "
        "GET /v1/models, GET /health, GET /metrics (Prometheus), and with --allow-runtime-lora vLLM's "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Needs the serve extra "
        "(pip install 'punica-hf[serve]'). SIGTERM finishes the requests in flight, then exits.",
        "  punica-hf serve --model demo\n"
        "  punica-hf serve --model meta-llama/Llama-3.1-8B-Instruct --adapter sql=./sql-lora --adapter "
        "math=org/math-lora \\\n"
        "      --port 8000 --api-key secret --allow-runtime-lora --lora-dir /srv/adapters\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        "      -d '{\"model\": \"upper\", \"prompt\": \"lora=\", \"max_tokens\": 9, \"temperature\": 0}'",
    )
    parser.add_argument(
        "--model", required=True, metavar="ID_OR_PATH",
        help="base model: a Hub id or local folder (AutoModelForCausalLM + AutoTokenizer), or 'demo' for the "
        "packaged demo model, served with its adapters reverse, upper and sort",
    )
    parser.add_argument(
        "--adapter", action=AppendUniqueName, default=[], metavar="NAME=SOURCE", type=name_and_path,
        help="serve an adapter under NAME, from a PEFT folder, Hub repo id or converted .safetensors file "
        "(repeatable)",
    )
    parser.add_argument(
        "--served-model-name", metavar="NAME",
        help="the base model's id in the API (default: the --model value)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--api-key", metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health",
    )
    parser.add_argument(
        "--allow-runtime-lora", action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths under --lora-dir only)",
    )
    parser.add_argument(
        "--lora-dir", action="append", default=[], metavar="DIR", type=Path,
        help="a directory runtime loads may read adapters from, symlinks resolved (repeatable; needed by "
        "--allow-runtime-lora)",
    )
    sizing = parser.add_argument_group("sizing")
    sizing.add_argument(
        "--max-adapters", type=positive_int, default=64, metavar="N",
        help="adapters resident on the GPU at once, the most distinct adapters in one batch (default: 64)",
    )
    sizing.add_argument("--max-rank", type=positive_int, default=64, metavar="R",
                        help="largest LoRA rank accepted (default: 64)")
    sizing.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                        help="requests waiting to start at most; beyond, 429 (default: 256)")
    sizing.add_argument("--max-running", type=positive_int, metavar="N",
                        help="requests in one batch at most (default: from free GPU memory; 16 on a CPU)")
    sizing.add_argument("--max-batch-tokens", type=positive_int, metavar="N",
                        help="tokens per step at most (default: from free GPU memory; 256 on a CPU)")
    sizing.add_argument("--kv-blocks", type=positive_int, metavar="N",
                        help="blocks of the paged KV cache (default: from free GPU memory)")
    sizing.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="prompt + generated tokens of a request at most (default: the model's limit)")
    sizing.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                        help="capture decoding steps in CUDA graphs (default: auto, transformers decides)")
    add_device_arguments(parser)


def run(args: argparse.Namespace, console: Console) -> None:
    try:
        import uvicorn

        from ..serving.app import create_app
    except ImportError as error:
        raise ImportError(f"punica-hf serve needs the serve extra: pip install 'punica-hf[serve]' ({error})") from error
    from ..model import MultiLoraModel
    from ..serving import DemoTokenizer, Engine, EngineConfig

    if args.allow_runtime_lora and not args.lora_dir:
        raise ValueError("--allow-runtime-lora needs at least one --lora-dir to load adapters from")
    if args.lora_dir and not args.allow_runtime_lora:
        raise ValueError("--lora-dir is only used with --allow-runtime-lora")
    for directory in args.lora_dir:
        if not directory.is_dir():
            raise FileNotFoundError(f"--lora-dir {directory}: not a directory")
    adapters = dict(args.adapter)
    if args.model == DEMO_MODEL and not adapters:
        adapters = {name: str(path) for name, path in demo_adapter_sources().items()}

    device = resolve_device(args.device)
    with console.status(f"loading {args.model} and {len(adapters)} adapter(s) on {device}"):
        base, _ = load_model(args.model, device, resolve_dtype(args.dtype, device, args.model), chat_template=False)
        model = MultiLoraModel(base, max_adapters=args.max_adapters, max_rank=args.max_rank)
        if adapters:
            model.load_adapters(adapters)
        tokenizer = DemoTokenizer() if args.model == DEMO_MODEL else _hf_tokenizer(args.model)
    engine = Engine(
        model, tokenizer,
        EngineConfig(
            max_queue=args.max_queue, max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
            kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
            cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        ),
    )
    name = args.served_model_name or args.model
    app = create_app(
        engine, name, model_source=args.model, adapter_sources=adapters, api_key=args.api_key,
        lora_dirs=args.lora_dir if args.allow_runtime_lora else None,
    )
    console.print(
        f"serving [bold]{name}[/bold] with adapters {', '.join(sorted(adapters)) or '(none)'} on "
        f"http://{args.host}:{args.port}/v1" + (" (API key required)" if args.api_key else ""),
        highlight=False,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None)


def _hf_tokenizer(model_id: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_id)
