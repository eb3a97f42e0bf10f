"""One rank of tests/test_tp_failures.py: run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by that test, never
alone.

``python tp_failure_worker.py ROOT FAILING_RANK``: ROOT holds the tiny model (``ROOT/model``) and the PEFT adapter
``ROOT/adapters/attn``. Every rank serves the model split over the 2 ranks with an ``Engine``; on FAILING_RANK alone
the model's forward raises for a batch holding the token ``POISON`` (a fault of this script's own, nothing in the
package). Rank 0 runs a request, then the poisoned one beside another. Each rank writes what it saw to
``ROOT/rank<R>.json``; the test judges.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from punica_hf import MultiLoraModel
from punica_hf.serving import Engine, EngineConfig, SamplingParams
from two_ranks import finish_rank

ROOT = Path(sys.argv[1])
FAILING_RANK = int(sys.argv[2])
RANK = int(os.environ["RANK"])
POISON = 99
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)


def fail_on_poison(base: torch.nn.Module) -> None:
    """This rank's forward raises, before the step's collectives, for a batch holding ``POISON``."""
    def check(_module, args):
        if (args[0] == POISON).any():
            raise ValueError("injected fault")

    base.get_input_embeddings().register_forward_pre_hook(check)


def lead(engine: Engine, results: dict) -> None:
    results["before"] = engine.submit([4, 5, 6], "attn", GREEDY).result(timeout=120).finish_reason
    started = time.perf_counter()
    handles = [engine.submit([5, POISON, 7], "attn", GREEDY, request_id="poisoned"),
               engine.submit([4, 5, 6, 7], None, LONG, request_id="bystander")]
    results["errors"] = {handle.request_id: handle.result(timeout=120).error for handle in handles}
    results["seconds_to_fail"] = time.perf_counter() - started
    results["running_after"] = engine.running
    try:
        engine.submit([1, 2, 3])
    except Exception as error:
        results["submit_after"] = f"{type(error).__name__}: {error}"


def main() -> None:
    results: dict = {}
    try:
        base = AutoModelForCausalLM.from_pretrained(
            ROOT / "model", dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
        ).eval()
        model = MultiLoraModel(base, max_adapters=2, max_rank=16)
        model.load_adapters({"attn": ROOT / "adapters" / "attn"})
        if RANK == FAILING_RANK:
            fail_on_poison(base)
        engine = Engine(model, config=EngineConfig(max_running=4, kv_blocks=64)).start()
        if RANK == 0:
            lead(engine, results)
        # The failed rank's engine thread has ended; the other rank's may wait in a collective until the failed
        # rank leaves the group (finish_rank), which ends that collective with an error.
        engine.shutdown(timeout=60)
        results["engine_error"] = None if engine.error is None else str(engine.error)
    except Exception:
        results["error"] = traceback.format_exc()
    finish_rank(ROOT, results)


if __name__ == "__main__":
    main()
