"""End-to-end generate() throughput: base model vs punica_hf (1, 8 or 32 distinct adapters per batch) vs PEFT.

Llama-3-8B shape with random weights (no download), bf16, on one GPU; batch 32, LoRA rank 16 on q,k,v,o,gate,up,down.
All systems run in one process on the same prompts, each after a warm-up at exactly its timed shapes (a static
cache is sized by prompt + new tokens, so any other warm-up would recompile inside the timed run); tokens/s =
batch * new tokens / wall time; every ratio is to the base model in the same mode, same case, same run (eager
generate is bound by the host CPU: only ratios inside one run mean anything).

Cases: ``decode`` (prompt 128, 64 new tokens) and ``prefill-heavy`` (prompt 1024, 16 new tokens). Modes: ``eager``
(dynamic cache) and ``compiled`` (static cache: transformers compiles the decode step, CUDA graphs). Also measured:
GPU memory (model weights, the LoRA pool's used/total bytes, each system's peak allocation) and, with ``--profile``,
a per-step breakdown of a few decode steps under torch.profiler: CUDA time in punica_hf's LoRA kernels vs all other
kernels, host time inside the compiled call, launches per step (for the prefill-heavy case, the same over one whole
call, with its prefill's time). Compiled decode steps of the base and the most
distinct adapters are also timed without a profiler (``--step-timing``: step period, GPU time from the call's entry,
host time in the call), since the profiler inflates every graph launch's host time.

    # the full set (~4 min on an H200, most of it two torch.compile warm-ups):
    python benchmarks/bench_generate.py --modes eager,compiled --prefill-heavy eager --profile compiled
    # eager only (~1.5 min):
    python benchmarks/bench_generate.py --modes eager --profile none
    # CPU smoke test of every code path (tiny model, seconds):
    python benchmarks/bench_generate.py --tiny --modes eager,compiled --prefill-heavy eager,compiled --profile compiled

``bench_adapters.py`` imports the model, adapter and timing helpers defined here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from punica_hf import MultiLoraModel
from punica_hf.formats import AdapterWeights, LoraAdapterConfig, ModuleLora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = {"eager": {}, "compiled": {"cache_implementation": "static"}}  # generate() kwargs of each mode
COPY_BANDWIDTH_BYTES_PER_S = 4.30e12  # H200 device-to-device copy (ANCHORS.md): the LoRA bytes floor per step
# punica_hf's kernels: everything in csrc/ lives in namespace punica (Inductor's generated kernels start with
# "triton" and may carry "expand" in their fused-op names, so they never count as LoRA).
LORA_KERNEL = re.compile(r"\bpunica::")


# ------------------------------------------------------------------------------------------- shared helpers
def llama_config(layers: int, tiny: bool = False) -> LlamaConfig:
    """Llama-3-8B's shape (hidden 4096, GQA 32/8 heads of 128, MLP 14336, vocab 128256), or a tiny one for CPU."""
    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, pad_token_id=0)


def llama_3_2_1b_config() -> LlamaConfig:
    """Llama-3.2-1B's shape (hidden 2048, 16 layers, GQA 32/8 heads of 64, MLP 8192, vocab 128256, tied
    embeddings), positions cut to 4096."""
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=500000.0)


def build_llama(config: LlamaConfig, device: torch.device) -> LlamaForCausalLM:
    """Random weights, made on ``device`` directly in bf16 (an 8B model in fp32 first would double the time)."""
    with device:
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()


def random_adapter(model: torch.nn.Module, rank: int, generator: torch.Generator) -> AdapterWeights:
    """Random rank-``rank`` factors on every targeted projection (small B so generations stay finite).

    Drawn on the generator's device (fast on a GPU), returned on the CPU in bf16, where adapter sources live.
    """
    device = generator.device
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            lora_a = torch.randn(rank, module.in_features, generator=generator, device=device) / module.in_features**0.5
            lora_b = torch.randn(module.out_features, rank, generator=generator, device=device) * 0.01
            modules[name] = ModuleLora(lora_a.to("cpu", torch.bfloat16), lora_b.to("cpu", torch.bfloat16))
    return AdapterWeights(modules=modules, config=LoraAdapterConfig(r=rank, lora_alpha=rank), source="random")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict:
    """The GPU and the versions a result was measured with."""
    import peft  # imported here: bench_adapters.py uses this module without PEFT systems

    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"none (CPU, {platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": platform.python_version(),
    }


