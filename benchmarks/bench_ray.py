"""Ray Serve's overhead: one replica of ``punica-hf serve`` on Ray Serve against the engine's own HTTP server, on
the same workload (issue 32's targets: throughput at saturation >= 0.95x, median TTFT overhead <= 10 ms).

A model folder is saved once (random weights in bf16, the Llama-3.2-1B shape by default: the smallest model makes
the most tokens per second, so Ray Serve's cost per token weighs the most; ``--shape llama-3-8b``; ``--model DIR``
for an existing folder; ``--smoke``: the demo model on the CPU), with a word-level tokenizer covering its
vocabulary, beside ``--adapters`` rank-16 PEFT adapter folders (random non-zero factors on q, k, v, o, gate, up,
down). Then each system is started as a subprocess, waited for on ``/health``, measured and stopped (SIGTERM, then
its whole process group killed), one after the other:

- ``engine``: ``punica-hf serve --model DIR --adapter a0=... ...``;
- ``ray serve, 1 replica``: the same command with ``--replicas 1`` (a Ray cluster of this machine, no dashboard,
  started and stopped with the command, in Ray Serve's throughput-optimized mode: gRPC between its processes;
  ``--ray-address`` for another cluster, in its own mode);
- ``ray serve, 1 replica, standard mode``: the same in Ray Serve's standard mode (Ray's actor calls between its
  processes), unless ``--smoke`` or ``--ray-address``.

Both get the same requests, streamed (``/v1/completions``, prompts as token ids, ``ignore_eos``: every request
generates exactly its length), adapters round-robin over the adapters and the base model:

- saturation: ``--clients`` concurrent clients over ``--requests`` requests (log-normal prompt and output lengths
  of ``bench_serving.py``, seeded); throughput = generated tokens / wall time;
- TTFT at low load: ``--ttft-requests`` single requests one after the other; TTFT = first streamed event - send.
  Through Ray, split by the replica's ``x-punica-replica-first-ms`` header into its time inside the replica (to
  its answer's first batch) and the rest, outside it (the ingress, which takes the clients itself in the
  throughput-optimized mode, Ray Serve's proxy before it in the standard mode, and their hops).

Each system is warmed up first (one request per adapter and the base, then one concurrent burst). Writes JSON under
benchmarks/results/ and prints a table with the ratios beside their targets. If a server does not come up, the
tail of its log says why.

Each saturation run also reads the engine's step and token counters from ``/metrics`` before and after it: tokens
per engine step (how full its batches were) and milliseconds per step, which split a throughput gap into smaller
batches and slower steps.

``--profile-servers PY_SPY`` records the threads of the process that runs the engine (the engine's server; a Ray
system's replica) with py-spy during the first saturation run of each system (``thread_profile.py``: every
thread's time, which thread holds the GIL, and how much of the time anyone does), into the JSON (the system's
``server_profile``) and a printed table. ``--stream-interval-ms`` sets the Ray systems' interval; several values
(``50,200``) make one Ray system each, measured against the same engine run; so do several
``--ray-worker-niceness`` values (the local cluster's ``RAY_worker_niceness``: ``0,15`` measures serve's priority
for Ray's workers against Ray's own).

The CPU time of the server's process and of every process below it (a local Ray cluster's: the replica, the
ingress, Ray's own) over the first saturation run is in the JSON (``process_cpu``, each a share of one core) and
printed: what a system runs beside its engine on the same CPUs, and at which priority (nice value).

The JSON is written after each system, so a run cut short keeps the systems it measured.

    python benchmarks/bench_ray.py --output benchmarks/results/bench_ray_h200.json   # needs ray[serve] >= 2.60
    python benchmarks/bench_ray.py --smoke        # the demo model on the CPU, < 60 s
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers
from bench_generate import TARGETS, build_llama, llama_3_2_1b_config, llama_config, random_adapter
from bench_serving import FULL, LengthMix, make_requests, percentile
from thread_profile import Recordings, cpu_of_tree, cpu_shares, descendants_of
from peft import LoraConfig
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from punica_hf import demo
from punica_hf.cli.common import milliseconds
from punica_hf.cli.serve import RAY_WORKER_NICENESS_VARIABLE

try:
    from punica_hf.serving.ray import FIRST_BATCH_HEADER, REPLICA_HEADER
except ImportError:  # ray is not installed: main() says so before anything runs
    FIRST_BATCH_HEADER = REPLICA_HEADER = None

RESULTS = Path(__file__).resolve().parent / "results"
REPOSITORY = Path(__file__).resolve().parents[1]
THROUGHPUT_TARGET = 0.95  # Ray Serve / engine, saturation tokens/s, at least
TTFT_OVERHEAD_TARGET_MS = 10.0  # Ray Serve - engine, median TTFT at low load, at most
SMOKE = dict(prompts=LengthMix(8, 0.5, 2, 20), outputs=LengthMix(8, 0.5, 2, 24))  # the demo model: 64 positions
TTFT_NEW_TOKENS = 16  # a low-load request streams this many tokens at most: its first one is what is timed
RAY_SYSTEM = "ray serve, 1 replica"
# /metrics counters that split a saturation run's throughput into steps per second and tokens per step
STEP_COUNTERS = {"punica_engine_steps_total": "steps", "punica_generation_tokens_total": "tokens"}
REPLICA_PROCESS_MARKER = "EngineReplica"  # in the title of a Ray Serve replica's process (ray::ServeReplica:...)
RAY_MODES = {"throughput": "on", "standard": "off"}  # --ray-modes name: serve's --ray-throughput-optimized
SHAPES = {"llama-3.2-1b": llama_3_2_1b_config, "llama-3-8b": lambda: llama_config(32)}


def save_random_model(config: LlamaConfig, folder: Path) -> None:
    """Random bf16 weights (made on the GPU when there is one: seconds) and a word-level tokenizer whose words
    ``w<id>`` cover the whole vocabulary, so any generated id decodes; ``</s>`` (id 1) ends a sequence."""
    config.bos_token_id, config.eos_token_id = 0, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_llama(config, device)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, config.vocab_size)}}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def save_random_adapters(model_config, count: int, rank: int, base_path: str, folder: Path) -> dict[str, Path]:
    """``count`` PEFT folders ``a0``, ``a1``, ... under ``folder`` with random rank-``rank`` factors (different
    for each) on every targeted projection of the model ``model_config`` describes."""
    with torch.device("meta"):  # the modules' names and sizes, no weights
        shape = AutoModelForCausalLM.from_config(model_config)
    generator = torch.Generator().manual_seed(1)
    paths = {}
    for index in range(count):
        weights = random_adapter(shape, rank, generator)
        path = paths[f"a{index}"] = folder / f"a{index}"
        LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, task_type="CAUSAL_LM",
                   base_model_name_or_path=base_path).save_pretrained(path)
        tensors = {}
        for module, factors in weights.modules.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = factors.lora_a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = factors.lora_b.contiguous()
        save_file(tensors, path / "adapter_model.safetensors")
    return paths


@dataclass(frozen=True)
class Call:
    """One streamed completion: prompt token ids, tokens to generate, the ``model`` field (an adapter or the
    base model's served name)."""

    prompt: list[int]
    new_tokens: int
    model: str

    def body(self) -> dict:
        return {"model": self.model, "prompt": self.prompt, "max_tokens": self.new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}


@dataclass(frozen=True)
class Streamed:
    sent: float
    first_event: float
    tokens: int
    replica: str | None  # the Ray Serve replica that answered (its response header), None from the engine's server
    replica_first_ms: float | None  # the replica's own time to the answer's first batch (its header); None: no Ray


async def stream(client: httpx.AsyncClient, call: Call) -> Streamed:
    """Send ``call``; when its first event came, the tokens its usage event counts (which must be the tokens
    asked for: ``ignore_eos``) and the replica that answered."""
    sent = time.perf_counter()
    first_event, last_payload = None, None
    async with client.stream("POST", "/v1/completions", json=call.body()) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code} for {call.model}: {(await response.aread())[:500]!r}")
        replica = response.headers.get(REPLICA_HEADER)
        replica_first_ms = response.headers.get(FIRST_BATCH_HEADER)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first_event is None:
                first_event = time.perf_counter()
            if line == "data: [DONE]":
                break
            last_payload = line
    usage = json.loads(last_payload[len("data: "):]).get("usage") if last_payload else None
    if first_event is None or not usage or usage["completion_tokens"] != call.new_tokens:
        raise RuntimeError(f"the stream for {call.model} ended without {call.new_tokens} tokens: {last_payload!r}")
    return Streamed(sent, first_event, usage["completion_tokens"], replica,
                    None if replica_first_ms is None else float(replica_first_ms))


