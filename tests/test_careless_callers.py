"""Careless callers (issue 26): a wrapper used after ``unwrap()``, models copied, pickled and saved whole, the
wrapper's state dict, leases dropped without ``release()``, a single name where a list is expected, and threads
whose adapters together outnumber the device slots."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from torch import nn

from punica_hf import MultiLoraModel
from punica_hf.store import AdapterCapacityError

GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
IDS = torch.tensor([[5, 17, 42, 8, 99], [1, 2, 3, 4, 5], [60, 61, 62, 63, 64]])


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "first": save_peft_adapter(base, root / "first", r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "second": save_peft_adapter(base, root / "second", r=8, target_modules=["o_proj", "down_proj"], seed=2),
        "third": save_peft_adapter(base, root / "third", r=2, target_modules=["k_proj", "up_proj"], seed=3),
    }


def wrap(base, paths, **kwargs) -> MultiLoraModel:
    model = MultiLoraModel(copy.deepcopy(base), **{"max_adapters": 3, "max_rank": 8, **kwargs})
    model.load_adapters(paths)
    return model


def logits(model, adapter_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[: len(adapter_ids)], adapter_ids=adapter_ids).logits


def users(model: MultiLoraModel, name: str) -> int:
    """How many leases hold adapter ``name``."""
    return model._store._by_name[name].users


# ------------------------------------------------------------------------------------------------ after unwrap()
NEEDS_THE_WRAPPING = {
    "forward": lambda model, paths: model(IDS[:1], adapter_ids=["first"]),
    "forward-by-index": lambda model, paths: model(IDS[:1], adapter_ids=torch.tensor([0])),
    "generate": lambda model, paths: model.generate(IDS[:1], adapter_ids=["first"], **GREEDY),
    "load_adapters": lambda model, paths: model.load_adapters({"new": paths["third"]}),
    "unload_adapter": lambda model, paths: model.unload_adapter("first"),
    "acquire": lambda model, paths: model.acquire(["first"]),
    "acquire-nonblocking": lambda model, paths: model.acquire(["first"], block=False),
    "prefetch": lambda model, paths: model.prefetch(["third"]),
}


@pytest.mark.parametrize("call", NEEDS_THE_WRAPPING)
def test_calls_that_need_the_wrapping_are_refused_after_unwrap(base, paths, call):
    model = wrap(base, paths, max_adapters=2)
    plain = model.unwrap()
    adapters, stats = model.adapters, model.adapter_stats
    with pytest.raises(RuntimeError, match=r"was unwrapped.*MultiLoraModel\(model\)"):
        NEEDS_THE_WRAPPING[call](model, paths)
    assert model.adapters == adapters and model.adapter_stats == stats
    assert not any("forward" in module.__dict__ for module in plain.modules())  # no hook came back
    with torch.no_grad():  # the base model's calls still pass through
        torch.testing.assert_close(model(IDS).logits, base(IDS).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ copies
def round_trip(model: MultiLoraModel, how: str) -> MultiLoraModel:
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_pickle_carries_the_adapters_not_the_preallocated_memory(base, paths):
    """The host tier's segment (64 MiB here, 1 GiB by default) and the device pool are mostly free space."""
    model = wrap(base, paths, host_pool_bytes=64 << 20)
    adapter_bytes = model.adapter_stats["gpu_bytes_used"]
    base_bytes = len(pickle.dumps(base))
    pickled = len(pickle.dumps(model))
    # each adapter travels at most as its host copy, its device chunk and its source; plus the store's bookkeeping
    assert pickled < base_bytes + 3 * adapter_bytes + (256 << 10), (pickled, base_bytes, adapter_bytes)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="reads the resident memory from /proc")
def test_a_deep_copy_does_not_fill_a_copy_of_the_preallocated_memory(base, paths):
    model = wrap(base, paths)  # the default host budget: a 1 GiB segment
    gc.collect()
    before = _resident_bytes()
    copied = copy.deepcopy(model)
    assert _resident_bytes() - before < 64 << 20
    assert torch.equal(logits(copied, ["first", "second", None]), logits(model, ["first", "second", None]))


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_a_round_tripped_copy_serves_the_same_and_is_independent(base, paths, how):
    model = wrap(base, paths, max_adapters=2)
    mix = ["first", None, "third"]
    expected = logits(model, mix)
    restored = round_trip(model, how)
    torch.testing.assert_close(logits(restored, mix), expected, rtol=0, atol=0)
    torch.testing.assert_close(logits(restored, ["second", "third"]), logits(model, ["second", "third"]), rtol=0,
                               atol=0)
    # changes to one are not seen by the other
    model.unload_adapter("first")
    model.load_adapters({"first": paths["second"]})
    torch.testing.assert_close(logits(restored, mix), expected, rtol=0, atol=0)
    restored.unload_adapter("third")
    assert "third" in model.adapters and "third" not in restored.adapters
    restored.load_adapters({"fourth": paths["first"]})
    assert "fourth" not in model.adapters
    torch.testing.assert_close(logits(restored, ["fourth", None]), logits(restored, ["first", None]), rtol=0, atol=0)


