"""The serving engine over a model split by tensor parallelism: 2 ranks, gloo, CPU.

One ``torchrun`` run of ``tp_engine_worker.py`` (module fixture) serves a tiny model split over 2 ranks, rank 0
submitting, then the same requests with the unsplit model in one process; the tests here judge what each rank saw.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import save_peft_adapter, tiny_llama
from punica_hf.serving.tp_control import HEARTBEAT_SECONDS
from two_ranks import check_engines_ran, run_two_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

WORKER = Path(__file__).with_name("tp_engine_worker.py")
RUN_TIMEOUT_S = 240
CONCURRENT = ["c0", "c1", "c2", "c3", "c4", "c5"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks saw (tp_engine_worker.py's JSON), after one torchrun run."""
    root = tmp_path_factory.mktemp("tp_engine")
    base = tiny_llama(seed=0)
    base.save_pretrained(root / "model")
    save_peft_adapter(base, root / "adapters" / "attn", r=4, target_modules=["q_proj", "v_proj", "o_proj"], seed=1)
    save_peft_adapter(base, root / "adapters" / "mlp", r=8, target_modules=["gate_proj", "down_proj"], seed=2)
    save_peft_adapter(base, root / "adapters" / "other", r=4, target_modules=["q_proj", "up_proj"], seed=3)
    save_peft_adapter(base, root / "adapters" / "fourth", r=4, target_modules=["k_proj"], seed=4)
    uneven = tiny_llama(seed=0, intermediate_size=65)  # split 33 + 32 over the 2 ranks
    uneven.save_pretrained(root / "uneven")
    for seed, name in enumerate(("mlp", "mlp2"), start=5):
        save_peft_adapter(uneven, root / "uneven_adapters" / name, r=8, target_modules=["gate_proj", "down_proj"],
                          seed=seed)
    ranks = run_two_ranks(WORKER, root, RUN_TIMEOUT_S)
    check_engines_ran(ranks)
    return ranks


def test_concurrent_requests_equal_the_unsplit_engine(ranks):
    leader = ranks[0]
    for request_id in CONCURRENT:
        tokens, reason = leader["completions"][request_id]
        assert reason == "length" and len(tokens) == 8
        assert tokens == leader["unsplit"][request_id][0], request_id
    # the same prompt with and without its adapter differs: the comparison sees the adapters
    assert leader["completions"]["c3"][0] != leader["unsplit"]["base-c3"][0]


def test_ranks_agree_on_every_token(ranks):
    leader, follower = (seen["completions"] for seen in ranks)
    assert set(leader) == set(follower) == set(CONCURRENT) | {"u0", "i0", "i1", "p0", "p1", "x0", "d0", "d1"}
    for request_id, (tokens, _) in leader.items():
        assert follower[request_id][0] == tokens, request_id  # "u0" samples with a seed rank 0 chose


def test_an_idle_spell_longer_than_a_heartbeat(ranks):
    leader = ranks[0]
    for request_id in ("i0", "i1"):
        assert leader["completions"][request_id][0] == leader["unsplit"][request_id][0]
    # rank 0 idled 4 heartbeats: the follower still never waited much longer than one for its next record
    assert ranks[1]["longest_control_wait"] < 2 * HEARTBEAT_SECONDS


def test_every_rank_shares_the_same_prefix_pages(ranks):
    """Prefix caching under TP: p1 takes p0's first page on every rank (rank 0's keys go with its admissions), so
    the ranks' batches stay the same and the tokens are the unsplit engine's."""
    leader = ranks[0]
    assert ranks[0]["prefix_hit_tokens"] == ranks[1]["prefix_hit_tokens"] >= 256
    for request_id in ("p0", "p1"):
        assert leader["completions"][request_id][0] == leader["unsplit"][request_id][0], request_id


def test_a_cancel_ends_the_request_on_every_rank(ranks):
    assert 1 <= ranks[0]["cancelled_tokens"] < 60
    for seen in ranks:
        assert seen["completions"]["x0"][1] == "cancelled"


def test_shutdown_drains_on_every_rank(ranks):
    for seen in ranks:
        for request_id in ("d0", "d1"):
            tokens, reason = seen["completions"][request_id]
            assert reason == "length" and tokens == ranks[0]["unsplit"][request_id][0]


def test_a_follower_refuses_submissions(ranks):
    assert "submit requests on rank 0 only" in ranks[1]["follower_submit"]


def test_a_failure_of_rank_0_stops_the_followers(ranks):
    leader, follower = (seen["leader_failure"] for seen in ranks)
    assert "admission broke" in leader["error"] and "admission broke" in leader["engine_error"]
    assert follower["engine_error"] is None  # stopped by rank 0's record, not by a timeout


def test_ranks_whose_adapter_slots_differ_all_stop_saying_so(ranks):
    leader, follower = (seen["differing_adapters"] for seen in ranks)
    for error in (leader["request_error"], leader["engine_error"], follower["engine_error"]):
        assert "rank 1: adapter 'attn' is in slot" in error and "on rank 0" in error, error


def test_a_request_whose_adapter_is_reloaded_while_it_waits_fails_and_the_ranks_go_on(ranks):
    leader, follower = (seen["reloaded_while_queued"] for seen in ranks)
    assert leader["queued"] == [["length", None], ["length", None], ["length", None],
                                ["error", "the adapter 'other' was unloaded before the request started"]]
    assert leader["after"] == ["length", None]
    assert leader["engine_error"] is None and follower["engine_error"] is None


def test_compiled_steps_give_the_tokens_of_the_uncompiled_split_engine(ranks):
    """``compile_steps`` under tensor parallelism: each rank compiles its step whole (no graph break, the
    attention and transformers' all-reduce inside), and rank 0's concurrent requests get the tokens the uncompiled
    split engine gave, on every rank."""
    for rank in ranks:
        compiled = rank["compiled_steps"]
        assert compiled["graph_breaks"] == 0 and compiled["graphs"] > 0
        for request_id in CONCURRENT:
            assert compiled["completions"][request_id] == ranks[0]["completions"][request_id], request_id


def test_an_uneven_split_under_a_tight_pool_places_alike_on_every_rank(ranks):
    leader, follower = (rank["uneven_split"] for rank in ranks)
    assert leader["engine_error"] is None and follower["engine_error"] is None
    assert leader["chunk_sizes"] == follower["chunk_sizes"]  # sized as the widest rank's share on both
    assert {request_id: tokens for request_id, (tokens, error) in leader["split"].items()} == leader["unsplit"]
    assert all(error is None for _, error in leader["split"].values())
