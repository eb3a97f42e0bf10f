"""``punica-hf serve``: an OpenAI-compatible HTTP server with continuous batching and an adapter per request."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from rich.console import Console

from ..serving.names import ADAPTER_NAME_RULES, check_adapter_name

from . import ranks
from .common import (
    BASE, DEMO_MODEL, AppendUniqueName, adapter_name_and_path, add_device_arguments, demo_adapter_sources, load_model,
    milliseconds, positive_int, resolve_device, resolve_dtype, seconds,
)

ENGINE_WATCH_SECONDS = 0.2  # how often the server checks for a signal to stop and (over --tp ranks) its engine
# After a shutdown's drain, how long the server may take to send the answers the drain ended (to slow readers too)
ANSWERS_SENT_SECONDS = 10
RAY_APP_NAME = "punica-hf"  # the application's name on Ray Serve
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RAY_INGRESS_DRAIN_VARIABLE = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
RAY_THROUGHPUT_VARIABLE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"  # Ray Serve's switch of its throughput-optimized mode
# The ports from which Ray Serve gives an ingress replica its own HTTP server (throughput-optimized mode): MIN to
# MAX - 1
RAY_INGRESS_PORT_VARIABLES = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
# How long Ray Serve keeps a port a replica gave up out of that range (for HAProxy, which the command does not run)
RAY_PORT_QUARANTINE_VARIABLE = "RAY_SERVE_PORT_QUARANTINE_S"
RAY_DIRECT_INGRESS_VARIABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"  # on in that mode unless set otherwise
# How many nice levels Ray puts its worker processes below the raylet that starts them, 15 unless set: the replicas'
# processes run the engines' host work, which sets their step time whenever the GPU waits for it.
RAY_WORKER_NICENESS_VARIABLE = "RAY_worker_niceness"
RAY_CLUSTER_VARIABLES = (RAY_THROUGHPUT_VARIABLE, RAY_INGRESS_DRAIN_VARIABLE, *RAY_INGRESS_PORT_VARIABLES,
                         RAY_PORT_QUARANTINE_VARIABLE, RAY_DIRECT_INGRESS_VARIABLE, RAY_WORKER_NICENESS_VARIABLE)
INGRESS_WAIT_SECONDS = 30.0  # for the ingress to listen on --port once Ray Serve says the application runs
# Nothing on --port this long: the command stops. Ray Serve blocks for good a port that an ingress it starts again
# finds taken (another process bound it meanwhile), and the clients' port would stay dead while the command runs.
INGRESS_LOST_SECONDS = 60.0
# Beyond the replicas' drain, how long the command waits for Ray Serve to remove the application when it stops
APPLICATION_STOP_MARGIN_SECONDS = 60.0


def register(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this module's subcommand(s) through ``command(name, run, summary, description, epilog)``."""
    parser = command(
        "serve", run,
        "serve a model and its LoRA adapters over an OpenAI-compatible HTTP API",
        "Continuous batching in which every request names its adapter in the OpenAI `model` field (or the base "
        "model): POST /v1/completions and /v1/chat/completions (stream: true for server-sent events), "
        "GET /v1/models, GET /health, GET /metrics (Prometheus), and with --allow-runtime-lora vLLM's "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Needs the serve extra "
        "(pip install 'punica-hf[serve]'). SIGTERM finishes the requests in flight (for --drain-seconds at most), "
        "then exits. With --tp N the model is split over N ranks the command starts itself; rank 0 serves HTTP "
        "(with --replicas, each replica is such a group).",
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
        "--adapter", action=AppendUniqueName, default=[], metavar="NAME=SOURCE", type=_served_adapter,
        help="serve an adapter under NAME, from a PEFT folder, Hub repo id or converted .safetensors file "
        f"(repeatable); NAME as a Hub repo id: {ADAPTER_NAME_RULES}; not '{BASE}'",
    )
    parser.add_argument(
        "--served-model-name", metavar="NAME",
        help="the base model's id in the API (default: the --model value)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on, checked before the model loads (default: 127.0.0.1)",
    )
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
    sizing.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                        help="requests with the same prompt prefix and the same adapter share its KV pages "
                        "(default: on; never across adapters)")
    sizing.add_argument("--compile-steps", choices=["on", "off"], default="off",
                        help="compile each step's forward with torch.compile, fusing the work between the GEMMs "
                        "(default: off; compiling takes minutes at start, more with more layers)")
    parser.add_argument(
        "--drain-seconds", type=seconds, default=600, metavar="S",
        help="on SIGTERM or Ctrl-C, how long the requests already taken (running and queued) may take to finish; "
        "those left then fail with a 503 (a stream: with an error event), and the command exits. Set it below "
        "your supervisor's stop timeout (Kubernetes: terminationGracePeriodSeconds) (default: 600)",
    )
    replicas = parser.add_argument_group("replicas on Ray Serve (needs the ray extra: pip install 'punica-hf[ray]')")
    replicas.add_argument(
        "--replicas", type=positive_int, default=None, metavar="N",
        help="serve N copies of the engine on Ray Serve behind one HTTP ingress, each request routed to a replica that "
        "holds its adapter; with --tp K each replica is K ranks on one machine (without it: one engine, no Ray, "
        "unless --ray-address)",
    )
    replicas.add_argument(
        "--ray-address", metavar="ADDR",
        help="the Ray cluster to run the replicas on (default with --replicas: a local one on this machine)",
    )
    replicas.add_argument(
        "--gpus-per-replica", type=float, default=None, metavar="G",
        help="GPUs Ray reserves for each replica (default: the --tp value, 1 without it, when this machine has a "
        "CUDA GPU, else 0)",
    )
    replicas.add_argument(
        "--ray-throughput-optimized", choices=["on", "off"], default=None,
        help="start the local Ray cluster with Ray Serve's throughput-optimized mode "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED: gRPC between Serve's processes, the deployments' code on their main "
        "event loop, and the ingress itself on --port, without Ray Serve's proxy; default: on). With "
        "--ray-address the cluster's own setting holds: set the variable where its nodes start",
    )
    replicas.add_argument(
        "--stream-interval-ms", type=milliseconds, default=50, metavar="MS",
        help="a replica sends a streamed answer's first token at once, then the tokens of each MS milliseconds "
        "together: every item crosses one or two Ray hops, each far dearer than a token (default: 50; 0: each "
        "token alone)",
    )
    limits = parser.add_argument_group("request limits (a request beyond is refused before it reaches the engine)")
    limits.add_argument("--max-request-bytes", type=positive_int, default=4 * 1024 * 1024, metavar="N",
                        help="request body size; beyond, 413 (default: 4194304, 4 MiB)")
    limits.add_argument("--max-prompts-per-request", type=positive_int, default=32, metavar="N",
                        help="prompts in one /v1/completions request (default: 32)")
    limits.add_argument("--max-stop-sequences", type=positive_int, default=16, metavar="N",
                        help="stop strings, and stop token ids, of one request (default: 16 of each)")
    limits.add_argument("--max-stop-length", type=positive_int, default=512, metavar="N",
                        help="characters of one stop string (default: 512)")
    add_device_arguments(parser)
    ranks.add_tp_arguments(parser)


