"""Serving benchmark: the continuous-batching engine with many adapters, against the same engine on the base model
and against static ``generate()`` batches, on one request stream.

Llama-3-8B shape with random weights (no download), bf16, one GPU. Requests: prompt and output lengths drawn from
a fixed log-normal mix (prompts median 200 tokens, sigma 0.8, 16-1024; outputs median 128, sigma 0.7, 8-512; no
EOS: every request generates exactly its length), each with an adapter drawn uniformly from 32 (and 256) rank-16
adapters made in memory (random factors on q, k, v, o, gate, up, down). Systems, all in this process:

- ``engine, N adapters``: ``punica_hf.serving.Engine`` (transformers' continuous batching, CUDA graphs);
- ``engine, base model``: the same engine, every request on the base model;
- ``static generate()``: batches of 32 in arrival order, left-padded, each generating to its longest output (the
  first ``--static-requests`` requests; the engine is timed on exactly those too, for the ratio);
- ``transformers continuous batching``: transformers' own engine with its defaults (``init_continuous_batching``
  with no settings) on the base model, every request at once (the model is the wrapped one, run without adapters).

The engine's step time is recorded at every step; decode steps (one new token per request) are reported by batch
size, next to the compiled static-cache ``generate()`` step (``--compiled-batches``, prompt of the median length,
the first adapter system's adapters cycled over the rows), timed by ``bench_generate.StepTimer``. The base
engine's decode step nearest 128 requests is set against its bytes floor (``floors``: the weights and the step's
KV cache read once, at the copy bandwidth measured at start): ``targets.base_decode_step_vs_bytes_floor``.

Each engine system is run with every request arriving at once (saturation), then with Poisson arrivals at
fractions of the saturation rate of the first adapter system. Throughput = generated tokens / (last finish - first
arrival); TTFT = first token - arrival; TPOT = mean gap between a request's later tokens. Writes JSON (and the
throughput / p99-latency vs offered load picture, ``serving_plot.py``) under benchmarks/results/.

An option selects another workload instead (its streams, adapters and systems in ``serving_workloads.py``; no
static ``generate()``, compiled step or transformers' engine; saturation only unless ``--rates`` says otherwise).
Run k of every system serves the same requests, drawn with seed ``--seed + k``, and each run records the prompt
tokens served from cached prefixes and the adapter store's loads and evictions:

- ``--mixed-ranks``: 120 adapters of ranks 8, 16, 32 and 64 in turn over 64 GPU slots (``--max-adapters``), each
  request's adapter drawn with Zipf popularity (``--zipf``), so the store swaps adapters while serving; 256
  requests of the default mix; against the base engine.
- ``--long-prompts``: RAG-like prompts (median 1,500 tokens, sigma 0.5, 256-3,500; the default outputs), 64
  requests at once, at most 64 running; 32 adapters against the base engine. ``engine_steps.<system>.mixed.full``:
  the mixed steps that packed at least 95 % of a step's token budget (2,048 on a GPU); the base model's against
  their FLOP floor (``targets.base_full_mixed_step_vs_flop_floor``).
- ``--small-model``: a Llama-3.2-1B-shaped model (16 layers, hidden 2,048), 96 requests of the default mix, at most
  64 running; 8 adapters against the base engine. What a step costs besides its GPU work weighs the most here:
  ``engine_steps`` give each kind of step's GPU time (``median_device_ms``) next to its time.
- ``--shared-prefixes``: each of 32 adapters has a system prompt of 1,024 tokens; a request is its adapter's
  followed by a user part (median 64 tokens, 8-256); 256 requests at saturation, then Poisson at half of it. The
  engine with prefix caching on against off (an engine each): throughput, TTFT, prefix hits, and every request's
  greedy tokens compared between the two (``output_check``; a mismatch is printed loudly), beside a control: the
  saturation requests served twice without caching (bf16 tokens may part with the batches alone).

    python benchmarks/bench_serving.py --output benchmarks/results/bench_serving_h200.json   # ~12 min on an H200
    python benchmarks/bench_serving.py --tiny     # CPU smoke test on a tiny model
    python benchmarks/bench_serving.py --tiny --shared-prefixes    # a workload option's smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import platform
import random
import statistics
import time
from pathlib import Path

import floors
import torch
import transformers
from bench_generate import MODES, StepTimer
# FULL, LengthMix and build_model are also imported from here by bench_ray.py and profile_engine_steps.py
from serving_workloads import (  # noqa: F401
    FULL, TINY, LengthMix, Request, build_model, kernel_config, make_requests, workload_setup,
)
from transformers import GenerationConfig

from punica_hf import MultiLoraModel
from punica_hf.ops import KernelConfig
from punica_hf.serving import Completion, Engine, EngineConfig, SamplingParams, StepRecord

RESULTS = Path(__file__).resolve().parent / "results"


def serve(engine: Engine, requests: list[Request], adapters: list[str | None], rate: float | None,
          seed: int, sampling: bool = False) -> list[Completion]:
    """Submit ``requests`` (at once, or Poisson at ``rate`` per second), wait for all; their completions.
    ``sampling``: every request samples with ``SAMPLED`` (seeded by its index) rather than decoding greedily."""
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in requests:
        arrivals.append(clock)
        clock += rng.expovariate(rate) if rate else 0.0
    start = time.perf_counter()
    handles = []
    for index, (request, arrival) in enumerate(zip(requests, arrivals)):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        adapter = adapters[request.adapter_index % len(adapters)]
        params = SamplingParams(max_new_tokens=request.new_tokens, ignore_eos=True,
                                **(dict(SAMPLED, seed=index) if sampling else {}))
        handles.append(engine.submit(request.prompt, adapter, params))
    return [handle.result() for handle in handles]


def run_engine(engine: Engine, requests: list[Request], adapters: list[str | None], rate: float | None,
               seed: int, sampling: bool = False) -> dict:
    """``serve``'s measurements."""
    return summarize(serve(engine, requests, adapters, rate, seed, sampling), rate)