class StepClock(BaseStreamer):
    """A generate() streamer that timestamps each push: the prompt, then one token per step (after prefill first).

    generate() moves each step's tokens to the host before pushing them, so the timestamps are step completions.
    ``on_put`` is called after each timestamp (to step a profiler, or to start work at a chosen step).
    """

    def __init__(self, on_put: Callable[[int], None] | None = None) -> None:
        self.times: list[float] = []
        self.on_put = on_put

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if self.on_put is not None:
            self.on_put(len(self.times))

    def end(self) -> None:
        pass

    def decode_step_seconds(self) -> list[float]:
        """Duration of each decode step (the first push is the prompt, the second ends the prefill)."""
        return [end - start for start, end in zip(self.times[1:], self.times[2:])]


def median(values: list[float]) -> float:
    return statistics.median(values)


# ------------------------------------------------------------------------------------------- measuring
def tokens_per_second(generate: Callable[[], object], tokens: int, reps: int, device: torch.device,
                      warm_up: bool = True) -> list[float]:
    """``reps`` timed calls of ``generate`` after one untimed call at the same shapes (compiles, caches, kernels)."""
    if warm_up:
        generate()
    rates = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        generate()
        synchronize(device)
        rates.append(tokens / (time.perf_counter() - start))
    return rates


