"""A step that fails on one rank under tensor parallelism: 2 ranks, gloo, CPU.

``tp_failure_worker.py`` makes one rank's forward raise for a poisoned batch (its own fault, nothing in the package);
every rank's engine stops promptly with an error naming that rank and its error, and rank 0's requests end with it
rather than wait in a collective the failed rank never joins.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import save_peft_adapter, tiny_llama
from punica_hf.serving.tp_control import CONTROL_TIMEOUT
from two_ranks import run_two_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

WORKER = Path(__file__).with_name("tp_failure_worker.py")
RUN_TIMEOUT_S = 180


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_step_failing_on_one_rank_stops_every_rank_naming_it(tmp_path, failing_rank):
    base = tiny_llama(seed=0)
    base.save_pretrained(tmp_path / "model")
    save_peft_adapter(base, tmp_path / "adapters" / "attn", r=4, target_modules=["q_proj", "o_proj"], seed=1)
    leader, follower = run_two_ranks(WORKER, tmp_path, RUN_TIMEOUT_S, str(failing_rank))
    for rank, seen in enumerate((leader, follower)):
        assert "error" not in seen, f"rank {rank}:\n{seen['error']}"
    named = f"rank {failing_rank}: a step failed: ValueError: injected fault"
    assert leader["before"] == "length"  # the ranks served a request before the fault
    for request_id, error in leader["errors"].items():
        assert error is not None and named in error, (request_id, error)
    assert leader["seconds_to_fail"] < CONTROL_TIMEOUT.total_seconds() / 10  # no collective ran into a timeout
    assert not leader["running_after"] and "EngineClosedError" in leader["submit_after"]
    for seen in (leader, follower):
        assert named in seen["engine_error"], seen["engine_error"]