def run_transformers_cb(hf_model, requests: list[Request]) -> dict:
    """transformers' continuous batching with its defaults, every request at once; tokens/s and TTFT."""
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.new_tokens for r in requests),
                                         eos_token_id=None, pad_token_id=hf_model.config.pad_token_id)
    manager = hf_model.init_continuous_batching(generation_config=generation_config)
    manager.start()
    try:
        start = time.perf_counter()
        submitted = {manager.add_request(r.prompt, max_new_tokens=r.new_tokens): start for r in requests}
        first_token, finished, tokens = {}, 0, 0
        while finished < len(requests):
            output = manager.get_result(timeout=600)
            if output is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing every request")
            first_token.setdefault(output.request_id, time.perf_counter())
            if output.is_finished():
                finished += 1
                tokens += len(output.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    ttft = sorted(first_token[rid] - at for rid, at in submitted.items())
    return {"requests": len(requests), "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99)}


def decode_steps_by_batch(steps: list[StepRecord]) -> dict[int, dict]:
    """Median engine decode step (every request one new token) per batch size seen at least 3 times."""
    by_batch: dict[int, list[StepRecord]] = {}
    for step in steps:
        if step.tokens == step.requests:
            by_batch.setdefault(step.requests, []).append(step)
    return {batch: {"steps": len(records), "median_ms": 1e3 * statistics.median(r.seconds for r in records),
                    "median_prepare_ms": 1e3 * statistics.median(r.prepare_seconds for r in records),
                    "median_device_ms": median_device_ms(records),
                    "median_key_tokens": statistics.median(r.key_tokens for r in records)}
            for batch, records in sorted(by_batch.items()) if len(records) >= 3}


def median_device_ms(records: list[StepRecord]) -> float | None:
    """Median GPU time of the steps' forwards (``StepRecord.device_seconds``); None off CUDA."""
    device = [r.device_seconds for r in records if r.device_seconds is not None]
    return 1e3 * statistics.median(device) if device else None


def mixed_steps(steps: list[StepRecord], step_budget: int) -> dict:
    """Steps that prefill (some request brings more than one token): how many, and their medians; ``full``: those
    that packed at least 95 % of the ``step_budget`` tokens a step may take (a long prompt's chunks)."""
    mixed = [step for step in steps if step.tokens > step.requests]
    if not mixed:
        return {"steps": 0}
    full = [step for step in mixed if step.tokens >= 0.95 * step_budget]
    return {"steps": len(mixed), "median_ms": 1e3 * statistics.median(r.seconds for r in mixed),
            "median_device_ms": median_device_ms(mixed), "median_tokens": statistics.median(r.tokens for r in mixed),
            "total_seconds": sum(r.seconds for r in mixed), "all_steps_seconds": sum(r.seconds for r in steps),
            "full": {"step_budget": step_budget, "steps": len(full)} | ({
                "median_ms": 1e3 * statistics.median(r.seconds for r in full),
                "median_device_ms": median_device_ms(full),
                "median_tokens": statistics.median(r.tokens for r in full)} if full else {})}


def step_summary(records: list[StepRecord], step_budget: int) -> dict:
    return {"decode_by_batch": decode_steps_by_batch(records), "mixed": mixed_steps(records, step_budget)}


def compiled_generate_steps(model: MultiLoraModel, timer: StepTimer, adapters: list[str | None], batches: list[int],
                            prompt_length: int, new_tokens: int, vocab: int) -> dict[int, dict]:
    """The compiled static-cache ``generate()`` decode step at each batch size (``StepTimer.record``'s medians)."""
    results = {}
    for batch in batches:
        input_ids = torch.randint(1, vocab, (batch, prompt_length), device=model.device)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, adapter_ids=[adapters[i % len(adapters)]
                                                                                for i in range(batch)],
                      **MODES["compiled"])
        model.generate(**kwargs)  # compiles at exactly the timed shapes
        results[batch] = timer.record(lambda: model.generate(**kwargs))
        print(f"compiled generate(), batch {batch}: step {results[batch]['period_ms']:.2f} ms", flush=True)
    return results


def summarize(completions: list[Completion], rate: float | None) -> dict:
    if any(c.finish_reason != "length" for c in completions):
        raise RuntimeError(f"unexpected finish: {[c.error or c.finish_reason for c in completions][:3]}")
    tokens = sum(c.completion_tokens for c in completions)
    seconds = max(c.finished_at for c in completions) - min(c.submitted_at for c in completions)
    ttft = sorted(c.time_to_first_token for c in completions)
    tpot = sorted(t for c in completions if (t := c.time_per_output_token) is not None)
    return {
        "offered_requests_per_second": rate,
        "requests": len(completions),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "requests_per_second": len(completions) / seconds,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
    }


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))]


