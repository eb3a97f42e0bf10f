"""Serving benchmark: the continuous-batching engine with many adapters, against the same engine on the base model
and against static ``generate()`` batches, on one request stream.

Llama-3-8B shape with random weights (no download), bf16, one GPU. Requests: prompt and output lengths drawn from
a fixed log-normal mix (prompts median 200 tokens, sigma 0.8, 16-1024; outputs median 128, sigma 0.7, 8-512; no
EOS: every request generates exactly its length), each with an adapter drawn uniformly from 32 (and 256) rank-16
adapters made in memory (random factors on q, k, v, o, gate, up, down). Systems, all in this process:

- ``engine, N adapters``: ``punica_hf.serving.Engine`` (transformers' continuous batching, CUDA graphs);
- ``engine, base model``: the same engine, every request on the base model;
- ``static generate()``: batches of 32 in arrival order, left-padded, each generating to its longest output (the
  first ``--static-requests`` requests; the engine is timed on exactly those too, for the ratio).

Each engine system is run with every request arriving at once (saturation), then with Poisson arrivals at
fractions of the saturation rate of the first adapter system. Throughput = generated tokens / (last finish - first
arrival); TTFT = first token - arrival; TPOT = mean gap between a request's later tokens. Writes JSON (and the
throughput / p99-latency vs offered load picture, ``serving_plot.py``) under benchmarks/results/.

    python benchmarks/bench_serving.py            # H200: about 4 minutes
    python benchmarks/bench_serving.py --tiny     # CPU smoke test on a tiny model
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from bench_generate import build_llama, llama_config, random_adapter
from punica_hf import MultiLoraModel
from punica_hf.serving import Completion, Engine, EngineConfig, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class LengthMix:
    """Log-normal lengths, clipped: ``median * exp(sigma * N(0, 1))`` in ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return int(min(max(round(rng.lognormvariate(0, self.sigma) * self.median), self.low), self.high))


FULL = dict(prompts=LengthMix(200, 0.8, 16, 1024), outputs=LengthMix(128, 0.7, 8, 512))
TINY = dict(prompts=LengthMix(24, 0.8, 4, 96), outputs=LengthMix(16, 0.7, 2, 48))


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    new_tokens: int
    adapter_index: int  # which adapter of a system's set (taken modulo the set's size)


def make_requests(count: int, vocab: int, mix: dict, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.randrange(1, vocab) for _ in range(mix["prompts"].draw(rng))], mix["outputs"].draw(rng),
                rng.randrange(1 << 30))
        for _ in range(count)
    ]


def run_engine(engine: Engine, requests: list[Request], adapters: list[str | None], rate: float | None,
               seed: int) -> dict:
    """Submit ``requests`` (at once, or Poisson at ``rate`` per second), wait for all; the measurements."""
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in requests:
        arrivals.append(clock)
        clock += rng.expovariate(rate) if rate else 0.0
    start = time.perf_counter()
    handles = []
    for request, arrival in zip(requests, arrivals):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        adapter = adapters[request.adapter_index % len(adapters)]
        params = SamplingParams(max_new_tokens=request.new_tokens, ignore_eos=True)
        handles.append(engine.submit(request.prompt, adapter, params))
    return summarize([handle.result() for handle in handles], rate)


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