def on_ray(args: argparse.Namespace) -> bool:
    """Whether the options ask for replicas on Ray Serve (``--replicas 1`` too: one replica that Ray restarts)."""
    return args.replicas is not None or args.ray_address is not None


def run(args: argparse.Namespace, console: Console) -> None:
    check_arguments(args)
    if args.tp > 1 and args.as_tp_rank:  # a rank torchrun started, or (ranks 1..) one a Ray Serve replica started
        return _run_rank(args, console)
    if on_ray(args):
        return _run_on_ray(args, console)
    if args.tp > 1:  # this process starts the ranks, which serve
        bind_listener(args.host, args.port).close()  # a busy address fails now, not after the ranks have loaded
        # the ranks' stop: rank 0's drain, its server's answers to slow readers, the ranks' leaving
        return ranks.launch(args.argv, args.tp, stop_seconds=args.drain_seconds + 2 * ANSWERS_SENT_SECONDS)
    return _serve_http(args, console)


def _run_rank(args: argparse.Namespace, console: Console) -> None:
    try:
        rank = ranks.join(args.tp)
        if rank == 0:
            _serve_http(args, console)
        else:
            _follow(args, rank)
    finally:
        ranks.leave()


def _follow(args: argparse.Namespace, rank: int) -> None:
    """A rank > 0 of ``--tp``: run the steps rank 0 decides until rank 0 shuts down (it alone takes signals)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    engine = make_engine(args).start()
    engine.shutdown()  # returns once rank 0 has stopped, or its engine thread has failed
    if engine.error is not None:
        raise RuntimeError(f"rank {rank}'s engine stopped: {engine.error}") from engine.error


def _serve_http(args: argparse.Namespace, console: Console) -> None:
    name = args.served_model_name or args.model
    adapters = served_adapters(args)
    listener = bind_listener(args.host, args.port)  # a busy address fails now, not after the model has loaded

    try:
        import uvicorn

        from ..serving.app import create_app
    except ImportError as error:
        raise ImportError(f"punica-hf serve needs the serve extra: pip install 'punica-hf[serve]' ({error})") from error

    compiling = " (and compiling its steps: minutes)" if args.compile_steps == "on" else ""
    with console.status(f"loading {args.model} and {len(adapters)} adapter(s) on {resolve_device(args.device)}"
                        + compiling):
        engine = make_engine(args)
    app = create_app(
        engine, name, api_key=args.api_key, lora_dirs=args.lora_dir if args.allow_runtime_lora else None,
        limits=request_limits(args),
    )
    port = listener.getsockname()[1]  # the one the system chose for --port 0
    console.print(
        f"serving [bold]{name}[/bold] with adapters {', '.join(sorted(adapters)) or '(none)'} on "
        f"http://{args.host}:{port}/v1" + (" (API key required)" if args.api_key else ""),
        highlight=False,
    )
    host_budget = engine.model.adapter_stats["host_bytes_budget"]
    console.print(f"adapter host tier: {host_budget / 2**30:.1f} GiB ({host_budget} bytes) of CPU memory",
                  highlight=False)
    # uvicorn's own bound is a backstop past the engine's: a client that does not read its answer cannot hold the
    # command up beyond it.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.drain_seconds + ANSWERS_SENT_SECONDS)
    server = uvicorn.Server(config)
    threading.Thread(target=_watch_server, args=(engine, server, args.drain_seconds, args.tp > 1),
                     daemon=True).start()
    server.run(sockets=[listener])
    if args.tp > 1 and engine.error is not None:
        raise RuntimeError(f"the engine stopped: {engine.error}") from engine.error


def _watch_server(engine, server, drain_seconds: float, stop_on_engine_error: bool) -> None:
    """Bound the drain: once uvicorn starts to shut down (a signal), it takes no connection more and waits for its
    requests, each of which still reaches the engine (one being tokenized too); the app shuts the engine down once
    they have all been answered. If the engine still runs ``drain_seconds`` after the signal, shut it down now,
    failing what is left (answered with 503s). ``stop_on_engine_error``: have uvicorn shut down once the engine has
    stopped with an error (its requests have failed already; over --tp ranks, which cannot go on once one has
    failed)."""
    while not server.should_exit:
        if stop_on_engine_error and engine.error is not None:
            server.should_exit = True
        time.sleep(ENGINE_WATCH_SECONDS)
    deadline = time.monotonic() + drain_seconds
    while engine.running and time.monotonic() < deadline:
        time.sleep(ENGINE_WATCH_SECONDS)
    if engine.running:
        engine.shutdown(drain_seconds=0)  # the bound has passed: what is left fails at once


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse inconsistent options before anything loads."""
    from ..serving.app import check_api_key

    try:
        check_api_key(args.api_key)
    except ValueError as error:
        raise ValueError(f"--api-key: {error} (is the variable it comes from set?)") from None
    if args.allow_runtime_lora and not args.lora_dir:
        raise ValueError("--allow-runtime-lora needs at least one --lora-dir to load adapters from")
    if args.lora_dir and not args.allow_runtime_lora:
        raise ValueError("--lora-dir is only used with --allow-runtime-lora")
    for directory in args.lora_dir:
        if not directory.is_dir():
            raise FileNotFoundError(f"--lora-dir {directory}: not a directory")
    name = args.served_model_name or args.model
    if name in served_adapters(args):  # requests naming it would always reach the base model
        raise ValueError(
            f"the adapter name {name!r} is the base model's served name: rename the adapter (--adapter OTHER=...) or "
            "the base model (--served-model-name)"
        )
    if args.ray_throughput_optimized is not None and not on_ray(args):
        raise ValueError("--ray-throughput-optimized is an option of --replicas (Ray Serve)")
    if args.ray_throughput_optimized is not None and args.ray_address is not None:
        raise ValueError("--ray-throughput-optimized sets up the local Ray cluster; with --ray-address, set "
                         f"{RAY_THROUGHPUT_VARIABLE}=1 (or 0) where the cluster's nodes start")
    if args.tp > 1:
        ranks.check_tp_arguments(args)
        if on_ray(args) and args.gpus_per_replica is not None and 0 < args.gpus_per_replica < args.tp:
            raise ValueError(
                f"--tp {args.tp} puts each replica's rank i on its i-th GPU: --gpus-per-replica must be at least "
                f"{args.tp} (or 0, ranks on the CPU)"
            )


