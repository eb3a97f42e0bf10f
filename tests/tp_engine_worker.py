"""One rank of tests/test_tp_engine.py: run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by that test, never alone.

``python tp_engine_worker.py ROOT``: ROOT holds the tiny model (``ROOT/model``) and its PEFT adapters
(``ROOT/adapters/<name>``). Every rank serves the model split over the 2 ranks with an ``Engine``; rank 0 submits
(concurrent requests, an idle spell, a cancel, a shutdown that drains), then serves the same requests with the
unsplit model alone. Each rank writes every completion its engine saw to ``ROOT/rank<R>.json``; the test compares.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from punica_hf import MultiLoraModel
from punica_hf.serving import Engine, EngineConfig, SamplingParams, tp_control
from two_ranks import finish_rank

ROOT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
CONFIG = EngineConfig(max_running=4, kv_blocks=64)
IDLE_SECONDS = 4 * tp_control.HEARTBEAT_SECONDS
# One rank-8 MLP adapter of the uneven model is 9,216 bytes sized as rank 0's share, 8,192 as rank 1's: this holds
# one adapter as rank 0 counts and two as rank 1 would
UNEVEN_POOL_BYTES = 16384
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=11)
UNSEEDED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0)
CONCURRENT = {  # request id: prompt, adapter, settings
    "c0": ([5, 17, 33, 2, 9, 41], "attn", GREEDY),
    "c1": ([7, 7, 12, 60, 3, 11], None, GREEDY),
    "c2": ([1, 2, 3, 4, 5, 6], "mlp", SEEDED),
    "c3": ([88, 14, 29, 70, 51, 8], "mlp", GREEDY),
    "c4": ([9, 4, 61], None, SEEDED),
    "c5": ([30, 31, 32, 33], "attn", SEEDED),
}
AFTER_IDLE = {"i0": ([12, 13, 14], "mlp", GREEDY), "i1": ([40, 2, 2, 7], "attn", SEEDED)}
BASE = {"base-c3": ([88, 14, 29, 70, 51, 8], None, GREEDY)}  # c3 without its adapter
DRAINED = {"d0": ([3, 1, 4, 1, 5], "attn", GREEDY), "d1": ([9, 2, 6], None, SEEDED)}
# More than one KV page (256 tokens on the CPU) in common: the second request takes the first's page on every rank
SHARED_PROMPT = [(7 * i + 3) % 97 + 1 for i in range(300)]
PREFIXED = {"p0": (SHARED_PROMPT, "attn", GREEDY), "p1": (SHARED_PROMPT[:280] + [5, 6, 7, 8] * 5, "attn", GREEDY)}


def serve(tensor_parallel: bool, adapters=("attn", "mlp"), config: EngineConfig = CONFIG,
          ) -> tuple[MultiLoraModel, Engine, dict]:
    """The model (split or whole) with its adapters, an engine over it and the completions it will see by id."""
    split = dict(distributed_config=DistributedConfig(tp_plan="auto")) if tensor_parallel else {}
    base = AutoModelForCausalLM.from_pretrained(ROOT / "model", dtype=torch.float32, **split).eval()
    model = MultiLoraModel(base, max_adapters=2, max_rank=16)
    model.load_adapters({name: ROOT / "adapters" / name for name in adapters})
    engine = Engine(model, config=config)
    seen: dict = {}
    engine.add_listener(lambda c: seen.__setitem__(c.request_id, [list(c.token_ids), c.finish_reason]))
    return model, engine, seen


def submit_all(engine: Engine, requests: dict) -> list:
    return [engine.submit(prompt, adapter, params, request_id=request_id)
            for request_id, (prompt, adapter, params) in requests.items()]


def lead(engine: Engine, results: dict) -> None:
    """Rank 0's requests to the split model."""
    for handle in submit_all(engine, CONCURRENT | {"u0": ([2, 4, 8], "attn", UNSEEDED)}):
        handle.result(timeout=120)
    time.sleep(IDLE_SECONDS)  # nothing to run: only heartbeats go to the followers
    for handle in submit_all(engine, AFTER_IDLE):
        handle.result(timeout=120)
    for request_id, request in PREFIXED.items():  # one after the other: p1 finds p0's pages
        submit_all(engine, {request_id: request})[0].result(timeout=120)
    long = engine.submit([6, 6, 6], "mlp", SamplingParams(max_new_tokens=60, ignore_eos=True), request_id="x0")
    next(iter(long))  # its first token: it runs on every rank
    long.cancel()
    results["cancelled_tokens"] = len(long.result(timeout=120).token_ids)
    submit_all(engine, DRAINED)
    engine.shutdown(drain=True, timeout=120)


