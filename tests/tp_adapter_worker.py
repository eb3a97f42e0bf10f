"""One rank of tests/test_tp_adapters.py: run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by that test, never
alone.

``python tp_adapter_worker.py ROOT``: ROOT holds the tiny model (``ROOT/model``) and PEFT adapters
(``ROOT/adapters/<name>``; "broken" is not a readable adapter). Every rank serves the model split over the 2 ranks
with an ``Engine`` started with the adapter "attn" alone; rank 0 loads and unloads adapters at runtime through the
engine while it runs, and submits requests with them. Then rank 0 serves the same requests with the unsplit model.
Each rank writes what it saw to ``ROOT/rank<R>.json``; the test compares.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from punica_hf import MultiLoraModel
from punica_hf.serving import Engine, EngineConfig, SamplingParams
from two_ranks import finish_rank

ROOT = Path(sys.argv[1])
ADAPTERS = ROOT / "adapters"
RANK = int(os.environ["RANK"])
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=5)
WITH_LOADED = {  # request id: prompt, adapter, settings; "mlp" loaded at runtime
    "m0": ([5, 17, 33, 2, 9, 41], "mlp", GREEDY),
    "m1": ([1, 2, 3, 4, 5, 6], "mlp", SEEDED),
    "a0": ([88, 14, 29, 70, 51, 8], "attn", GREEDY),
    "b0": ([88, 14, 29, 70, 51, 8], None, GREEDY),
}
LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)
UNLOADED_WHILE_RUNNING = {"u0": ([7, 3, 9, 12], "mlp", LONG)}
AFTER_FAILED_LOADS = {"f0": ([9, 8, 7, 6], "flaky", GREEDY), "f1": ([9, 8, 7, 6], "attn", GREEDY)}
WITH_DORA = {"d0": ([4, 40, 14, 41], "dora", GREEDY), "d1": ([4, 40, 14, 41], "attn", GREEDY)}
AFTER_DORA = {"d2": ([6, 60, 16, 61], "attn", GREEDY)}


def serve(tensor_parallel: bool) -> tuple[MultiLoraModel, Engine, dict]:
    split = dict(distributed_config=DistributedConfig(tp_plan="auto")) if tensor_parallel else {}
    base = AutoModelForCausalLM.from_pretrained(ROOT / "model", dtype=torch.float32, **split).eval()
    model = MultiLoraModel(base, max_adapters=2, max_rank=16)
    model.load_adapters({"attn": ADAPTERS / "attn"})
    engine = Engine(model, config=EngineConfig(max_running=4, kv_blocks=64))
    seen: dict = {}
    engine.add_listener(lambda c: seen.__setitem__(c.request_id, [list(c.token_ids), c.finish_reason, c.error]))
    return model, engine, seen


def submit_all(engine: Engine, requests: dict) -> list:
    return [engine.submit(prompt, adapter, params, request_id=request_id)
            for request_id, (prompt, adapter, params) in requests.items()]


def error_of(call) -> str | None:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def lead(model: MultiLoraModel, engine: Engine, results: dict) -> None:
    """Rank 0: loads, requests, failed loads and an unload during a request, all while the engine runs."""
    results["loaded"] = engine.load_adapters({"mlp": ADAPTERS / "mlp"})
    for handle in submit_all(engine, WITH_LOADED):
        handle.result(timeout=120)
    results["adapters_before_failures"] = model.adapters
    results["broken_error"] = error_of(lambda: engine.load_adapters({"broken": ADAPTERS / "broken"}))
    # rank 1 alone fails this one (its load_adapters is made to fail for the name "flaky")
    results["flaky_error"] = error_of(lambda: engine.load_adapters({"flaky": ADAPTERS / "mlp"}))
    results["adapters_after_failures"] = model.adapters
    results["flaky_submit"] = error_of(lambda: engine.submit([1, 2], "flaky"))
    results["unknown_unload"] = error_of(lambda: engine.unload_adapter("nothing"))
    long = submit_all(engine, UNLOADED_WHILE_RUNNING)[0]
    next(iter(long))  # its first token: it runs on every rank
    engine.unload_adapter("mlp")
    results["submit_after_unload"] = error_of(lambda: engine.submit([1, 2], "mlp"))
    long.result(timeout=120)
    # The name that failed on rank 1 loads now from a good path (rank 1 fails the name only with the "mlp" path).
    engine.load_adapters({"flaky": ADAPTERS / "other"})
    for handle in submit_all(engine, AFTER_FAILED_LOADS):
        handle.result(timeout=120)
    # DoRA on column-split layers (q, v): its layers apply output vectors on every rank until it is unloaded
    engine.load_adapters({"dora": ADAPTERS / "dora"})
    for handle in submit_all(engine, WITH_DORA):
        handle.result(timeout=120)
    results["vector_hooks_with_dora"] = vector_hooks(model)
    engine.unload_adapter("dora")
    for handle in submit_all(engine, AFTER_DORA):
        handle.result(timeout=120)
    engine.shutdown(drain=True, timeout=120)


def vector_hooks(model: MultiLoraModel) -> int:
    """This rank's LoRA hooks that apply output vectors (DoRA, LoRA biases)."""
    return sum(getattr(hook, "vectors", None) is not None for hook in model._injection.hooks.values())


def fail_flaky_loads_here(model: MultiLoraModel) -> None:
    """Rank 1's fault: a load of the name "flaky" from the "mlp" path fails here alone."""
    load = model.load_adapters

    def failing_load(sources, **kwargs):
        if "flaky" in sources and Path(sources["flaky"]).name == "mlp":
            raise OSError("injected read failure")
        return load(sources, **kwargs)

    model.load_adapters = failing_load


def main() -> None:
    results: dict = {}
    try:
        model, engine, seen = serve(tensor_parallel=True)
        if RANK == 1:
            fail_flaky_loads_here(model)
        engine.start()
        if RANK == 0:
            lead(model, engine, results)
        else:
            results["follower_load"] = error_of(lambda: engine.load_adapters({"mlp": ADAPTERS / "mlp"}))
            engine.shutdown(timeout=240)
        results["engine_error"] = None if engine.error is None else repr(engine.error)
        results["adapters_at_end"] = model.adapters
        results["vector_hooks_at_end"] = vector_hooks(model)
        results["completions"] = seen
        if RANK == 0:
            whole_model, whole, whole_seen = serve(tensor_parallel=False)
            whole_model.load_adapters({"mlp": ADAPTERS / "mlp", "flaky": ADAPTERS / "other", "dora": ADAPTERS / "dora"})
            with whole:
                everything = WITH_LOADED | UNLOADED_WHILE_RUNNING | AFTER_FAILED_LOADS | WITH_DORA | AFTER_DORA
                for handle in submit_all(whole, everything):
                    handle.result(timeout=120)
            results["unsplit"] = whole_seen
    except Exception:
        results["error"] = traceback.format_exc()
    finish_rank(ROOT, results)


if __name__ == "__main__":
    main()