def served_adapters(args: argparse.Namespace) -> dict[str, str]:
    """The adapters to serve from the start: ``--adapter``, or the demo's with the demo model."""
    adapters = dict(args.adapter)
    if args.model == DEMO_MODEL and not adapters:
        adapters = {name: str(path) for name, path in demo_adapter_sources().items()}
    return adapters


def request_limits(args: argparse.Namespace):
    from ..serving.app import RequestLimits

    return RequestLimits(
        max_body_bytes=args.max_request_bytes, max_prompts=args.max_prompts_per_request,
        max_stop_sequences=args.max_stop_sequences, max_stop_length=args.max_stop_length,
    )


def make_engine(args: argparse.Namespace):
    """The engine (not started) of the model and adapters ``args`` name; in a Ray replica's process too."""
    from ..model import MultiLoraModel
    from ..serving import DemoTokenizer, Engine, EngineConfig

    device = resolve_device(args.device)
    base, _ = load_model(args.model, device, resolve_dtype(args.dtype, device, args.model), chat_template=False,
                         tp=args.tp)
    model = MultiLoraModel(base, max_adapters=args.max_adapters, max_rank=args.max_rank)
    adapters = served_adapters(args)
    if adapters:
        model.load_adapters(adapters)
    tokenizer = DemoTokenizer() if args.model == DEMO_MODEL else _hf_tokenizer(args.model)
    return Engine(
        model, tokenizer,
        EngineConfig(
            max_queue=args.max_queue, max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
            kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
            cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
            prefix_caching=args.prefix_caching == "on", compile_steps=args.compile_steps == "on",
        ),
    )