def follow(engine: Engine, results: dict) -> None:
    """A follower: its submit is refused; it runs rank 0's steps until rank 0 shuts down."""
    try:
        engine.submit([1, 2, 3])
    except RuntimeError as error:
        results["follower_submit"] = str(error)
    engine.shutdown(timeout=180)


def leader_failure(results: dict) -> None:
    """Rank 0's engine thread fails: its request ends with the error, and the followers stop instead of waiting."""
    _, engine, _ = serve(tensor_parallel=True)
    if RANK == 0:
        def broken_admit():
            if engine._queue:
                raise RuntimeError("admission broke")
            return []

        engine._admit = broken_admit
    engine.start()
    if RANK == 0:
        handle = engine.submit([1, 2, 3], "attn", GREEDY)
        results["error"] = handle.result(timeout=60).error
    engine.shutdown(timeout=60)
    results["engine_error"] = None if engine.error is None else str(engine.error)


def differing_adapters(results: dict) -> None:
    """Rank 1 loads the adapters in another order and holds one: its slots differ from rank 0's, and every rank's
    engine stops at the first request on them, saying so, rather than run a batch the ranks do not share."""
    model, engine, _ = serve(tensor_parallel=True, adapters=("attn", "mlp") if RANK == 0 else ("mlp", "attn"))
    held = model.acquire(["mlp"]) if RANK == 1 else None
    engine.start()
    if RANK == 0:
        results["request_error"] = engine.submit([1, 2, 3], "attn", GREEDY).result(timeout=60).error
    engine.shutdown(timeout=60)
    results["engine_error"] = None if engine.error is None else str(engine.error)
    if held is not None:
        held.release()


def reloaded_while_queued(results: dict) -> None:
    """Both slots held; requests for "fourth" and "other" wait; "other" is unloaded and loaded again. The request for
    "other" fails as unloaded, and the ranks keep the same slots: rank 0 used to place the new "other" (and evict
    for it) before it found the request's adapter gone, a placement the followers never made."""
    _, engine, _ = serve(tensor_parallel=True, adapters=("attn", "mlp", "other", "fourth"))
    engine.start()
    if RANK == 0:
        long = [engine.submit([6, 6, 6], name, SamplingParams(max_new_tokens=40, ignore_eos=True))
                for name in ("attn", "mlp")]
        for handle in long:
            next(iter(handle))  # running: both slots held
        queued = [engine.submit([5, 4, 3], name, GREEDY) for name in ("fourth", "other")]
        engine.unload_adapter("other")
        engine.load_adapters({"other": ROOT / "adapters" / "other"})
        results["queued"] = [[c.finish_reason, c.error] for c in (h.result(timeout=120) for h in long + queued)]
        after = engine.submit([7, 8, 9], "attn", GREEDY).result(timeout=120)
        results["after"] = [after.finish_reason, after.error]
    engine.shutdown(timeout=120)
    results["engine_error"] = None if engine.error is None else str(engine.error)


