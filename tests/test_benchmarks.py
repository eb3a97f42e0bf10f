"""The benchmarks' own measuring code, where it can mislead without any kernel running (CPU)."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from opaque_kernels import route_to_opaque_kernels
from transformers import CompileConfig

from punica_hf import MultiLoraModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_generate import StepTimer, build_llama, factor_bytes, llama_config, random_adapter  # noqa: E402
from bench_step_lora import CALLS, lora_floor_bytes  # noqa: E402


class HostClockEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU: records the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: HostClockEvent) -> float:
        return 1e3 * (end.at - self.at)


@torch.no_grad()
def test_step_timer_times_each_compiled_step_without_changing_how_it_runs(tmp_path, monkeypatch):
    """``StepTimer`` wraps the compiled decode step of every system for the whole run. A wrapper made only for the
    timed call would be a callable ``CompiledSteps`` never saw compile, so every timed step would check all of
    Dynamo's guards (the mistake of one device run: 3.7 ms of host time per step that no untimed step pays). Timed
    steps must run as untimed ones do, later steps of a call with guard checks skipped, and each one is recorded."""
    base = tiny_llama()
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"])})
    route_to_opaque_kernels(model, monkeypatch)  # one graph per step, as on the GPU
    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    skipping = []
    set_stance = torch.compiler.set_stance

    def spy(*args, **kwargs):
        skipping.append(kwargs.get("skip_guard_eval_unsafe", False))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers' switch to compile generate() off CUDA (for tests)
    new_tokens = 6  # the prefill runs eagerly: 5 compiled decode steps
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), adapter_ids=["a", None],
                              max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                              compile_config=compile_config)

    timer = StepTimer(model.model)
    try:
        untimed = generate()  # compiles, as a benchmark's warm-up does
        skipping.clear()
        timing = timer.record(generate, skipped=2)
        assert skipping == [True] * (new_tokens - 2), skipping  # the first step of a call checks every guard
        assert torch.equal(generate(), untimed)
    finally:
        torch._dynamo.reset()
    assert timing["steps"] == new_tokens - 1 - 2
    assert 0 < timing["host_in_call_ms"] <= timing["period_ms"]
    assert timing["gpu_call_ms"] > 0
    parts = [timing[key] for key in ("before_steps_ms", "settling_ms", "steady_ms", "after_steps_ms")]
    assert min(parts) > 0 and sum(parts) == pytest.approx(timing["call_ms"])
    assert timer.calls is None  # recording ends with the call


def test_step_benchmark_floor_counts_the_adapter_bytes_that_bench_generate_counts():
    """``bench_step_lora.py`` rebuilds a Llama-3-8B step's LoRA calls by hand; its bytes floor must count one
    adapter's factors as ``bench_generate.py`` counts them on the real model (every targeted projection of 32
    layers), or the two benchmarks' "x its floor" figures, quoted side by side, would not compare."""
    model = build_llama(llama_config(32), torch.device("meta"))
    adapter = random_adapter(model, 16, torch.Generator().manual_seed(0))
    activations = lora_floor_bytes(0, 16, list(CALLS))  # x read and updates written, no factors
    assert activations > 0
    for distinct in (1, 32):
        assert lora_floor_bytes(distinct, 16, list(CALLS)) - activations == distinct * factor_bytes(adapter)