def ray_app(options: Mapping[str, object]):
    """The Ray Serve application of ``punica-hf serve``'s options, for ``serve run`` and Ray Serve configs:
    ``serve run punica_hf.cli.serve:ray_app model=demo replicas=2`` (an option's name without its dashes, ``_``
    or ``-`` between words; ``true`` for a switch; a list for a repeatable option)."""
    parser = argparse.ArgumentParser(prog="punica-hf serve")
    register(lambda *_: parser)  # this command's options alone: the same parser as on the command line
    argv = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            if item is True or str(item).lower() == "true":
                argv.append(flag)
            elif item is not False and str(item).lower() != "false":
                argv += [flag, str(item)]
    args = parser.parse_args(argv)
    if args.ray_throughput_optimized is not None:  # serve run's cluster is up already: its nodes' setting holds
        raise ValueError(f"ray_throughput_optimized: set {RAY_THROUGHPUT_VARIABLE}=1 (or 0) where the cluster's "
                         "nodes start; an application cannot change it")
    args.argv = ["serve", *argv]  # the command line of each replica's ranks 1.. under --tp
    return build_ray_app(args)


def build_ray_app(args: argparse.Namespace):
    check_arguments(args)
    try:
        from ..serving.ray import build_app
    except ImportError as error:
        raise ImportError(f"--replicas needs the ray extra: pip install 'punica-hf[ray]' ({error})") from error
    gpus = args.gpus_per_replica
    if gpus is None:  # under --tp, one GPU per rank
        import torch

        gpus = args.tp if args.device != "cpu" and torch.cuda.is_available() else 0
    return build_app(
        partial(make_engine, args), args.served_model_name or args.model, replicas=args.replicas or 1,
        max_adapters=args.max_adapters, api_key=args.api_key,
        lora_dirs=args.lora_dir if args.allow_runtime_lora else None, limits=request_limits(args),
        replica_actor_options={"num_gpus": gpus}, tp=args.tp, stream_interval=args.stream_interval_ms / 1000,
        follower_args=["-m", "punica_hf", *args.argv, ranks.RANK_OPTION] if args.tp > 1 else (),
        drain_seconds=args.drain_seconds,
    )


class StopRequested(Exception):
    """SIGINT or SIGTERM: the command stops (the replicas answer the requests in flight first)."""