async def run_concurrently(base_url: str, calls: list[Call], clients: int) -> dict:
    """``clients`` clients, each sending its next call when the last one ends, until ``calls`` are done."""
    pending = list(reversed(calls))
    done: list[Streamed] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            done.append(await stream(client, pending.pop()))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        cpu_start, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(min(clients, len(calls)))))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(result.tokens for result in done)
    ttft = sorted(result.first_event - result.sent for result in done)
    return {"requests": len(done), "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
            # near 1, the client process, not the server, may be what limits the throughput
            "client_cpu_share": cpu_seconds / seconds, "replicas": replicas_of(done)}


async def run_one_by_one(base_url: str, calls: list[Call]) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        results = [await stream(client, call) for call in calls]
    ttft = sorted(result.first_event - result.sent for result in results)
    summary = {"requests": len(results), "ttft_p50_ms": 1e3 * statistics.median(ttft),
               "ttft_p90_ms": 1e3 * percentile(ttft, 90), "ttft_min_ms": 1e3 * ttft[0],
               "replicas": replicas_of(results)}
    in_replica = [result.replica_first_ms for result in results if result.replica_first_ms is not None]
    if in_replica:  # through Ray: the part of TTFT spent inside the replica, and the rest (Ray Serve's hops)
        hops = sorted(1e3 * (result.first_event - result.sent) - result.replica_first_ms for result in results
                      if result.replica_first_ms is not None)
        summary |= {"in_replica_p50_ms": statistics.median(in_replica),
                    "outside_replica_p50_ms": statistics.median(hops)}
    return summary


