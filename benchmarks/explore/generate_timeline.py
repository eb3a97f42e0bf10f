"""Where an eager generate() call's time goes: before the prompt push, the prefill, each decode step, the end.

Same setup as bench_generate.py's decode case (Llama-3-8B shape, random weights, batch 32, prompt 128, 64 new
tokens, 32 distinct rank-16 adapters). Each system runs one untimed call, two calls with a step clock (a streamer
that timestamps every token push) and one call without a streamer, as bench_generate.py times it. Prints one line
per call; a step median far below (total / steps) points at a cost outside the decode steps.

    PYTHONPATH=. python benchmarks/explore/generate_timeline.py          # on a GPU, ~1 minute
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_generate's helpers
from bench_generate import StepClock, build_llama, llama_config, pool_bytes_for, random_adapter  # noqa: E402

from punica_hf import MultiLoraModel  # noqa: E402


def timeline(name: str, generate, kwargs: dict) -> None:
    generate(**kwargs)
    for _ in range(2):
        clock = StepClock()
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(**kwargs, streamer=clock)
        torch.cuda.synchronize()
        end = time.perf_counter()
        steps = clock.decode_step_seconds()
        print(f"{name:28s} total {1e3 * (end - start):7.1f} ms | to prompt push {1e3 * (clock.times[0] - start):6.1f} "
              f"| prefill {1e3 * (clock.times[1] - clock.times[0]):6.1f} | steps {len(steps)} median "
              f"{1e3 * statistics.median(steps):6.2f} max {1e3 * max(steps):6.1f} sum {1e3 * sum(steps):7.1f} "
              f"| after last {1e3 * (end - clock.times[-1]):6.1f}", flush=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate(**kwargs)
    torch.cuda.synchronize()
    print(f"{name:28s} no streamer total {1e3 * (time.perf_counter() - start):7.1f} ms", flush=True)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = llama_config(32)
    model = build_llama(config, device)
    input_ids = torch.randint(1, config.vocab_size, (32, 128), device=device)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=64,
                  min_new_tokens=64, do_sample=False)
    timeline("base", model.generate, kwargs)
    generator = torch.Generator(device).manual_seed(1)
    adapters = {f"a{i}": random_adapter(model, 16, generator) for i in range(32)}
    served = MultiLoraModel(model, max_adapters=32, max_rank=16, gpu_pool_bytes=pool_bytes_for(list(adapters.values())))
    served.load_adapters(adapters)
    with_adapters = {**kwargs, "adapter_ids": list(adapters)}
    timeline("punica 32 distinct", served.generate, with_adapters)
    gc.disable()  # is Python's garbage collector part of the eager step?
    timeline("punica 32, gc off", served.generate, with_adapters)


if __name__ == "__main__":
    main()