def run_static(model: MultiLoraModel, requests: list[Request], adapters: list[str], batch: int, pad_id: int) -> dict:
    """``generate()`` over batches in arrival order, each left-padded and run to its longest output."""
    device = model.device
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(requests), batch):
        rows = requests[first:first + batch]
        longest = max(len(r.prompt) for r in rows)
        input_ids = torch.tensor([[pad_id] * (longest - len(r.prompt)) + r.prompt for r in rows], device=device)
        mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in rows], device=device)
        new_tokens = max(r.new_tokens for r in rows)
        row_adapters = [adapters[r.adapter_index % len(adapters)] for r in rows]
        model.generate(input_ids, attention_mask=mask, adapter_ids=row_adapters, max_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad_id)  # no EOS: every row runs to the end
        tokens += sum(r.new_tokens for r in rows)  # useful tokens: what each request asked for
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"requests": len(requests), "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)  # --sampling: what chat clients commonly send
# Each workload's defaults of these options, as (full size, --tiny); the options' help refers here.
WORKLOAD_DEFAULTS = {
    "uniform": dict(requests=(160, 24), adapters=([32, 256], [4, 8]), max_adapters=(128, 8), max_running=(128, 8),
                    rates=([0.25, 0.5, 0.8], [0.25, 0.5, 0.8])),
    "mixed-ranks": dict(requests=(256, 24), adapters=([120], [12]), max_adapters=(64, 4), max_running=(128, 8),
                        rates=([], [])),
    "long-prompts": dict(requests=(64, 16), adapters=([32], [4]), max_adapters=(128, 8), max_running=(64, 8),
                         rates=([], [])),
    "shared-prefixes": dict(requests=(256, 24), adapters=([32], [4]), max_adapters=(128, 8), max_running=(128, 8),
                            rates=([0.5], [0.5])),
    "small-model": dict(requests=(96, 24), adapters=([8], [4]), max_adapters=(128, 8), max_running=(64, 8),
                        rates=([], [])),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of this script")
    workload = parser.add_mutually_exclusive_group()
    workload.add_argument("--mixed-ranks", dest="workload", action="store_const", const="mixed-ranks",
                          help="adapters of ranks 8/16/32/64 with Zipf popularity over fewer GPU slots, vs base")
    workload.add_argument("--long-prompts", dest="workload", action="store_const", const="long-prompts",
                          help="RAG-like prompts (median 1,500 tokens, 256-3,500), adapters vs base")
    workload.add_argument("--shared-prefixes", dest="workload", action="store_const", const="shared-prefixes",
                          help="each adapter's requests share a system prompt: prefix caching on vs off")
    workload.add_argument("--small-model", dest="workload", action="store_const", const="small-model",
                          help="a Llama-3.2-1B-shaped model, the default mix: 8 adapters vs base (per-step costs)")
    parser.set_defaults(workload="uniform")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    parser.add_argument("--requests", type=int, help="requests per run (default: WORKLOAD_DEFAULTS)")
    parser.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")],
                        help="adapter set sizes (default: WORKLOAD_DEFAULTS); a workload option takes the first")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter (not --mixed-ranks)")
    parser.add_argument("--zipf", type=float, default=1.0, help="--mixed-ranks: the popularity exponent")
    parser.add_argument("--max-adapters", type=int, help="GPU adapter slots (default: WORKLOAD_DEFAULTS)")
    parser.add_argument("--max-running", type=int, help="requests per batch at most (default: WORKLOAD_DEFAULTS)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x],
                        help="Poisson arrival rates as fractions of the first system's saturation rate (default: "
                             "WORKLOAD_DEFAULTS; empty: saturation only)")
    parser.add_argument("--static-requests", type=int,
                        help="requests timed with static generate() (default: 64; 0: no static generate())")
    parser.add_argument("--static-batch", type=int, default=32, help="rows per static generate() batch")
    parser.add_argument("--compiled-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[32, 128],
                        help="batch sizes of the compiled static-cache generate() step (empty: none)")
    parser.add_argument("--no-transformers-cb", action="store_true",
                        help="skip transformers' own continuous batching (its defaults) on the base model")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the engine without CUDA graphs")
    parser.add_argument("--sampling", action="store_true",
                        help=f"every request samples ({SAMPLED}, seeded) instead of decoding greedily")
    parser.add_argument("--compile-steps", action="store_true",
                        help="every engine compiles its steps (EngineConfig.compile_steps): run with and without")
    parser.add_argument("--kernels", type=kernel_config, default=KernelConfig(),
                        help="KernelConfig fields of the model, e.g. 'fused_norms=true' (default: the defaults)")
    parser.add_argument("--kv-blocks", type=int, help="paged KV blocks (default: sized from free memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path,
                        help="JSON path (default: results/bench_serving[_<workload>][_tiny].json)")
    args = parser.parse_args()
    tiny = args.tiny
    for option, sizes in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, option) is None:
            setattr(args, option, sizes[tiny])
    default_static = 16 if tiny else 64
    args.static_requests = min(default_static if args.static_requests is None else args.static_requests, args.requests)
    args.static_batch = min(args.static_batch, 8) if tiny else args.static_batch
    stem = "bench_serving" + ("" if args.workload == "uniform" else "_" + args.workload.replace("-", "_"))
    args.output = args.output or RESULTS / (stem + ("_tiny.json" if tiny else ".json"))
    return args