def _stop_on_signals() -> None:
    def stop(signum, frame):
        raise StopRequested(signal.Signals(signum).name)
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def _ingress_on_port(args: argparse.Namespace) -> bool:
    """Whether the ingress itself listens on ``--port``: on the local cluster in Ray Serve's throughput-optimized
    mode, whose ingress replicas serve HTTP on ports of their own (Ray Serve's proxy then goes to another port)."""
    return args.ray_address is None and args.ray_throughput_optimized != "off"


def _local_cluster_environment(args: argparse.Namespace) -> dict[str, str]:
    """Ray Serve's settings for the local cluster, read from the environment of its processes (which inherit this
    one's when it starts)."""
    environment = {
        RAY_THROUGHPUT_VARIABLE: "0" if args.ray_throughput_optimized == "off" else "1",
        # In that mode the ingress drains 30 s before it stops, for load balancers to learn that it does: there is
        # none before the local cluster's, only the requests in flight to answer (which it waits for anyway).
        RAY_INGRESS_DRAIN_VARIABLE: os.environ.get(RAY_INGRESS_DRAIN_VARIABLE, "1"),
        # Ray runs its workers 15 nice levels below its own raylet and GCS (and, where the kernel does not group
        # processes by session, below every other process of the command's priority): here the workers are the
        # server, so the replicas run at the command's priority, unless the operator's environment says otherwise.
        RAY_WORKER_NICENESS_VARIABLE: os.environ.get(RAY_WORKER_NICENESS_VARIABLE, "0"),
    }
    if _ingress_on_port(args):
        # The ingress's port range is --port alone: clients reach the ingress without Ray Serve's proxy, one hop
        # fewer. An ingress replica that Ray Serve starts again takes the port back at once (no quarantine).
        lowest, above = RAY_INGRESS_PORT_VARIABLES
        environment.update({lowest: str(args.port), above: str(args.port + 1)})  # Ray Serve's range ends before MAX
        environment[RAY_PORT_QUARANTINE_VARIABLE] = "0"
        environment[RAY_DIRECT_INGRESS_VARIABLE] = "1"
    return environment