def profile_decode(generate: Callable[..., object], steps: int, device: torch.device,
                   keep_trace: Path | None = None) -> dict:
    """Per decode step, from torch.profiler over ``steps`` steady decode steps of one (warmed-up) generate() call.

    ``generate(streamer=...)`` must run at the timed shapes. The streamer steps the profiler once per token, so the
    recorded window is exactly ``steps`` whole decode steps, after the prefill and two settling steps.
    ``keep_trace``: where to keep the chrome trace (gzip), for a timeline.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    skipped = 3  # the profiler's step 0 ends at the prompt push, step 1 is the prefill, step 2 a first decode step
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        schedule = torch.profiler.schedule(wait=skipped, warmup=1, active=steps, repeat=1)
        with torch.profiler.profile(activities=activities, schedule=schedule,
                                    on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path))) as prof:
            clock = StepClock(on_put=lambda _: prof.step())
            generate(streamer=clock)
        events = json.loads(trace_path.read_text())["traceEvents"] if trace_path.exists() else []
        if keep_trace is not None and trace_path.exists():
            keep_trace.parent.mkdir(parents=True, exist_ok=True)
            keep_trace.write_bytes(gzip.compress(trace_path.read_bytes()))
    return {"steps": steps, "wall_ms_per_step": 1000 * median(clock.decode_step_seconds()),
            **step_breakdown(events, steps)}


def profile_call(generate: Callable[..., object], device: torch.device) -> dict:
    """One whole (warmed-up) ``generate()`` call under torch.profiler, for the prefill-heavy case, whose prefill and
    few decode steps all count: wall and prefill time (a step clock), and the trace's breakdown for the whole call
    (``step_breakdown``'s numbers, ``_per_call``). ``generate(streamer=...)`` must run at the timed shapes. On a GPU
    only CUDA activity is recorded: a prefill and 16 eager steps are ~30,000 kernels, and their CPU ops would make
    the trace several times larger."""
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        with torch.profiler.profile(activities=[activity]) as prof:
            started = time.perf_counter()
            generate(streamer=clock)
            synchronize(device)
            wall = time.perf_counter() - started
        prof.export_chrome_trace(str(trace_path))
        events = json.loads(trace_path.read_text())["traceEvents"]
    breakdown = {key.replace("_per_step", "_per_call"): value for key, value in step_breakdown(events, 1).items()}
    return {"wall_ms": 1e3 * wall, "prefill_ms": 1e3 * (clock.times[1] - clock.times[0]), **breakdown}


class StepTimer:
    """Times the model's compiled decode steps without a profiler, whichever system runs them.

    Installed on the model for the whole run, before any system compiles: every compiled step, warm-ups included,
    goes through the one wrapper it returns per compiled callable, so timed and untimed steps run the same code.
    While ``record`` runs a call, each step records the host time inside the call, the GPU time from the call's entry
    to the end of the work it enqueued (CUDA events: kernels plus any wait for the host inside the call, as generate()
    leaves the GPU idle between steps) and when it began (the step period). The profiler is no use for these: CUPTI's
    per-kernel records add host time to every node of a graph launch, so a profiled step's host time is mostly the
    profiler's.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.own = model.get_compiled_call
        self.wrappers: dict[object, Callable[..., object]] = {}
        self.calls: list[tuple[float, float, torch.cuda.Event, torch.cuda.Event]] | None = None
        model.get_compiled_call = self.get_compiled_call

    def get_compiled_call(self, *args, **kwargs) -> Callable[..., object]:
        compiled = self.own(*args, **kwargs)
        if compiled not in self.wrappers:
            self.wrappers[compiled] = lambda *a, **k: self._step(compiled, a, k)
        return self.wrappers[compiled]

    def _step(self, compiled: Callable[..., object], args: tuple, kwargs: dict):
        if self.calls is None:
            return compiled(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        entered = time.perf_counter()
        start.record()
        outputs = compiled(*args, **kwargs)
        end.record()
        self.calls.append((entered, time.perf_counter(), start, end))
        return outputs

    def record(self, generate: Callable[[], object], skipped: int = 2) -> dict:
        """Medians over the compiled decode steps of one (warmed-up) ``generate()`` call after ``skipped`` settling
        steps: ``host_in_call_ms``, ``gpu_call_ms``, ``period_ms``; and the whole call cut at the steps' entries
        (``call_ms`` = ``before_steps_ms``: the prefill and all before the first compiled step, + ``settling_ms``:
        the settling steps, the first of which checks every guard, + ``steady_ms`` + ``after_steps_ms``: the last
        step and the rest), for what tokens/s counts beyond steady steps."""
        self.calls = []
        try:
            started = time.perf_counter()
            generate()
            torch.cuda.synchronize()
            ended = time.perf_counter()
            every = self.calls
        finally:
            self.calls = None
        calls = every[skipped:]
        if len(calls) < 2:
            raise RuntimeError(f"generate() made {len(every)} compiled decode steps: too few to time")
        return {
            "steps": len(calls),
            "host_in_call_ms": median([1e3 * (left - entered) for entered, left, _, _ in calls]),
            "gpu_call_ms": median([start.elapsed_time(end) for _, _, start, end in calls]),
            "period_ms": median([1e3 * (b[0] - a[0]) for a, b in zip(calls, calls[1:])]),
            "call_ms": 1e3 * (ended - started),
            "before_steps_ms": 1e3 * (every[0][0] - started),
            "settling_ms": 1e3 * (calls[0][0] - every[0][0]),
            "steady_ms": 1e3 * (calls[-1][0] - calls[0][0]),
            "after_steps_ms": 1e3 * (ended - calls[-1][0]),
        }


def step_breakdown(events: list[dict], steps: int) -> dict:
    """Kernel time (LoRA / other), copies, host time in compiled code and launches, per step, from a chrome trace."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    lora = [e for e in kernels if LORA_KERNEL.search(e["name"]) and not e["name"].startswith("triton")]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    # Dynamo marks each run of compiled code with this range; nested or split ranges are merged before summing.
    compiled = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("Torch-Compiled Region")]
    runtime_events = [e for e in events if e.get("cat") == "cuda_runtime"]
    runtime = [e["name"] for e in runtime_events]
    compiled_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in compiled])
    # Time the GPU runs anything (kernels or copies); the rest of a step it waits for the host (or between nodes).
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels + copies])

    def per_step_ms(selected: list[dict]) -> float:
        return sum(e["dur"] for e in selected) / 1000 / steps

    top = _durations_by_name(kernels)[:8]
    return {
        "gpu_kernel_ms_per_step": per_step_ms(kernels),
        "lora_kernel_ms_per_step": per_step_ms(lora),
        "lora_kernels_per_step": len(lora) / steps,
        "other_kernel_ms_per_step": per_step_ms(kernels) - per_step_ms(lora),
        "copy_ms_per_step": per_step_ms(copies),
        "gpu_busy_ms_per_step": busy_us / 1000 / steps,
        "host_ms_in_compiled_code_per_step": compiled_us / 1000 / steps,
        "graph_launches_per_step": runtime.count("cudaGraphLaunch") / steps,
        "kernel_launches_per_step": (runtime.count("cudaLaunchKernel") + runtime.count("cudaLaunchKernelExC")) / steps,
        # Host time in CUDA runtime calls by name: launches, and any synchronisation or copy the step waits on.
        "runtime_calls_per_step": {name: {"count": len(durations) / steps, "ms": sum(durations) / 1000 / steps}
                                   for name, durations in _durations_by_name(runtime_events)[:6]},
        "top_kernels": [{"name": name[:120], "ms_per_step": sum(durations) / 1000 / steps,
                         "count_per_step": len(durations) / steps} for name, durations in top],
    }


def _durations_by_name(events: list[dict]) -> list[tuple[str, list[float]]]:
    """``(name, durations)`` of each event name, largest total first."""
    by_name: dict[str, list[float]] = {}
    for event in events:
        by_name.setdefault(event["name"], []).append(event["dur"])
    return sorted(by_name.items(), key=lambda item: -sum(item[1]))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


class Report:
    """Results so far, written to ``path`` after every system: a run cut short by a timeout keeps what it measured."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = data
        self.data.setdefault("systems", [])

    def add_system(self, row: dict) -> None:
        self.data["systems"].append(row)
        self.data["ratios"] = ratios_to_base(self.data["systems"])
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def ratios_to_base(systems: list[dict]) -> dict[str, float]:
    """Median tokens/s of each system over the base model's in the same mode and case."""
    base = {(s["mode"], s["case"]): s["median_tokens_per_second"] for s in systems if s["adapters"] == "base"}
    return {
        s["name"]: s["median_tokens_per_second"] / base[(s["mode"], s["case"])]
        for s in systems if (s["mode"], s["case"]) in base
    }


# ------------------------------------------------------------------------------------------- the run
# Full-size and --tiny defaults of the size options.
SIZES = {"layers": (32, 2), "batch": (32, 8), "prompt": (128, 16), "new_tokens": (64, 16), "prefill_prompt": (1024, 64),
         "prefill_new_tokens": (16, 8), "distinct": ("1,8,32", "1,4,8")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU if no GPU): a smoke test of every path")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32 = Llama-3-8B; tiny 2)")
    parser.add_argument("--batch", type=int, help="rows per batch (default 32; tiny 8)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per row, decode case (default 128; tiny 16)")
    parser.add_argument("--new-tokens", type=int, help="new tokens per row, decode case (default 64; tiny 16)")
    parser.add_argument("--prefill-prompt", type=int, help="prompt tokens, prefill-heavy case (default 1024; tiny 64)")
    parser.add_argument("--prefill-new-tokens", type=int, help="new tokens, prefill-heavy case (default 16; tiny 8)")
    parser.add_argument("--distinct", help="punica_hf systems: distinct adapters per batch (default 1,8,32; tiny 1,4,8;"
                        " 'none' = no punica_hf systems)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per system")
    parser.add_argument("--modes", default="eager,compiled", help="decode modes: eager, compiled (static cache)")
    parser.add_argument("--prefill-heavy", default="eager", help="modes of the prefill-heavy case ('none' = skip)")
    parser.add_argument("--profile", default="compiled",
                        help="modes whose decode steps (and prefill-heavy calls) are profiled, for base and the most "
                             "distinct adapters ('none')")
    parser.add_argument("--profile-steps", type=int, default=8, help="decode steps in each profile")
    parser.add_argument("--step-timing", action=argparse.BooleanOptionalAction, default=True,
                        help="compiled decode steps of base and the most distinct adapters timed without a profiler")
    parser.add_argument("--peft", action=argparse.BooleanOptionalAction, default=True,
                        help="PEFT systems (one adapter; mixed batch), eager, on a second copy of the model")
    parser.add_argument("--peft-mixed-new-tokens", type=int, default=4, help="new tokens for PEFT's slow mixed batch")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/bench_generate_h200.json"))
    parser.add_argument("--wrapped-base", action="store_true",
                        help="also time the wrapped model called without adapter_ids (base math through the wrapper)")
    parser.add_argument("--trace-dir", type=Path, help="keep each profile's chrome trace here (gzip)")
    args = parser.parse_args()
    for option, (full, tiny) in SIZES.items():
        if getattr(args, option) is None:
            setattr(args, option, tiny if args.tiny else full)
    for option in ("modes", "prefill_heavy", "profile"):
        chosen = [] if getattr(args, option) == "none" else getattr(args, option).split(",")
        unknown = set(chosen) - set(MODES)
        if unknown:
            parser.error(f"--{option.replace('_', '-')}: unknown modes {sorted(unknown)}; choose from {list(MODES)}")
        setattr(args, option, chosen)
    args.distinct = [] if args.distinct == "none" else [int(n) for n in args.distinct.split(",")]
    if any(not 1 <= n <= args.batch for n in args.distinct):
        parser.error(f"--distinct: each count must be in 1..{args.batch}")
    if args.profile and args.new_tokens < args.profile_steps + 5:
        parser.error("--new-tokens must exceed --profile-steps by 5 (prefill and settling steps are not profiled)")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("bench_generate.py needs a CUDA GPU (or --tiny for a CPU smoke test)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = llama_config(args.layers, args.tiny)
    model = build_llama(config, device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step_timer = StepTimer(model) if args.step_timing and device.type == "cuda" else None
    cases = {
        "decode": (torch.randint(1, config.vocab_size, (args.batch, args.prompt), device=device), args.new_tokens),
        "prefill-heavy": (torch.randint(1, config.vocab_size, (args.batch, args.prefill_prompt), device=device),
                          args.prefill_new_tokens),
    }
    report = Report(args.output, {
        "environment": environment(device),
        "setup": {**vars(args), "output": str(args.output), "trace_dir": args.trace_dir and str(args.trace_dir),
                  "model": f"Llama-3-8B shape, {args.layers} layers, bf16"},
        "memory": {"model_weights_gib": model_bytes / 2**30},
    })

    def generation_kwargs(case: str, mode: str, new_tokens: int | None = None) -> dict:
        input_ids, case_new_tokens = cases[case]
        new_tokens = new_tokens or case_new_tokens
        return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, **MODES[mode])

    def measure(name: str, adapters: str, mode: str, case: str, generate: Callable[..., object],
                new_tokens: int | None = None, reps: int = args.reps, warm_up: bool = True) -> None:
        """Time ``generate`` (called with generate()'s keyword arguments of the case and mode) and record it."""
        kwargs = generation_kwargs(case, mode, new_tokens)
        tokens = args.batch * kwargs["max_new_tokens"]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        rates = tokens_per_second(lambda: generate(**kwargs), tokens, reps, device, warm_up)
        row = {"name": name, "adapters": adapters, "mode": mode, "case": case, "tokens_per_second": rates,
               "median_tokens_per_second": median(rates), "seconds_with_warm_up": time.perf_counter() - started}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        profiled = ("base", f"{max(args.distinct, default=0)} distinct")
        if mode in args.profile and case == "prefill-heavy" and adapters in profiled:
            row["call_profile"] = profile_call(lambda **extra: generate(**kwargs, **extra), device)
        if mode in args.profile and case == "decode" and adapters in profiled:
            trace = args.trace_dir / f"{name.replace(', ', '_').replace(' ', '_')}.json.gz" if args.trace_dir else None
            row["profile"] = profile_decode(lambda **extra: generate(**kwargs, **extra), args.profile_steps, device,
                                            trace)
        if step_timer is not None and mode == "compiled" and case == "decode" and adapters in profiled:
            row["step_timing"] = step_timer.record(lambda: generate(**kwargs))
        report.add_system(row)
        print(f"{name:58s} {' '.join(f'{r:8.1f}' for r in rates)} tokens/s  ({row['seconds_with_warm_up']:.0f} s)",
              flush=True)

    # The base model first, unwrapped, as its users run it.
    for mode in args.modes:
        for case in ["decode"] + (["prefill-heavy"] if mode in args.prefill_heavy else []):
            measure(f"base, {mode}, {case}", "base", mode, case, model.generate)

    generator = torch.Generator(device).manual_seed(1)
    adapters = {f"a{i}": random_adapter(model, args.rank, generator) for i in range(max(args.distinct, default=1))}
    if args.distinct:
        served = MultiLoraModel(model, max_adapters=len(adapters), max_rank=args.rank,
                                gpu_pool_bytes=pool_bytes_for(list(adapters.values())))
        served.load_adapters(adapters)
        stats = served.adapter_stats
        report.data["memory"].update(lora_pool_used_gib=stats["gpu_bytes_used"] / 2**30,
                                     lora_pool_total_gib=stats["gpu_bytes_total"] / 2**30,
                                     lora_factor_gib=sum(factor_bytes(a) for a in adapters.values()) / 2**30)
        for mode in args.modes:
            for distinct in args.distinct:
                rows = [f"a{i % distinct}" for i in range(args.batch)]
                prefill_heavy = mode in args.prefill_heavy and distinct == max(args.distinct)
                for case in ["decode"] + (["prefill-heavy"] if prefill_heavy else []):
                    measure(f"punica_hf, {distinct} distinct, {mode}, {case}", f"{distinct} distinct", mode, case,
                            lambda rows=rows, **kwargs: served.generate(adapter_ids=rows, **kwargs))
        if args.wrapped_base:
            for mode in args.modes:  # the base model's math through the wrapper: what it saves the base itself
                measure(f"punica_hf wrapper, no adapter_ids, {mode}, decode", "wrapper, no adapters", mode, "decode",
                        served.generate)
        step_costs(report, args, factor_bytes(adapters["a0"]))

    if args.peft:
        measure_peft(args, config, model, adapters, measure, device)
    print_table(report.data)


def measure_peft(args, config: LlamaConfig, model: torch.nn.Module, adapters: dict[str, AdapterWeights], measure,
                 device: torch.device) -> None:
    """PEFT with one adapter active, and PEFT's mixed batch (``adapter_names``), eager, on a copy of the base."""
    from peft import LoraConfig, get_peft_model

    peft_base = build_llama(config, device)
    peft_base.load_state_dict(model.state_dict())
    lora_config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS)
    names = list(adapters)
    peft_model = get_peft_model(peft_base, lora_config, adapter_name=names[0]).eval()
    for name in names[1:]:
        peft_model.add_adapter(name, lora_config)
    peft_model.load_state_dict(
        {f"base_model.model.{module}.{kind}.{name}.weight": getattr(factors, attr)
         for name, weights in adapters.items() for module, factors in weights.modules.items()
         for kind, attr in (("lora_A", "lora_a"), ("lora_B", "lora_b"))},
        strict=False,
    )
    peft_model.set_adapter(names[0])
    measure("PEFT, one adapter active, eager, decode", "1 distinct (PEFT)", "eager", "decode", peft_model.generate)
    rows = [names[i % len(names)] for i in range(args.batch)]
    # PEFT's mixed batch loops over the adapters per module, so it is slow: few tokens, one rep, and no separate
    # warm-up (the run above warmed up PEFT at these shapes).
    measure(f"PEFT mixed batch (adapter_names), {len(names)} distinct, eager, decode", f"{len(names)} distinct (PEFT)",
            "eager", "decode", lambda **kwargs: peft_model.generate(adapter_names=rows, **kwargs),
            new_tokens=args.peft_mixed_new_tokens, reps=1, warm_up=False)


def factor_bytes(adapter: AdapterWeights, element_size: int = 2) -> int:
    """Bytes of an adapter's own factors in the bf16 pool."""
    return sum((m.lora_a.numel() + m.lora_b.numel()) * element_size for m in adapter.modules.values())


def pool_bytes_for(adapters: list[AdapterWeights], element_size: int = 2) -> int:
    """A device pool that holds exactly these adapters: their factors, the output scale and shift vectors ``[out]``
    of modules with DoRA or biases (``adapter_vectors``), and the store's 128-byte alignment per tensor."""
    vectors = sum(2 * (m.lora_b.shape[0] * element_size + 128)
                  for a in adapters for m in a.modules.values() if m.has_vectors)
    return sum(factor_bytes(a, element_size) + 2 * 128 * len(a.modules) for a in adapters) + vectors


def step_costs(report: Report, args, adapter_bytes: int) -> None:
    """Per decode step of each punica_hf system: the LoRA bytes floor (every distinct adapter's factors read once
    at the H200's copy bandwidth) beside the time a step takes over the base model's in the same mode, and beside
    the LoRA kernels' own time where profiled. Step times are steady decode steps when both systems have them (the
    unprofiled step timing, else the profiles), else from tokens/s (which spreads the prefill over the steps)."""
    costs = {}
    systems = report.data["systems"]
    for row in systems:
        if row["case"] != "decode" or not row["adapters"].endswith("distinct"):
            continue
        distinct = int(row["adapters"].split()[0])
        floor_ms = 1000 * distinct * adapter_bytes / COPY_BANDWIDTH_BYTES_PER_S
        cost = {"lora_bytes_per_step_gb": distinct * adapter_bytes / 1e9, "floor_ms": floor_ms}
        same_setting = (row["mode"], "decode")
        base = next((s for s in systems if s["adapters"] == "base" and (s["mode"], s["case"]) == same_setting), None)
        if base is not None:
            if "step_timing" in row and "step_timing" in base:
                step_ms, base_ms = row["step_timing"]["period_ms"], base["step_timing"]["period_ms"]
            elif "profile" in row and "profile" in base:
                step_ms, base_ms = row["profile"]["wall_ms_per_step"], base["profile"]["wall_ms_per_step"]
            else:
                step_ms = 1000 * args.batch / row["median_tokens_per_second"]
                base_ms = 1000 * args.batch / base["median_tokens_per_second"]
            cost.update(step_ms=step_ms, base_step_ms=base_ms, added_ms=step_ms - base_ms,
                        added_over_floor=(step_ms - base_ms) / floor_ms)
        if "profile" in row:
            cost["lora_kernel_ms"] = row["profile"]["lora_kernel_ms_per_step"]
            cost["lora_kernel_over_floor"] = cost["lora_kernel_ms"] / floor_ms
        costs[row["name"]] = cost
    report.data["decode_step_lora_cost"] = costs
    report.write()


def print_table(data: dict) -> None:
    env = data["environment"]
    print(f"\n{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}")
    memory = data["memory"]
    print("memory: " + ", ".join(f"{key} {value:.2f}" for key, value in memory.items()))
    print("\n| system | mode | case | tokens/s (reps) | ratio to base | peak GiB |")
    print("|---|---|---|---|---|---|")
    for row in data["systems"]:
        rates = ", ".join(f"{r:.0f}" for r in row["tokens_per_second"])
        ratio = data["ratios"].get(row["name"])
        peak = row.get("peak_allocated_gib")
        print(f"| {row['name'].rsplit(', ', 2)[0]} | {row['mode']} | {row['case']} | {rates} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} | {'-' if peak is None else f'{peak:.1f}'} |")
    systems = data["systems"]
    print_section(systems, "call_profile", ["profiled generate() call (ms)", "wall", "prefill", "GPU busy",
                                            "LoRA kernels (count)", "other kernels"],
                  lambda p: [f"{p['wall_ms']:.1f}", f"{p['prefill_ms']:.1f}", f"{p['gpu_busy_ms_per_call']:.1f}",
                             f"{p['lora_kernel_ms_per_call']:.1f} ({p['lora_kernels_per_call']:.0f})",
                             f"{p['other_kernel_ms_per_call']:.1f}"])
    print_section(systems, "step_timing", ["compiled decode step, no profiler (ms)", "period", "GPU from call entry",
                                           "host in call", "whole call", "before the steps", "settling steps",
                                           "steady steps", "after"],
                  lambda t: [f"{t[key]:.2f}" for key in ("period_ms", "gpu_call_ms", "host_in_call_ms", "call_ms",
                                                           "before_steps_ms", "settling_ms", "steady_ms",
                                                           "after_steps_ms")])
    print_section(systems, "profile", ["profiled decode step (ms)", "wall", "GPU busy", "GPU kernels",
                                       "LoRA kernels (count)", "other kernels", "host in compiled code",
                                       "graph launches", "kernel launches"],
                  lambda p: [f"{p['wall_ms_per_step']:.2f}", f"{p['gpu_busy_ms_per_step']:.2f}",
                             f"{p['gpu_kernel_ms_per_step']:.2f}",
                             f"{p['lora_kernel_ms_per_step']:.2f} ({p['lora_kernels_per_step']:.0f})",
                             f"{p['other_kernel_ms_per_step']:.2f}", f"{p['host_ms_in_compiled_code_per_step']:.2f}",
                             f"{p['graph_launches_per_step']:.1f}", f"{p['kernel_launches_per_step']:.0f}"])


def print_section(systems: list[dict], key: str, header: list[str], cells: Callable[[dict], list[str]]) -> None:
    """A markdown table of the systems that have ``key``: ``header`` (the first column names the system), then
    ``cells(system[key])``."""
    rows = [row for row in systems if key in row]
    if not rows:
        return
    print(f"\n| {' | '.join(header)} |")
    print("|" + "---|" * len(header))
    for row in rows:
        print(f"| {row['name']} | {' | '.join(cells(row[key]))} |")

if __name__ == "__main__":
    main()