def build_model(args) -> tuple[MultiLoraModel, dict[int, list[str]], LlamaConfig]:
    """The base model wrapped, with ``max(--adapters)`` adapters registered as a0, a1, ... (the distinct random
    factors are ``min(--adapters)`` sets, reused past that: distinct names, slots and transfers, shared values)."""
    torch.manual_seed(0)
    if args.tiny:
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
        device, dtype = torch.device("cpu"), torch.float32
        with device:
            base = LlamaForCausalLM(config).to(dtype).eval()
    else:
        config, device = llama_config(args.layers), torch.device("cuda")
        base = build_llama(config, device)
    base.generation_config.eos_token_id = None  # random weights: no request stops before its length
    counts = sorted(args.adapters)
    generator = torch.Generator(device).manual_seed(1)  # drawn on the GPU: 32 8B-shaped adapters in seconds
    factors = [random_adapter(base, args.rank, generator) for _ in range(counts[0])]
    model = MultiLoraModel(base, max_adapters=args.max_adapters, max_rank=args.rank)
    names = [f"a{i}" for i in range(counts[-1])]
    model.load_adapters({name: factors[i % len(factors)] for i, name in enumerate(names)})
    return model, {count: names[:count] for count in counts}, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of this script")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    parser.add_argument("--requests", type=int, help="requests per run (default: 192; 24 with --tiny)")
    parser.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")],
                        help="adapter set sizes (default: 32,256; 4,8 with --tiny)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--max-adapters", type=int, help="GPU adapter slots (default: 128; 8 with --tiny)")
    parser.add_argument("--max-running", type=int, help="requests per batch at most (default: 128; 8 with --tiny)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.8],
                        help="Poisson arrival rates as fractions of the first adapter system's saturation rate")
    parser.add_argument("--static-requests", type=int, help="requests timed with static generate() (default: 64)")
    parser.add_argument("--static-batch", type=int, default=32, help="rows per static generate() batch")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the engine without CUDA graphs")
    parser.add_argument("--kv-blocks", type=int,
                        help="paged KV blocks (default: transformers sizes the cache from free memory; on the H200 its "
                             "graph warm-up then ran out of memory beside the adapter pool)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="JSON path (default: results/bench_serving[_tiny].json)")
    args = parser.parse_args()
    tiny = args.tiny
    args.requests = args.requests or (24 if tiny else 192)
    args.adapters = args.adapters or ([4, 8] if tiny else [32, 256])
    args.max_adapters = args.max_adapters or (8 if tiny else 128)
    args.max_running = args.max_running or (8 if tiny else 128)
    args.static_requests = min(args.static_requests or (16 if tiny else 64), args.requests)
    args.static_batch = min(args.static_batch, 8) if tiny else args.static_batch
    args.output = args.output or RESULTS / ("bench_serving_tiny.json" if tiny else "bench_serving.json")

    setup_start = time.perf_counter()
    model, adapter_sets, config = build_model(args)
    requests = make_requests(args.requests, config.vocab_size, TINY if tiny else FULL, args.seed)
    static_requests = requests[:args.static_requests]
    first_set = adapter_sets[min(adapter_sets)]
    print(f"setup {time.perf_counter() - setup_start:.1f} s: {len(requests)} requests, "
          f"{sum(r.new_tokens for r in requests)} output tokens", flush=True)

    # static generate() first: the engine may switch the model's attention implementation while it runs
    run_static(model, static_requests[:args.static_batch][:4], first_set, args.static_batch, config.pad_token_id)
    static = run_static(model, static_requests, first_set, args.static_batch, config.pad_token_id)
    print(f"static generate(): {static['tokens_per_second']:.0f} tokens/s", flush=True)

    engine_config = EngineConfig(max_queue=args.requests, max_running=args.max_running, kv_blocks=args.kv_blocks,
                                 cuda_graphs=None if tiny else not args.no_cuda_graphs)
    systems = {f"engine, {n} adapters": names for n, names in adapter_sets.items()} | {"engine, base model": [None]}
    results: dict[str, dict] = {name: {"runs": []} for name in systems}

    def write(**more) -> dict:
        """The report so far: a run cut short by a time limit keeps what it measured."""
        report = {
            "device": torch.cuda.get_device_name() if not tiny else "cpu (--tiny smoke test)",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "systems": results,
            "static_generate": static,
            "wall_seconds": time.perf_counter() - setup_start,
            **more,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
        return report

    with Engine(model, config=engine_config) as engine:
        run_engine(engine, requests[:8], first_set, None, args.seed)  # warm-up: graph captures, first loads
        for name, adapters in systems.items():
            results[name]["saturation"] = run_engine(engine, requests, adapters, None, args.seed)
            print(f"{name:28s} saturation {results[name]['saturation']['tokens_per_second']:8.0f} tokens/s", flush=True)
            write()
        results["engine, static subset"] = run_engine(engine, static_requests, first_set, None, args.seed)
        saturation_rate = results[f"engine, {min(adapter_sets)} adapters"]["saturation"]["requests_per_second"]
        for fraction in args.rates:
            for name, adapters in systems.items():
                run = run_engine(engine, requests, adapters, fraction * saturation_rate, args.seed + 1)
                run["fraction_of_saturation"] = fraction
                results[name]["runs"].append(run)
                print(f"{name:28s} {fraction:.2f} x saturation: {run['tokens_per_second']:8.0f} tokens/s, "
                      f"TTFT p99 {run['ttft_p99']:.3f} s, TPOT p99 {run['tpot_p99'] * 1e3:.1f} ms", flush=True)
                write()
        adapter_stats = model.adapter_stats

    first_name = f"engine, {min(adapter_sets)} adapters"
    half = min(results[first_name]["runs"], key=lambda run: abs(run["fraction_of_saturation"] - 0.5))
    targets = {
        "adapters_vs_base_at_saturation": results[first_name]["saturation"]["tokens_per_second"]
        / results["engine, base model"]["saturation"]["tokens_per_second"],
        "engine_vs_static_generate": results["engine, static subset"]["tokens_per_second"]
        / static["tokens_per_second"],
        "ttft_p99_at_half_saturation_seconds": half["ttft_p99"],
    }
    report = write(saturation_requests_per_second=saturation_rate, targets=targets, adapter_stats=adapter_stats)
    print(json.dumps(targets, indent=2))
    print(f"wrote {args.output} after {report['wall_seconds']:.0f} s")
    try:
        from serving_plot import plot
    except ImportError as error:
        print(f"no picture ({error}): run benchmarks/serving_plot.py {args.output} where matplotlib is installed")
    else:
        print(f"wrote {plot(args.output)}")


if __name__ == "__main__":
    main()