def _free_port(host: str) -> int:
    with bind_listener(host, 0) as listener:
        return listener.getsockname()[1]


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` (a wildcard host: on this machine's loopback)."""
    address = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _wait_until_listening(host: str, port: int, timeout: float) -> None:
    """Return once something listens on ``host:port``; ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not _listening(host, port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray Serve's ingress does not listen on {host}:{port}: see Ray Serve's logs "
                               "(/tmp/ray/session_latest/logs/serve)")
        time.sleep(0.1)


def _watch_listener(host: str, port: int, lost_after: float, poll: float = 1.0) -> None:
    """Return never while something listens on ``host:port`` (gaps shorter than ``lost_after`` seconds allowed: an
    ingress that Ray Serve starts again); ``RuntimeError`` once nothing has for ``lost_after`` seconds."""
    silent_since = None
    while True:
        if _listening(host, port):
            silent_since = None
        elif silent_since is None:
            silent_since = time.monotonic()
        elif time.monotonic() - silent_since >= lost_after:
            raise RuntimeError(
                f"nothing has listened on {host}:{port} for {lost_after:.0f} s: Ray Serve could not start the ingress "
                "there again (it gives up a port that another process took meanwhile); stopping"
            )
        time.sleep(poll)


@contextmanager
def _signals_and_environment_restored(variables: tuple[str, ...]):
    """The stop signals' handlers and the environment ``variables`` as they were, once the block ends: for code
    that runs in this process afterwards (the tests call the command in theirs)."""
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    environment = {name: os.environ.get(name) for name in variables}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_on_ray(args: argparse.Namespace, console: Console) -> None:
    app = build_ray_app(args)
    import ray
    from ray import serve

    local = args.ray_address is None  # a cluster of this machine alone, reachable from it alone
    direct = _ingress_on_port(args)
    if local:
        if args.port == 0:
            raise ValueError("--replicas needs a fixed --port (not 0): the ingress and its clients need to know it")
        bind_listener(args.host, args.port).close()  # a busy address fails now, not once the replicas have loaded
    with _signals_and_environment_restored(RAY_CLUSTER_VARIABLES):
        started = deployed = False
        _stop_on_signals()
        try:
            if local:
                os.environ.update(_local_cluster_environment(args))
                ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                         configure_logging=False)
            else:
                ray.init(address=args.ray_address, configure_logging=False)
            _stop_on_signals()  # again: Ray's start put its own SIGTERM handler in place, which aborts the process
            started = True
            # with the ingress on --port, Ray Serve's proxy (which Ray Serve needs) takes another port
            serve.start(http_options={"host": args.host, "port": _free_port(args.host) if direct else args.port})
            with console.status(f"starting {args.replicas or 1} replica(s) of {args.model} on Ray Serve"):
                deployed = True
                _run_app(app, args, direct)
            console.print(
                f"serving [bold]{args.served_model_name or args.model}[/bold] with {args.replicas or 1} replica(s) "
                f"on http://{args.host}:{args.port}/v1" + (" (API key required)" if args.api_key else ""),
                highlight=False,
            )
            if direct:  # until a signal raises StopRequested, or the ingress is lost for good
                _watch_listener(args.host, args.port, INGRESS_LOST_SECONDS)
            else:
                threading.Event().wait()  # until a signal raises StopRequested
        except StopRequested:
            console.print("stopping: the replicas answer the requests in flight first", highlight=False)
        finally:
            for signum in STOP_SIGNALS:  # the drain is not cut short by a second signal
                signal.signal(signum, signal.SIG_IGN)
            _stop_ray(console, deployed=deployed, stop_serve=started and local, drain_seconds=args.drain_seconds)


def _run_app(app, args: argparse.Namespace, direct: bool) -> None:
    """Run ``app`` on Ray Serve; ``direct``: the ingress itself listens on ``--port``, and this returns once it
    does."""
    from ray import serve

    try:
        serve.run(app, name=RAY_APP_NAME, route_prefix="/")
    except Exception as error:
        if not direct:
            raise
        raise RuntimeError(f"{error} (the ingress listens on {args.host}:{args.port} itself: is that port free, and "
                           "outside Ray's worker ports, 10002-19999 by default?)") from error
    if direct:
        _wait_until_listening(args.host, args.port, INGRESS_WAIT_SECONDS)


def _stop_ray(console: Console, *, deployed: bool, stop_serve: bool, drain_seconds: float) -> None:
    """The application first, while Ray Serve still runs, so its replicas drain; then Ray Serve (``stop_serve``:
    only the one this command started, not another cluster's) and this process's Ray connection."""
    import ray
    from ray import serve

    try:
        if deployed:
            _delete_application(drain_seconds)
    except Exception as error:  # Ray Serve failed: what stops next goes on
        console.print(f"stopping the application on Ray Serve: {error}", style="red", highlight=False)
    finally:
        if stop_serve:
            serve.shutdown()
        ray.shutdown()


def _delete_application(drain_seconds: float, poll: float = 0.5) -> None:
    """Remove the application and wait until its replicas have answered the requests in flight. Ray Serve's own
    wait (``serve.delete``) gives up after 60 s, and Ray Serve would then be stopped under replicas still draining
    a longer queue: wait as long as they may drain."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from ..serving.ray import stop_seconds

    serve.delete(RAY_APP_NAME, _blocking=False)
    limit = stop_seconds(drain_seconds) + APPLICATION_STOP_MARGIN_SECONDS
    deadline = time.monotonic() + limit
    while (application := serve.status().applications.get(RAY_APP_NAME)) is not None and \
            application.status != ApplicationStatus.NOT_STARTED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the application was not removed within {limit:.0f} s")
        time.sleep(poll)


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, set up as uvicorn would, for uvicorn to serve on once the model has
    loaded (connections made meanwhile wait); ``OSError`` naming the address if it is in use or not this machine's.

    It listens at once: two sockets with SO_REUSEADDR may both be bound to one port, only one can listen.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen()
    except (OSError, OverflowError) as error:  # OverflowError: a port outside 0-65535
        listener.close()
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise OSError(f"cannot listen on {address}: {getattr(error, 'strerror', None) or error}") from error
    return listener


def _served_adapter(value: str) -> tuple[str, str]:
    """``NAME=SOURCE`` with a NAME the server can serve (the runtime loads' rules) and not ``BASE``, which
    ``generate`` reserves: one adapter folder then works with both commands."""
    name, source = adapter_name_and_path(value)
    try:
        check_adapter_name(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return name, source


def _hf_tokenizer(model_id: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_id)