def test_a_copy_does_not_inherit_the_leases_of_the_original(base, paths):
    model = wrap(base, paths, max_adapters=2)
    with model.acquire(["first", "second"]):
        copied = copy.deepcopy(model)
    # in the copy nothing holds "first" and "second": both give way to others
    with copied.acquire(["third", None], block=False) as lease:
        assert lease.slots[0] >= 0
    assert users(model, "first") == users(copied, "first") == 0


# ------------------------------------------------------------------------------------------------ state dict
def test_the_state_dict_is_the_wrapped_models(base, paths):
    model = wrap(base, paths)
    state = model.state_dict()
    assert state.keys() == base.state_dict().keys()
    assert all(torch.equal(state[key], value) for key, value in base.state_dict().items())

    other = tiny_llama(seed=1)
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, other(IDS).logits, rtol=0, atol=0)
    assert model.adapters.keys() == paths.keys()  # the adapters stay

    with pytest.raises(RuntimeError, match="Missing key"):  # the keys of the wrapper's submodule are not its keys
        model.load_state_dict({f"model.{key}": value for key, value in base.state_dict().items()})


def test_the_state_dict_round_trips_with_the_wrapper_inside_another_module(base, paths):
    outer = nn.ModuleDict({"lm": wrap(base, paths)})
    state = outer.state_dict()
    assert state.keys() == {f"lm.{key}" for key in base.state_dict()}
    outer.load_state_dict({f"lm.{key}": value for key, value in tiny_llama(seed=1).state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(outer["lm"](IDS).logits, tiny_llama(seed=1)(IDS).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ leases
def test_a_lease_dropped_without_release_gives_its_slot_back(base, paths):
    model = wrap(base, paths, max_adapters=1)
    model.acquire(["first"])  # dropped at once
    cycle = model.acquire(["second"])
    cycle.itself = cycle  # only the cyclic garbage collector frees this one
    del cycle
    gc.collect()
    with model.acquire(["third"], block=False) as lease:  # the only slot
        assert lease.slots == [0]
    assert users(model, "first") == users(model, "second") == 0


def test_release_counts_once_whoever_calls_it(base, paths):
    model = wrap(base, paths)
    lease = model.acquire(["first", "first", None])
    assert users(model, "first") == 1
    go = threading.Barrier(8)

    def release():
        go.wait()
        lease.release()

    threads = [threading.Thread(target=release) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lease.release()
    del lease
    gc.collect()
    assert users(model, "first") == 0
    with model.acquire(["first"]) as held:
        assert users(model, "first") == 1
    del held
    gc.collect()
    assert users(model, "first") == 0


@pytest.mark.parametrize("call", ["acquire", "prefetch"])
def test_a_single_name_is_one_adapter(base, paths, call):
    model = wrap(base, paths, max_adapters=2)  # "first" and "second" resident after loading
    if call == "acquire":
        with model.acquire("third") as lease:
            assert lease.slots == [model._store._by_name["third"].slot] and users(model, "third") == 1
    else:
        model.prefetch("third")
        assert model._store._by_name["third"].slot is not None


@pytest.mark.parametrize("call", ["acquire", "prefetch"])
def test_something_that_is_not_a_list_of_adapters_is_refused(base, paths, call):
    model = wrap(base, paths)
    with pytest.raises(ValueError, match="list of adapter names or indices, got 0"):
        getattr(model, call)(0)


def test_unload_takes_one_name(base, paths):
    model = wrap(base, paths)
    with pytest.raises(ValueError, match=r"unload_adapter takes one adapter name, got \['first'\]"):
        model.unload_adapter(["first"])
    assert model.adapters.keys() == paths.keys()


# ------------------------------------------------------------------------------------------------ waiting for slots
def generate_in_thread(model, adapter_ids, results: dict, key) -> threading.Thread:
    def run():
        try:
            results[key] = model.generate(IDS[: len(adapter_ids)], adapter_ids=adapter_ids, **GREEDY)
        except Exception as error:  # noqa: BLE001 - handed to the test
            results[key] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_threads_whose_adapters_together_do_not_fit_take_turns(base, paths):
    model = wrap(base, paths, max_adapters=1)
    calls = {(name, seed): [name] for name in paths for seed in range(3)}
    expected = {key: model.generate(IDS[:1], adapter_ids=ids, **GREEDY) for key, ids in calls.items()}
    results: dict = {}
    threads = [generate_in_thread(model, ids, results, key) for key, ids in calls.items()]
    for thread in threads:
        thread.join()
    for key, tokens in results.items():
        assert not isinstance(tokens, Exception), f"{key}: {tokens!r}"
        assert torch.equal(tokens, expected[key]), key


def test_a_call_waits_until_a_lease_ends(base, paths):
    model = wrap(base, paths, max_adapters=1)
    expected = model.generate(IDS[:1], adapter_ids=["second"], **GREEDY)
    lease = model.acquire(["first"])
    results: dict = {}
    thread = generate_in_thread(model, ["second"], results, "second")
    thread.join(0.5)
    assert thread.is_alive() and not results  # waiting for the slot "first" holds
    lease.release()
    thread.join(10)
    assert torch.equal(results["second"], expected)


def test_a_call_waits_until_a_dropped_lease_is_collected(base, paths):
    model = wrap(base, paths, max_adapters=1)
    leases = [model.acquire(["first"])]
    leases.append(leases)  # a cycle: freed by the garbage collector only
    results: dict = {}
    thread = generate_in_thread(model, ["second"], results, "second")
    thread.join(0.3)
    assert thread.is_alive()
    del leases
    gc.collect()
    thread.join(10)
    assert isinstance(results["second"], torch.Tensor)


def test_the_wait_has_a_time_limit_it_names(base, paths):
    model = wrap(base, paths, max_adapters=1, capacity_wait_s=0.3)
    with model.acquire(["first"]):
        started = time.monotonic()
        with pytest.raises(AdapterCapacityError, match=r"waited 0\.3 s .*held by running calls"):
            model.generate(IDS[:1], adapter_ids=["second"], **GREEDY)
        assert time.monotonic() - started >= 0.3
        with pytest.raises(AdapterCapacityError, match=r"waited 0\.1 s"):
            model.acquire(["second"], timeout=0.1)
    assert model.generate(IDS[:1], adapter_ids=["second"], **GREEDY).shape == (1, 9)


@pytest.mark.parametrize("value", [-1, float("nan"), "5", True])
def test_a_bad_wait_is_refused(base, paths, value):
    with pytest.raises(ValueError, match="capacity_wait_s"):
        MultiLoraModel(copy.deepcopy(base), capacity_wait_s=value)
    with pytest.raises(ValueError, match="timeout"):
        wrap(base, paths).acquire(["first"], timeout=value)


def test_a_nonblocking_acquire_does_not_wait(base, paths):
    model = wrap(base, paths, max_adapters=1, capacity_wait_s=30)
    with model.acquire(["first"]):
        started = time.monotonic()
        with pytest.raises(AdapterCapacityError, match="held by running calls"):
            model.acquire(["second"], block=False)
        assert time.monotonic() - started < 5


def test_adapters_that_can_never_fit_together_fail_at_once(base, paths):
    model = wrap(base, paths, max_adapters=2, capacity_wait_s=30)
    started = time.monotonic()
    with pytest.raises(AdapterCapacityError, match="3 different adapters but at most max_adapters=2"):
        model.generate(IDS, adapter_ids=["first", "second", "third"], **GREEDY)
    # a pool with room for "second" (the largest) alone: "second" and "third" never fit in it together
    sizes = {name: wrap(base, {name: path}).adapter_stats["gpu_bytes_used"] for name, path in paths.items()}
    small = wrap(base, paths, max_adapters=2, capacity_wait_s=30, gpu_pool_bytes=sizes["second"])
    with pytest.raises(AdapterCapacityError, match="need .* MiB on cpu together but the whole pool there is"):
        small.generate(IDS[:2], adapter_ids=["second", "third"], **GREEDY)
    assert time.monotonic() - started < 10