def uneven_split_under_a_tight_pool(results: dict) -> None:
    """A model split unevenly (intermediate 65: rank 0 holds 33 rows, rank 1 32) with a pool that holds one MLP
    adapter on rank 0 but two on rank 1, as each rank's own chunks are sized: requests alternating over the two
    adapters make the store evict and reload. Every rank sizes its chunks as the widest rank's, so they place and
    evict alike and the tokens equal the unsplit model's (rank 1 used to keep both resident, and its slots drifted
    from rank 0's)."""
    requests = {f"t{i}": ([5, 6, 7 + i], adapter, GREEDY) for i, adapter in enumerate(["mlp", "mlp2", "mlp", None])}

    def serve_uneven(tensor_parallel: bool):
        split = dict(distributed_config=DistributedConfig(tp_plan="auto")) if tensor_parallel else {}
        base = AutoModelForCausalLM.from_pretrained(ROOT / "uneven", dtype=torch.float32, **split).eval()
        model = MultiLoraModel(base, max_adapters=2, max_rank=8, gpu_pool_bytes=UNEVEN_POOL_BYTES)
        model.load_adapters({name: ROOT / "uneven_adapters" / name for name in ("mlp", "mlp2")})
        return model, Engine(model, config=CONFIG)

    model, engine = serve_uneven(tensor_parallel=True)
    results["chunk_sizes"] = {name: model._store._by_name[name].device_bytes for name in ("mlp", "mlp2")}
    with engine:
        if RANK == 0:
            results["split"] = {request_id: [list(c.token_ids), c.error] for request_id, c in
                                ((r, h.result(timeout=120)) for r, h in zip(requests, submit_all(engine, requests)))}
    results["engine_error"] = None if engine.error is None else str(engine.error)
    if RANK == 0:
        _, whole = serve_uneven(tensor_parallel=False)
        with whole:
            results["unsplit"] = {request_id: list(handle.result(timeout=120).token_ids)
                                  for request_id, handle in zip(requests, submit_all(whole, requests))}


def compiled_steps(results: dict) -> None:
    """The split model's steps compiled (``compile_steps``), the LoRA ops opaque as the CUDA kernels are to the
    compiler: rank 0's concurrent requests again, and the graph breaks each rank's compile met."""
    from torch._dynamo.utils import counters

    from opaque_kernels import OpaqueKernelBackend

    model, engine, seen = serve(tensor_parallel=True, config=dataclasses.replace(CONFIG, compile_steps=True))
    backend = OpaqueKernelBackend()
    model._injection.context.backend = lambda device: backend
    torch._dynamo.reset()
    counters.clear()
    with engine:
        if RANK == 0:
            for handle in submit_all(engine, CONCURRENT):
                handle.result(timeout=120)
    results["completions"] = seen
    results["graph_breaks"] = sum(counters["graph_break"].values())
    results["graphs"] = counters["stats"]["unique_graphs"]


def main() -> None:
    results: dict = {}
    try:
        _, engine, seen = serve(tensor_parallel=True)
        control, waits = engine._control, []
        share = control.share

        def timed_share(value=None):
            started = time.perf_counter()
            try:
                return share(value)
            finally:
                waits.append(time.perf_counter() - started)

        control.share = timed_share
        engine.start()
        (lead if RANK == 0 else follow)(engine, results)
        results["engine_error"] = None if engine.error is None else repr(engine.error)
        results["completions"] = seen
        results["longest_control_wait"] = max(waits[1:])  # the first waits for the other ranks to start
        results["prefix_hit_tokens"] = engine.stats().prefix_hit_tokens
        if RANK == 0:
            _, whole, whole_seen = serve(tensor_parallel=False)
            with whole:
                for handle in submit_all(whole, CONCURRENT | AFTER_IDLE | DRAINED | BASE | PREFIXED):
                    handle.result(timeout=120)
            results["unsplit"] = whole_seen
        leader_failure(results.setdefault("leader_failure", {}))
        differing_adapters(results.setdefault("differing_adapters", {}))
        reloaded_while_queued(results.setdefault("reloaded_while_queued", {}))
        uneven_split_under_a_tight_pool(results.setdefault("uneven_split", {}))
        compiled_steps(results.setdefault("compiled_steps", {}))
    except Exception:
        results["error"] = traceback.format_exc()
    finish_rank(ROOT, results)


if __name__ == "__main__":
    main()