def main() -> None:
    args = parse_args()
    if args.workload == "uniform":
        run_uniform(args)
    else:
        run_workload(args)


def run_uniform(args: argparse.Namespace) -> None:
    """The default run: uniform adapters of one rank, static ``generate()``, transformers' continuous batching."""
    tiny = args.tiny
    setup_start = time.perf_counter()
    model, adapter_sets, config = build_model(args)
    step_timer = StepTimer(model.model) if not tiny else None  # before anything compiles (its docstring says why)
    bandwidth = floors.copy_bandwidth(model.device)  # before the engine sizes its KV cache from free memory
    requests = make_requests(args.requests, config.vocab_size, TINY if tiny else FULL, args.seed)
    static_requests = requests[:args.static_requests]
    first_set = adapter_sets[min(adapter_sets)]
    print(f"setup {time.perf_counter() - setup_start:.1f} s: {len(requests)} requests, "
          f"{sum(r.new_tokens for r in requests)} output tokens", flush=True)

    # static generate() first: the engine may switch the model's attention implementation while it runs
    static = {}
    if static_requests:
        run_static(model, static_requests[:args.static_batch][:4], first_set, args.static_batch, config.pad_token_id)
        static = run_static(model, static_requests, first_set, args.static_batch, config.pad_token_id)
        print(f"static generate(): {static['tokens_per_second']:.0f} tokens/s", flush=True)
    median_prompt = sorted(len(r.prompt) for r in requests)[len(requests) // 2]
    compiled_steps = {} if tiny else compiled_generate_steps(
        model, step_timer, first_set, args.compiled_batches, median_prompt, 32, config.vocab_size)

    engine_config = EngineConfig(max_queue=args.requests, max_running=args.max_running, kv_blocks=args.kv_blocks,
                                 cuda_graphs=None if tiny else not args.no_cuda_graphs,
                                 compile_steps=args.compile_steps)
    systems = {f"engine, {n} adapters": names for n, names in adapter_sets.items()} | {"engine, base model": [None]}
    results: dict[str, dict] = {name: {"runs": []} for name in systems}

    step_budget = engine_config.batch_limits(model.device.type)[1]

    def write(**more) -> dict:
        """The report so far: a run cut short by a time limit keeps what it measured."""
        return write_report(args, setup_start, {
            "systems": results,
            "static_generate": static,
            "compiled_generate_steps": compiled_steps,
            "engine_steps": {name: step_summary(records, step_budget) for name, records in step_records.items()},
            "transformers_continuous_batching": transformers_cb,
            "engine_cuda_graphs": graphs,
            **more,
        })

    step_records: dict[str, list[StepRecord]] = {}
    graphs: dict[str, int] = {}  # CUDA graphs of the engine after its start and at the end
    transformers_cb: dict = {}
    engine = Engine(model, config=engine_config)
    started = time.perf_counter()
    with engine:
        print(f"engine started in {time.perf_counter() - started:.1f} s; attention: {engine.attention.path}",
              flush=True)
        recording: list[StepRecord] = []
        engine.add_step_listener(recording.append)
        graphs["at_start"] = engine.stats().cuda_graphs
        print(f"{graphs['at_start']} CUDA graphs captured at start", flush=True)
        # warm-up: first loads (and any capture)
        run_engine(engine, requests[:8], first_set, None, args.seed, args.sampling)
        for name, adapters in systems.items():
            recording.clear()
            results[name]["saturation"] = run_engine(engine, requests, adapters, None, args.seed, args.sampling)
            step_records[name] = list(recording)
            print_saturation(name, results[name]["saturation"], step_records[name])
            write()
        if static_requests:
            results["engine, static subset"] = run_engine(engine, static_requests, first_set, None, args.seed,
                                                          args.sampling)
        saturation_rate = results[f"engine, {min(adapter_sets)} adapters"]["saturation"]["requests_per_second"]
        for fraction in args.rates:
            for name, adapters in systems.items():
                run = run_engine(engine, requests, adapters, fraction * saturation_rate, args.seed + 1,
                                 args.sampling)
                run["fraction_of_saturation"] = fraction
                results[name]["runs"].append(run)
                print_rate_run(name, run)
                write()
        adapter_stats = model.adapter_stats
        graphs["at_end"] = engine.stats().cuda_graphs
    del engine
    if not args.no_transformers_cb:
        if not tiny:
            torch.cuda.empty_cache()  # the engine's KV cache, before transformers sizes its own from free memory
        transformers_cb = run_transformers_cb(model.model, requests)
        print(f"transformers continuous batching (defaults), base: {transformers_cb['tokens_per_second']:.0f} "
              f"tokens/s", flush=True)

    first_name = f"engine, {min(adapter_sets)} adapters"
    targets = {
        "adapters_vs_base_at_saturation": results[first_name]["saturation"]["tokens_per_second"]
        / results["engine, base model"]["saturation"]["tokens_per_second"],
        "ttft_p50_at_saturation_seconds": results[first_name]["saturation"]["ttft_p50"],
    }
    if results[first_name]["runs"]:
        half = min(results[first_name]["runs"], key=lambda run: abs(run["fraction_of_saturation"] - 0.5))
        targets["ttft_p99_at_half_saturation_seconds"] = half["ttft_p99"]
    if static:
        targets["engine_vs_static_generate"] = (results["engine, static subset"]["tokens_per_second"]
                                                / static["tokens_per_second"])
    if transformers_cb:
        targets["adapters_vs_transformers_cb_base"] = (results[first_name]["saturation"]["tokens_per_second"]
                                                       / transformers_cb["tokens_per_second"])
    base_steps = decode_steps_by_batch(step_records["engine, base model"])
    if bandwidth is not None and base_steps:
        batch = min(base_steps, key=lambda b: abs(b - FLOOR_BATCH))
        targets["base_decode_step_vs_bytes_floor"] = {"batch": batch, **floors.against_floor(
            base_steps[batch], floors.decode_bytes_floor(model.model, base_steps[batch]["median_key_tokens"],
                                                         bandwidth))}
    engine_steps = decode_steps_by_batch(step_records[first_name])
    for batch, compiled in compiled_steps.items():
        nearest = min(engine_steps, key=lambda b: abs(b - batch), default=None)
        if nearest is not None:
            targets[f"decode_step_vs_compiled_generate_at_{batch}"] = {
                "engine_batch": nearest, "engine_ms": engine_steps[nearest]["median_ms"],
                "compiled_generate_ms": compiled["period_ms"],
                "ratio": engine_steps[nearest]["median_ms"] / compiled["period_ms"]}
    report = write(saturation_requests_per_second=saturation_rate, targets=targets, adapter_stats=adapter_stats)
    finish(args, report, targets)


# Issue 38's target 2: the base engine's decode step at this batch (the nearest measured) against its bytes floor.
FLOOR_BATCH = 128
# Issue 38's targets: adapters' throughput over the base engine's, at saturation, in the same run.
ADAPTERS_VS_BASE_TARGET = {"mixed-ranks": 0.93, "long-prompts": 0.95, "small-model": 0.95}
SMALL_MODEL_BASE_TARGET = 15_000  # tokens/s of the base engine on --small-model, at least
STORE_COUNTERS = ("hits", "host_loads", "disk_loads", "evictions", "bytes_to_gpu")


def run_workload(args: argparse.Namespace) -> None:
    """A workload option's run: each system at saturation, then at each of ``--rates`` (fractions of the first
    system's saturation rate). Run k of every system serves the same requests, drawn with seed ``--seed + k``: no
    run finds prefixes cached by an earlier one. Systems of the same prefix caching share one engine."""
    setup_start = time.perf_counter()
    model, systems, requests_for = workload_setup(args)
    runs = [requests_for(args.seed + k) for k in range(1 + len(args.rates))]
    warm_up = requests_for(args.seed + len(runs))[:8]  # prompts of its own: nothing it caches is found later
    print(f"setup {time.perf_counter() - setup_start:.1f} s: {args.workload}, {len(runs)} runs of {args.requests} "
          f"requests; the first: {sum(len(r.prompt) for r in runs[0])} prompt tokens, "
          f"{sum(r.new_tokens for r in runs[0])} output tokens", flush=True)
    results: dict[str, dict] = {system.name: {"runs": []} for system in systems}
    step_records: dict[str, list[StepRecord]] = {}
    tokens: dict[str, list[list[tuple[int, ...]]]] = {system.name: [] for system in systems}  # per run, per request
    step_budget = 0
    saturation_rate = None

    def write(**more) -> dict:
        return write_report(args, setup_start, {
            "systems": results,
            "engine_steps": {name: step_summary(records, step_budget) for name, records in step_records.items()},
            **more,
        })

    cuda_graphs = None if args.tiny else not args.no_cuda_graphs
    for prefix_caching, group in itertools.groupby(systems, key=lambda system: system.prefix_caching):
        group = list(group)
        engine_config = EngineConfig(max_queue=max(args.requests, len(warm_up)), max_running=args.max_running,
                                     kv_blocks=args.kv_blocks, cuda_graphs=cuda_graphs, prefix_caching=prefix_caching,
                                     compile_steps=args.compile_steps)
        step_budget = engine_config.batch_limits(model.device.type)[1]
        started = time.perf_counter()
        with Engine(model, config=engine_config) as engine:
            print(f"engine (prefix caching {'on' if prefix_caching else 'off'}) started in "
                  f"{time.perf_counter() - started:.1f} s, {engine.stats().cuda_graphs} CUDA graphs", flush=True)
            recording: list[StepRecord] = []
            engine.add_step_listener(recording.append)
            # first loads (and any capture)
            serve(engine, warm_up, group[0].adapters, None, args.seed, args.sampling)
            for fraction, requests in zip([None, *args.rates], runs):
                for system in group:
                    rate = None if fraction is None else fraction * saturation_rate
                    recording.clear()
                    hits_before, store_before = engine.stats().prefix_hit_tokens, model.adapter_stats
                    completions = serve(engine, requests, system.adapters, rate, args.seed + 1, args.sampling)
                    store_after = model.adapter_stats
                    run = summarize(completions, rate) | {
                        "prompt_tokens": sum(len(r.prompt) for r in requests),
                        "prefix_hit_tokens": engine.stats().prefix_hit_tokens - hits_before,
                        "adapter_store": {key: store_after[key] - store_before[key] for key in STORE_COUNTERS}}
                    tokens[system.name].append([completion.token_ids for completion in completions])
                    if fraction is None:
                        results[system.name]["saturation"] = run
                        step_records[system.name] = list(recording)
                        saturation_rate = saturation_rate or run["requests_per_second"]
                        print_saturation(system.name, run, recording)
                    else:
                        results[system.name]["runs"].append(run | {"fraction_of_saturation": fraction})
                        print_rate_run(system.name, results[system.name]["runs"][-1])
                    write()
            if args.workload == "shared-prefixes" and not prefix_caching:
                # the control: the saturation requests again on the same engine, without caching, in other batches
                again = serve(engine, runs[0], group[0].adapters, None, args.seed + 1, args.sampling)
                control = [[completion.token_ids for completion in again]]
        del engine  # and its KV cache, before the next engine sizes its own from free memory
        gc.collect()
    first, second = (results[system.name] for system in systems)
    ratio = first["saturation"]["tokens_per_second"] / second["saturation"]["tokens_per_second"]
    if args.workload == "shared-prefixes":
        with_caching, without = (tokens[system.name] for system in systems)
        output_check = compare_outputs(with_caching, without)
        output_check["control_without_caching_run_again"] = compare_outputs(without[:1], control, loud=False)
        targets = {"caching_on_vs_off_at_saturation": ratio, "outputs_equal": output_check["equal"]}
        for name, result in results.items():
            targets[name] = {
                "prefix_hit_fraction_at_saturation": (result["saturation"]["prefix_hit_tokens"]
                                                      / result["saturation"]["prompt_tokens"]),
                **{f"ttft_p50_p99_at_{run.get('fraction_of_saturation', 'saturation')}":
                   [run["ttft_p50"], run["ttft_p99"]] for run in [result["saturation"], *result["runs"]]}}
        more = {"output_check": output_check}
    else:
        targets = {"adapters_vs_base_at_saturation": ratio, "target": ADAPTERS_VS_BASE_TARGET[args.workload],
                   "ttft_p50_at_saturation_seconds": {name: r["saturation"]["ttft_p50"] for name, r in results.items()},
                   "full_mixed_step_ms": {name: step_summary(records, step_budget)["mixed"].get("full", {}).get(
                       "median_ms") for name, records in step_records.items()}}
        if args.workload == "long-prompts" and not args.tiny:
            full = step_summary(step_records[systems[1].name], step_budget)["mixed"].get("full", {})
            floor = floors.prefill_flop_floor(model.model, full.get("median_tokens", 0), torch.cuda.get_device_name())
            targets["base_full_mixed_step_vs_flop_floor"] = floors.against_floor(full, floor)
        if args.workload == "small-model":
            targets["base_tokens_per_second"] = second["saturation"]["tokens_per_second"]
            targets["base_tokens_per_second_target"] = SMALL_MODEL_BASE_TARGET
        more = {}
    report = write(saturation_requests_per_second=saturation_rate, targets=targets, adapter_stats=model.adapter_stats,
                   **more)
    finish(args, report, targets)


def compare_outputs(first: list[list[tuple[int, ...]]], second: list[list[tuple[int, ...]]],
                    loud: bool = True) -> dict:
    """Greedy tokens of the same requests with prefix caching on (``first``) and off, run by run: which requests
    differ, and where first. Printed loudly when any do (``loud``): caching must not change what a request computes.
    In bf16 a request's keys and values also depend on the batch that computed them (the matmuls' tiling follows
    the batch's size), so greedy tokens may part after some tokens whatever the cache does: the run's control
    (``control_without_caching_run_again``: the same requests served twice without caching) measures how often."""
    mismatches = [
        {"run": k, "request": i,
         "first_differing_token": next(p for p, (a, b) in enumerate(itertools.zip_longest(x, y)) if a != b)}
        for k, (run_first, run_second) in enumerate(zip(first, second, strict=True))
        for i, (x, y) in enumerate(zip(run_first, run_second, strict=True)) if x != y
    ]
    compared = sum(len(run) for run in first)
    positions = sorted(m["first_differing_token"] for m in mismatches)
    if mismatches and loud:
        banner = "!" * 100
        print(f"{banner}\nOUTPUT MISMATCH: {len(mismatches)} of {compared} requests generated other tokens with "
              f"prefix caching on than off (earliest at token {positions[0]}); first: {mismatches[:3]}\n{banner}",
              flush=True)
    elif loud:
        print(f"outputs equal with prefix caching on and off ({compared} requests)", flush=True)
    return {"requests_compared": compared, "mismatched": len(mismatches), "equal": not mismatches,
            "first_mismatches": mismatches[:10],
            "first_differing_token_min_median": [positions[0], positions[len(positions) // 2]] if positions else None}


def write_report(args: argparse.Namespace, setup_start: float, measured: dict) -> dict:
    """Write the device, versions and settings, then ``measured``, to ``--output``; the report."""
    report = {
        "device": torch.cuda.get_device_name() if not args.tiny else "cpu (--tiny smoke test)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "workload": args.workload,
        "setup": {k: str(v) if isinstance(v, Path) else dataclasses.asdict(v) if isinstance(v, KernelConfig) else v
                  for k, v in vars(args).items()},
        **measured,
        "wall_seconds": time.perf_counter() - setup_start,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    return report


def print_saturation(name: str, run: dict, records: list[StepRecord]) -> None:
    steps = decode_steps_by_batch(records)
    print(f"{name:28s} saturation {run['tokens_per_second']:8.0f} tokens/s, TTFT p50 {run['ttft_p50']:.2f} s, "
          f"p99 {run['ttft_p99']:.2f} s; decode steps (batch: ms[, on the GPU]) "
          + ", ".join(f"{b}: {v['median_ms']:.1f}" + ("" if v["median_device_ms"] is None else
                                                        f" [{v['median_device_ms']:.1f}]")
                      for b, v in steps.items() if b % 16 == 0 or b == max(steps)),
          flush=True)


def print_rate_run(name: str, run: dict) -> None:
    print(f"{name:28s} {run['fraction_of_saturation']:.2f} x saturation: {run['tokens_per_second']:8.0f} tokens/s, "
          f"TTFT p50 {run['ttft_p50']:.3f} s, p99 {run['ttft_p99']:.3f} s, TPOT p99 {run['tpot_p99'] * 1e3:.1f} ms",
          flush=True)


def finish(args: argparse.Namespace, report: dict, targets: dict) -> None:
    print(json.dumps(targets, indent=2))
    print(f"wrote {args.output} after {report['wall_seconds']:.0f} s")
    if not any(system.get("runs") for system in report["systems"].values()):
        return  # saturation only: no line to draw against offered load
    try:
        from serving_plot import plot

        picture = plot(args.output)
    except ImportError as error:  # matplotlib is imported inside plot()
        print(f"no picture ({error}): run benchmarks/serving_plot.py {args.output} where matplotlib is installed")
    else:
        print(f"wrote {picture}")


if __name__ == "__main__":
    main()