def engine_counters(base_url: str) -> dict[str, float]:
    """The engine's step and generated-token counters from the server's ``/metrics`` (through Ray Serve: the one
    replica's)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in STEP_COUNTERS:
            counters[STEP_COUNTERS[name]] = float(value)
    if len(counters) != len(STEP_COUNTERS):
        raise RuntimeError(f"{base_url}/metrics lacks {sorted(set(STEP_COUNTERS) - set(counters))}")
    return counters


def with_steps(run: dict, before: dict[str, float], after: dict[str, float]) -> dict:
    """``run`` with the engine's steps over it: their number, the tokens each generated on average (how full the
    batches were) and the run's time per step (steps and any idle time between them)."""
    steps = after["steps"] - before["steps"]
    tokens = after["tokens"] - before["tokens"]
    return run | {"engine_steps": steps, "tokens_per_step": tokens / steps if steps else 0.0,
                  "ms_per_step": 1e3 * run["seconds"] / steps if steps else 0.0}


def replicas_of(results: list[Streamed]) -> list[str]:
    return sorted({result.replica for result in results if result.replica is not None})


def measure(base_url: str, saturation_calls: list[Call], ttft_calls: list[Call], clients: int, served: list[str],
            repeats: int, start_profile=None, process_root: int | None = None) -> dict:
    """Warm-up, saturation ``repeats`` times (the run of median throughput is the result), then TTFT at low load,
    against the server at ``base_url``. ``start_profile``: called as the first saturation run starts, it returns
    what to call once that run ends, which returns the profile (``server_profile`` in the result).
    ``process_root``: the server's process; the CPU time of it and every process below it over the first
    saturation run (``process_cpu``: each one's share of a core; a system that runs more beside its engine shows
    here)."""
    warm_up = [Call(saturation_calls[0].prompt, 2, model) for model in served]
    asyncio.run(run_one_by_one(base_url, warm_up))  # each adapter's first load (and a replica claims it)
    burst = [Call(c.prompt, min(c.new_tokens, TTFT_NEW_TOKENS), c.model) for c in saturation_calls[:clients]]
    asyncio.run(run_concurrently(base_url, burst, clients))
    runs, profile, process_cpu = [], None, None
    for repeat in range(repeats):
        finish_profile = start_profile() if start_profile is not None and repeat == 0 else None
        before = engine_counters(base_url)
        cpu_before = cpu_of_tree(process_root) if process_root is not None and repeat == 0 else None
        read_at = time.perf_counter()
        run = asyncio.run(run_concurrently(base_url, saturation_calls, clients))
        if cpu_before is not None:
            process_cpu = cpu_shares(cpu_before, cpu_of_tree(process_root), time.perf_counter() - read_at)
        runs.append(with_steps(run, before, engine_counters(base_url)))
        if finish_profile is not None:
            profile = finish_profile()
    saturation = sorted(runs, key=lambda run: run["tokens_per_second"])[(repeats - 1) // 2]
    low_load = asyncio.run(run_one_by_one(base_url, ttft_calls))
    # every run in order, beside the median one: a system that slows from run to run shows here
    result = {"saturation": saturation, "saturation_tokens_per_second": [run["tokens_per_second"] for run in runs],
              "saturation_ms_per_step": [run["ms_per_step"] for run in runs],
              "low_load": low_load}
    if process_cpu is not None:
        result["process_cpu"] = process_cpu
    return result if profile is None else result | {"server_profile": profile}


class ServerProcess:
    """``python -m punica_hf serve ARGS`` in its own process group on a free port of 127.0.0.1; ``stop()`` ends
    it and everything it started (a local Ray cluster's processes join the command's group)."""

    def __init__(self, name: str, args: list[str], log_path: Path, start_timeout: float,
                 environment: dict[str, str] | None = None) -> None:
        self.name, self.log_path = name, log_path
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "punica_hf", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        environment = {**os.environ, **(environment or {}), "RAY_USAGE_STATS_ENABLED": "0",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            cwd=REPOSITORY, start_new_session=True)
        print(f"{name}: {' '.join(command[1:])}", flush=True)
        try:
            self._wait_for_health(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_for_health(self, timeout: float) -> None:
        started = time.perf_counter()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} before it served:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    print(f"{self.name}: up after {time.perf_counter() - started:.1f} s", flush=True)
                    return
            except httpx.TransportError:
                pass
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  | {line}" for line in text[-lines:]) + f"\n  (whole log: {self.log_path})"

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM (the command drains and stops Ray Serve), then SIGKILL to the whole group after ``grace``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: still running {grace:.0f} s after SIGTERM: killed", flush=True)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what the command started and left behind, if anything
        except ProcessLookupError:
            pass
        self.process.wait()


def run_system(name: str, serve_args: list[str], workdir: Path, start_timeout: float, py_spy: str | None = None,
               profile_seconds: float = 0, environment: dict[str, str] | None = None, **workload) -> dict:
    """Start system ``name`` (its command's ``environment`` added to this one's), measure it, stop it; ``py_spy``:
    record the threads of the process that runs its engine (the command's own, or its Ray replica's with
    ``--replicas``)."""
    server = ServerProcess(name, serve_args, workdir / f"{re.sub(r'[^a-z0-9]+', '_', name)}.log", start_timeout,
                           environment)

    def start_profile():
        pid = server.process.pid
        if "--replicas" in serve_args:
            replicas = descendants_of(pid, REPLICA_PROCESS_MARKER)
            if len(replicas) != 1:
                raise RuntimeError(f"{name}: expected one Ray Serve replica process to profile, found {replicas}")
            pid = replicas[0]
        return Recordings(py_spy, pid, profile_seconds, workdir).finish

    try:
        result = measure(server.base_url, start_profile=start_profile if py_spy is not None else None,
                         process_root=server.process.pid, **workload)
    except (KeyboardInterrupt, SystemExit):  # ^C, or a time limit's SIGTERM: the log says nothing of it
        print(f"{name}: stopped while measured", flush=True)
        raise
    except BaseException:
        print(f"{name} failed while measured; its log:\n{server.log_tail()}", flush=True)
        raise
    finally:
        server.stop()
    runs = ", ".join(f"{tokens_per_second:.0f}" for tokens_per_second in result["saturation_tokens_per_second"])
    step_ms = ", ".join(f"{ms:.2f}" for ms in result["saturation_ms_per_step"])
    print(f"{name}: {runs} tokens/s at saturation ({result['saturation']['tokens_per_step']:.1f} tokens per engine "
          f"step in the median run; {step_ms} ms per step), TTFT p50 at low load "
          f"{result['low_load']['ttft_p50_ms']:.1f} ms", flush=True)
    shares = result["process_cpu"]
    print(f"{name}: CPU over the first saturation run, in cores: {sum(s['cpu_share'] for s in shares):.2f} in all; "
          + "; ".join(f"{share['cpu_share']:.2f} {share['process']}" + (f" (nice {share['nice']})" if share['nice']
                                                                           else "") for share in shares[:6]),
          flush=True)
    return result


def check_replicas(result: dict, expected: int, name: str) -> None:
    """``name``'s answers came from ``expected`` Ray Serve replicas (none: not through Ray Serve), or the
    comparison would not be the one it says."""
    replicas = sorted({*result["saturation"]["replicas"], *result["low_load"]["replicas"]})
    if len(replicas) != expected:
        raise RuntimeError(f"{name}: answers from {len(replicas)} Ray Serve replica(s) {replicas}, not {expected}")


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for package in ("ray", "httpx"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def compare(ray: dict, engine: dict) -> dict:
    """A Ray system's measurements against the engine's server's, beside issue 32's targets."""
    ratio = ray["saturation"]["tokens_per_second"] / engine["saturation"]["tokens_per_second"]
    overhead = ray["low_load"]["ttft_p50_ms"] - engine["low_load"]["ttft_p50_ms"]
    return {"throughput_ratio": ratio, "throughput_target": THROUGHPUT_TARGET,
            "throughput_met": ratio >= THROUGHPUT_TARGET, "ttft_p50_overhead_ms": overhead,
            "ttft_overhead_target_ms": TTFT_OVERHEAD_TARGET_MS, "ttft_met": overhead <= TTFT_OVERHEAD_TARGET_MS}


def print_table(systems: dict, comparisons: dict) -> None:
    print("| system | tokens/s at saturation | TTFT p50 / p90 at saturation | TTFT p50 / p90 at low load |")
    print("|---|---|---|---|")
    for name, result in systems.items():
        saturation, low_load = result["saturation"], result["low_load"]
        print(f"| {name} | {saturation['tokens_per_second']:.0f} | {saturation['ttft_p50_ms']:.0f} / "
              f"{saturation['ttft_p90_ms']:.0f} ms | {low_load['ttft_p50_ms']:.1f} / "
              f"{low_load['ttft_p90_ms']:.1f} ms |")
    for name, comparison in comparisons.items():
        ratio, overhead = comparison["throughput_ratio"], comparison["ttft_p50_overhead_ms"]
        print(f"{name}: throughput / engine's {ratio:.3f} (target >= {THROUGHPUT_TARGET}: "
              f"{'met' if comparison['throughput_met'] else 'missed'}); median TTFT overhead at low load "
              f"{overhead:.1f} ms (target <= {TTFT_OVERHEAD_TARGET_MS:.0f} ms: "
              f"{'met' if comparison['ttft_met'] else 'missed'})")


def print_profile(name: str, profile: dict) -> None:
    """Each recording's threads by share of its samples, with their three largest frames."""
    for mode, summary in profile.items():
        held = f", the GIL held {summary['gil_held_share']:.0%} of the time" if "gil_held_share" in summary else ""
        print(f"\n{name}, the engine process's threads ({mode}: {summary.get('samples', 0)} samples{held})")
        if "error" in summary:
            print(f"  {summary['error']}")
            continue
        for thread in summary["threads"][:8]:
            frames = "; ".join(f"{frame['frame']} {frame['share']:.0%}" for frame in thread["frames"][:3])
            print(f"  {thread['share']:5.1%}  {thread['thread'][:40]:40s}  {frames[:160]}")


def nice_value(text: str) -> int:
    value = int(text)
    if not -20 <= value <= 19:
        raise ValueError(f"a nice value is in [-20, 19], got {value}")
    return value


def distinct_values(parser: argparse.ArgumentParser, option: str, text: str, parse: Callable[[str], int]) -> list:
    """``option``'s comma-separated values, each read by ``parse``; the parser's error (exit 2) for a bad or repeated
    one, before any system runs."""
    try:
        values = [parse(value) for value in text.split(",")]
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(f"{option}: {error}")
    if len(set(values)) != len(values):
        parser.error(f"{option}: distinct values, got {text!r}")
    return values


def plan_systems(serve_args: list[str], intervals: list[int | None], nice_values: list[int | None],
                 modes: list[str], ray_address: str | None) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    """``{name: (serve's arguments, environment added)}`` of every system, the engine's own server first: one Ray
    system per stream interval, worker niceness and Ray Serve mode (None: serve's default), the first under the
    plain name (what ``punica-hf serve --replicas`` does unless told), the others named by what differs. With
    ``ray_address``: that cluster in its own mode and priority."""
    systems = {"engine": (serve_args, None)}
    for interval, nice in itertools.product(intervals, nice_values):
        ray_args = [*serve_args, "--replicas", "1"]
        if interval is not None:
            ray_args += ["--stream-interval-ms", str(interval)]
        environment = None if nice is None else {RAY_WORKER_NICENESS_VARIABLE: str(nice)}
        name = RAY_SYSTEM + (f", {interval} ms stream interval" if interval != intervals[0] else "") + (
            f", workers at nice {nice}" if nice != nice_values[0] else "")
        if ray_address:
            systems[name] = ([*ray_args, "--ray-address", ray_address], None)
        for mode in modes:  # none with ray_address
            systems[name if mode == modes[0] else f"{name}, {mode} mode"] = (
                [*ray_args, "--ray-throughput-optimized", RAY_MODES[mode]], environment)
    return systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b",
                       help="shape of the random-weights model (default: llama-3.2-1b)")
    model.add_argument("--model", type=Path, metavar="DIR", help="an existing model folder (with its tokenizer)")
    model.add_argument("--smoke", action="store_true", help="the demo model on the CPU: a smoke test of this script")
    parser.add_argument("--adapters", type=int, help="rank-16 adapters (default: 8; 2 with --smoke)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--clients", type=int, help="concurrent clients at saturation (default: 64; 4 with --smoke)")
    parser.add_argument("--requests", type=int, help="requests at saturation (default: 512; 12 with --smoke)")
    parser.add_argument("--repeats", type=int, help="saturation runs of each system, the median one kept (default: "
                        "3; 1 with --smoke)")
    parser.add_argument("--ttft-requests", type=int, help="sequential requests at low load (default: 50; 5 with "
                        "--smoke)")
    parser.add_argument("--max-running", type=int, help="passed to both servers (default: theirs)")
    parser.add_argument("--ray-modes", default=None,
                        help="Ray Serve modes to measure, each a system: 'throughput' (RAY_SERVE_THROUGHPUT_OPTIMIZED, "
                        "serve's default), 'standard' (default: both; the first only with --smoke; none with "
                        "--ray-address: the cluster's own)")
    parser.add_argument("--ray-address",
                        help="--ray-address of the Ray system (default: none, a cluster of this machine started "
                        "and stopped with the command)")
    parser.add_argument("--start-timeout", type=float, help="seconds for a server to answer /health (default: 600; "
                        "120 with --smoke)")
    parser.add_argument("--workdir", type=Path, help="where the model, adapters and server logs go (default: a "
                        "temporary folder, removed at the end unless a server failed)")
    parser.add_argument("--stream-interval-ms", metavar="MS[,MS...]",
                        help="the Ray systems' --stream-interval-ms; several: one Ray system each (default: serve's)")
    parser.add_argument("--ray-worker-niceness", metavar="N[,N...]",
                        help="the local Ray cluster's worker priority (RAY_worker_niceness; serve's default: 0, Ray's "
                        "own: 15); several: one Ray system each")
    parser.add_argument("--profile-servers", metavar="PY_SPY",
                        help="the py-spy executable: record the threads of each system's engine process (the Ray "
                        "replica's) during its first saturation run")
    parser.add_argument("--profile-seconds", type=float, default=8.0,
                        help="seconds of that recording (default: 8; keep it within the run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="JSON path (default: results/bench_ray.json; "
                        "results/bench_ray_smoke.json with --smoke)")
    args = parser.parse_args()
    if REPLICA_HEADER is None:
        parser.error("the Ray system needs the ray extra here: pip install 'punica-hf[ray]'")
    smoke = args.smoke
    args.adapters = args.adapters if args.adapters is not None else (2 if smoke else 8)
    args.clients = args.clients or (4 if smoke else 64)
    args.requests = args.requests or (12 if smoke else 512)
    args.ttft_requests = args.ttft_requests or (5 if smoke else 50)
    args.repeats = args.repeats or (1 if smoke else 3)
    args.start_timeout = args.start_timeout or (120 if smoke else 600)
    args.output = args.output or RESULTS / ("bench_ray_smoke.json" if smoke else "bench_ray.json")
    modes = [] if args.ray_address else (args.ray_modes or ",".join(RAY_MODES)).split(",")
    if any(mode not in RAY_MODES for mode in modes) or len(set(modes)) != len(modes):
        parser.error(f"--ray-modes: distinct names among {', '.join(RAY_MODES)}, got {args.ray_modes!r}")
    if args.profile_servers and args.ray_address:
        parser.error("--profile-servers records a replica of the local cluster: not with --ray-address")
    if args.profile_servers and not shutil.which(args.profile_servers):
        parser.error(f"--profile-servers: no executable py-spy at {args.profile_servers!r}")
    if not args.profile_seconds > 0:
        parser.error(f"--profile-seconds must be positive, got {args.profile_seconds}")
    intervals: list[int | None] = [None]
    if args.stream_interval_ms is not None:  # as serve reads each, checked before any system runs
        intervals = distinct_values(parser, "--stream-interval-ms", args.stream_interval_ms, milliseconds)
    nice_values: list[int | None] = [None]
    if args.ray_worker_niceness is not None:
        if args.ray_address:
            parser.error("--ray-worker-niceness sets the local cluster's: not with --ray-address")
        nice_values = distinct_values(parser, "--ray-worker-niceness", args.ray_worker_niceness, nice_value)
    if smoke and args.ray_modes is None:
        modes = modes[:1]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's SIGTERM still stops the servers

    setup_start = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_ray_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if smoke:
        served_model, config = "demo", demo.load_base_model().config
        model_args = ["--model", "demo", "--device", "cpu", "--served-model-name", "demo"]
    else:
        if args.model is None:
            config = SHAPES[args.shape]()
            args.model = workdir / "model"
            save_random_model(config, args.model)
        config = AutoConfig.from_pretrained(args.model)
        served_model = "base-model"
        model_args = ["--model", str(args.model), "--served-model-name", served_model]
    adapters = save_random_adapters(config, args.adapters, args.rank, str(args.model or "demo"), workdir / "adapters")
    serve_args = [*model_args, *(arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}"))]
    serve_args += ["--max-rank", str(args.rank)]
    if args.max_running:
        serve_args += ["--max-running", str(args.max_running)]
    served = [*adapters, served_model]
    requests = make_requests(args.requests + args.ttft_requests, config.vocab_size, SMOKE if smoke else FULL,
                             args.seed)
    calls = [Call(r.prompt, r.new_tokens, served[i % len(served)]) for i, r in enumerate(requests)]
    workload = dict(saturation_calls=calls[:args.requests], clients=args.clients, served=served, repeats=args.repeats,
                    ttft_calls=[Call(c.prompt, min(c.new_tokens, TTFT_NEW_TOKENS), c.model)
                                for c in calls[args.requests:]])
    print(f"setup {time.perf_counter() - setup_start:.1f} s in {workdir}: {args.requests} requests at saturation "
          f"({sum(c.new_tokens for c in workload['saturation_calls'])} output tokens), {args.ttft_requests} at low "
          f"load, {len(adapters)} adapters and the base model", flush=True)

    systems = plan_systems(serve_args, intervals, nice_values, modes, args.ray_address)
    results, comparisons = {}, {}
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not smoke else "cpu",
        "versions": versions(),
        "setup": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "model": {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                  "layers": config.num_hidden_layers},
        "systems": results,
        "planned_systems": list(systems),  # more than in "systems": the run was cut short
        "comparisons": comparisons,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name, (system_args, environment) in systems.items():
        results[name] = result = run_system(name, system_args, workdir, args.start_timeout,
                                            py_spy=args.profile_servers, profile_seconds=args.profile_seconds,
                                            environment=environment, **workload)
        check_replicas(result, 0 if name == "engine" else 1, name)
        if name != "engine":
            comparisons[name] = compare(result, results["engine"])
        if "server_profile" in result:
            print_profile(name, result["server_profile"])
        report |= {"comparison": comparisons.get(RAY_SYSTEM), "wall_seconds": time.perf_counter() - setup_start}
        args.output.write_text(json.dumps(report, indent=2))  # after every system: a run cut short keeps these
    print_table(results, comparisons)
    for name, result in results.items():
        if result["saturation"]["client_cpu_share"] > 0.8:
            print(f"note: the client process was busy {result['saturation']['client_cpu_share']:.0%} of the "
                  f"{name} saturation run: the client may be what limits it")
    print(f"wrote {args.output} after {report['wall_seconds']:.0f} s")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
