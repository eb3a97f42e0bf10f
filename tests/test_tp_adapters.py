"""Runtime adapter loads and unloads under tensor parallelism: 2 ranks, gloo, CPU.

One ``torchrun`` run of ``tp_adapter_worker.py`` (module fixture): rank 0 loads and unloads adapters through the
running engine (rank 1 made to fail one load), then serves the same requests with the unsplit model; the tests here
judge what each rank saw.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import save_peft_adapter, tiny_llama
from two_ranks import check_engines_ran, run_two_ranks
from vector_adapters import save_vector_adapter

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

WORKER = Path(__file__).with_name("tp_adapter_worker.py")
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("tp_adapters")
    base = tiny_llama(seed=0)
    base.save_pretrained(root / "model")
    adapters = root / "adapters"
    save_peft_adapter(base, adapters / "attn", r=4, target_modules=["q_proj", "v_proj", "o_proj"], seed=1)
    save_peft_adapter(base, adapters / "mlp", r=8, target_modules=["gate_proj", "down_proj"], seed=2)
    save_peft_adapter(base, adapters / "other", r=4, target_modules=["k_proj", "up_proj"], seed=3)
    save_vector_adapter(base, adapters / "dora", 5, r=4, use_dora=True, target_modules=["q_proj", "v_proj"])
    broken = save_peft_adapter(base, adapters / "broken", r=4, target_modules=["q_proj"], seed=4)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    ranks = run_two_ranks(WORKER, root, RUN_TIMEOUT_S)
    check_engines_ran(ranks)
    return ranks


def test_a_runtime_load_serves_the_unsplit_models_tokens_on_every_rank(ranks):
    leader, follower = ranks
    assert set(leader["loaded"]) == {"mlp"}
    for request_id in ("m0", "m1", "a0", "b0"):
        tokens, reason, _ = leader["completions"][request_id]
        assert reason == "length" and len(tokens) == 8
        assert tokens == leader["unsplit"][request_id][0], request_id
        assert follower["completions"][request_id][0] == tokens, request_id
    assert leader["completions"]["a0"][0] != leader["completions"]["b0"][0]  # adapters change the tokens


def test_a_follower_cannot_change_adapters(ranks):
    assert "change adapters on rank 0 only" in ranks[1]["follower_load"]


def test_a_broken_adapter_fails_cleanly_and_changes_nothing_on_any_rank(ranks):
    leader, follower = ranks
    assert leader["broken_error"].startswith("ValueError: could not read adapter weights")  # as without TP
    assert "broken" not in leader["adapters_after_failures"]
    assert leader["adapters_after_failures"] == leader["adapters_before_failures"]
    assert "broken" not in follower["adapters_at_end"]


def test_a_load_that_fails_on_one_rank_is_undone_on_every_rank(ranks):
    leader, follower = ranks
    assert leader["flaky_error"] == "ValueError: rank 1: injected read failure"
    assert "flaky" not in leader["adapters_after_failures"]
    assert leader["flaky_submit"].startswith("KeyError")
    assert "KeyError" in leader["unknown_unload"]
    # loaded later from a good path under the same name: both ranks' slots still agree, tokens as unsplit
    for request_id in ("f0", "f1"):
        tokens, reason, _ = leader["completions"][request_id]
        assert reason == "length" and tokens == leader["unsplit"][request_id][0], request_id
        assert follower["completions"][request_id][0] == tokens
    assert leader["adapters_at_end"] == follower["adapters_at_end"]
    assert set(leader["adapters_at_end"]) == {"attn", "flaky"}


def test_an_unload_during_a_request_lets_it_finish_as_without_tp(ranks):
    leader, follower = ranks
    tokens, reason, error = leader["completions"]["u0"]
    assert (reason, error, len(tokens)) == ("length", None, 40)
    assert tokens == leader["unsplit"]["u0"][0] == follower["completions"]["u0"][0]
    assert leader["submit_after_unload"].startswith("KeyError")


def test_a_dora_adapter_unloaded_at_runtime_leaves_no_vector_op_on_any_rank(ranks):
    """DoRA on column-split layers, loaded and unloaded through the running engine: its requests get the unsplit
    model's tokens, and once it is unloaded no rank's layers apply output vectors (requests after it still equal
    the unsplit model's)."""
    leader = ranks[0]
    for request_id in ("d0", "d1", "d2"):
        assert leader["completions"][request_id][:2] == leader["unsplit"][request_id][:2], request_id
    assert leader["completions"]["d0"][0] != leader["completions"]["d1"][0]  # DoRA changes its request
    assert leader["vector_hooks_with_dora"] == 4  # q and v of both layers
    assert [seen["vector_hooks_at_end"] for seen in ranks] == [0, 0]
