"""One MultiLoraModel under what a server does to it: threads, loads and unloads during generation, failures
halfway through a load, inference mode, copies, pickles, saves and unwrapping."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from helpers import assert_state_unchanged, capture_state, save_peft_adapter
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from punica_hf import MultiLoraModel
from punica_hf.layers import LoraHook
from punica_hf.store import pool as pool_module

GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": save_peft_adapter(base, root / "a", r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "b": save_peft_adapter(base, root / "b", r=8, use_rslora=True, target_modules=["k_proj", "o_proj"], seed=2),
        "c": save_peft_adapter(base, root / "c", r=2, target_modules=["gate_proj", "down_proj"], seed=3),
    }


@pytest.fixture
def served(base, paths):
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)
    model.load_adapters(paths)
    return model


def batch(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 100, (rows, 5), generator=torch.Generator().manual_seed(seed))


def adapter_mix(rows: int, seed: int) -> list:
    choices = ["a", "b", "c", None]
    return [choices[(seed + i) % 4] for i in range(rows)]


# ------------------------------------------------------------------------------------------------ threads
def test_threads_get_their_single_threaded_outputs(served):
    trials = [(rows, seed) for seed in range(12) for rows in (1, 3, 4)][:24]
    with torch.no_grad():
        expected = {
            trial: (
                served(batch(*trial), adapter_ids=adapter_mix(*trial)).logits,
                served.generate(batch(*trial), adapter_ids=adapter_mix(*trial), **GREEDY),
            )
            for trial in trials
        }
    failures: list[str] = []

    def worker(my_trials):
        for trial in my_trials:
            with torch.no_grad():
                logits = served(batch(*trial), adapter_ids=adapter_mix(*trial)).logits
                tokens = served.generate(batch(*trial), adapter_ids=adapter_mix(*trial), **GREEDY)
            if not torch.equal(logits, expected[trial][0]) or not torch.equal(tokens, expected[trial][1]):
                failures.append(f"trial {trial} differs")

    threads = [threading.Thread(target=worker, args=(trials[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


# ------------------------------------------------------------------------------------------------ running calls
class _CallbackStreamer(BaseStreamer):
    """Calls ``on_step()`` once generation has started (after the prompt), i.e. in the middle of generate()."""

    def __init__(self, on_step) -> None:
        self.on_step, self.calls = on_step, 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.on_step()

    def end(self) -> None:
        pass


@pytest.mark.parametrize("change", ["unload", "unload-and-reload-other", "load-new"])
def test_a_running_generate_keeps_its_adapters(served, paths, change):
    ids = batch(2, 7)
    expected = served.generate(ids, adapter_ids=["a", "b"], **GREEDY)

    def on_step():
        if change == "load-new":
            served.load_adapters({"d": paths["c"]})
            return
        served.unload_adapter("a")
        if change == "unload-and-reload-other":
            served.load_adapters({"a": paths["c"]})  # same name, another adapter

    out = served.generate(ids, adapter_ids=["a", "b"], streamer=_CallbackStreamer(on_step), **GREEDY)
    assert torch.equal(out, expected)
    if change == "unload":
        assert "a" not in served.adapters and served.adapter_stats["resident"] == 2  # freed when generate ended
    elif change == "unload-and-reload-other":
        assert not torch.equal(served.generate(ids, adapter_ids=["a", "b"], **GREEDY), expected)


def test_unload_from_another_thread_waits_for_the_running_call(served):
    ids = batch(1, 3)
    expected = served.generate(ids, adapter_ids=["b"], max_new_tokens=12, do_sample=False, pad_token_id=0)
    started, unloaded = threading.Event(), threading.Event()

    def unload_when_started():
        started.wait(10)
        served.unload_adapter("b")
        unloaded.set()

    thread = threading.Thread(target=unload_when_started)
    thread.start()
    streamer = _CallbackStreamer(started.set)
    out = served.generate(ids, adapter_ids=["b"], max_new_tokens=12, do_sample=False, pad_token_id=0, streamer=streamer)
    thread.join()
    assert unloaded.is_set() and torch.equal(out, expected)
    with pytest.raises(KeyError, match="unknown adapter 'b'"):
        served(ids, adapter_ids=["b"])


# ------------------------------------------------------------------------------------------------ atomic changes
def test_load_in_inference_mode_then_unload_outside_it(base, paths):
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    with torch.inference_mode():
        model.load_adapters({"a": paths["a"]})
        logits = model(batch(1, 0), adapter_ids=["a"]).logits
    model.unload_adapter("a")
    model.load_adapters({"b": paths["b"]})
    with torch.no_grad():
        assert model(batch(1, 0), adapter_ids=["b"]).logits.shape == logits.shape
    assert model.adapters == {"b": 0}


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_load_changes_nothing(served, paths, monkeypatch, interrupt):
    served.unload_adapter("c")
    before = capture_state(served, batch(3, 1), ["a", "b", None])
    real_fill = pool_module.ChunkLayout.fill
    calls = []

    def failing_fill(self, chunk, factors):
        calls.append(1)
        if len(calls) == 2:  # the second adapter of the call: the first one's copy is already made
            raise interrupt("interrupted halfway through a load")
        return real_fill(self, chunk, factors)

    monkeypatch.setattr(pool_module.ChunkLayout, "fill", failing_fill)
    with pytest.raises(interrupt):
        served.load_adapters({"c": paths["c"], "d": paths["c"]})
    monkeypatch.setattr(pool_module.ChunkLayout, "fill", real_fill)
    assert_state_unchanged(served, before)
    assert served.load_adapters({"c": paths["c"]}) == {"c": 2}


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_a_load_interrupted_while_placing_its_adapters_changes_nothing(served, paths, monkeypatch, interrupt):
    """A failure once the call's first adapter is registered and on the device (a CUDA error, an interrupt) used to
    leave both adapters registered with their host copies' memory given back under them: a later load reused it, and
    the first adapter, read back from the host, ran the later one's factors."""
    ids, counted = batch(3, 2), ("registered", "resident", "host_bytes_used", "gpu_bytes_used")
    with torch.no_grad():
        c_logits = served(ids, adapter_ids=["c", "c", "c"]).logits
    served.unload_adapter("c")
    stats = {key: served.adapter_stats[key] for key in counted}
    adapters = served.adapters
    with torch.no_grad():
        logits = served(ids, adapter_ids=["a", "b", None]).logits
    real_place, calls = pool_module.DevicePool.place, []

    def failing_place(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second adapter of the call: the first one is registered and placed
            raise interrupt("interrupted while placing")
        return real_place(self, *args, **kwargs)

    monkeypatch.setattr(pool_module.DevicePool, "place", failing_place)
    with pytest.raises(interrupt):
        served.load_adapters({"c": paths["c"], "d": paths["a"]})
    monkeypatch.setattr(pool_module.DevicePool, "place", real_place)
    assert served.adapters == adapters and {key: served.adapter_stats[key] for key in counted} == stats
    with torch.no_grad():
        assert torch.equal(served(ids, adapter_ids=["a", "b", None]).logits, logits)
    assert served.load_adapters({"c": paths["c"], "e": paths["b"]}) == {"c": 2, "e": 3}
    with torch.no_grad():
        served(ids, adapter_ids=["e", "a", "b"])  # uses the host memory the failed call had
        assert torch.equal(served(ids, adapter_ids=["c", "c", "c"]).logits, c_logits)


def test_a_failed_load_leaves_the_hooks_another_running_load_planned_on(base, paths, monkeypatch):
    """Three loads at once: A and C both load "x" (A first), B loads "y" on A's modules. C registers "x", so A fails:
    its undo used to remove the hooks it had made though B, still building its copies, had planned on them, and "y"
    then served the base model's outputs."""
    served = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)  # no hook yet
    reference = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    reference.load_adapters({"y": paths["a"]})
    ids = batch(2, 4)
    with torch.no_grad():
        expected = reference(ids, adapter_ids=["y", None]).logits
    real_chunks = type(served._store)._host_chunks
    arrived = {name: threading.Event() for name in "ACB"}
    go_on = {name: threading.Event() for name in "ACB"}

    def held_chunks(self, *args, **kwargs):
        name = threading.current_thread().name
        if name in arrived:  # planned: wait for the test's word before building the copies
            arrived[name].set()
            assert go_on[name].wait(30)
        return real_chunks(self, *args, **kwargs)

    monkeypatch.setattr(type(served._store), "_host_chunks", held_chunks)
    results = {}

    def load(name, sources):
        try:
            results[name] = served.load_adapters(sources)
        except ValueError as error:
            results[name] = error

    threads = {name: threading.Thread(target=load, name=name, args=(name, sources)) for name, sources in
               (("A", {"x": paths["a"]}), ("C", {"x": paths["b"]}), ("B", {"y": paths["a"]}))}
    for name in "ACB":  # planned in this order
        threads[name].start()
        assert arrived[name].wait(30)
    for name in "CAB":  # C registers "x"; A fails; then B registers
        go_on[name].set()
        threads[name].join(30)
    assert isinstance(results["A"], ValueError) and "already loaded" in str(results["A"])
    assert set(results["C"]) == {"x"} and set(results["B"]) == {"y"}
    with torch.no_grad():
        got = served(ids, adapter_ids=["y", None]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ copies and saves
def test_deepcopy_is_an_independent_working_model(served):
    ids, mix = batch(3, 2), ["a", "c", None]
    with torch.no_grad():
        expected = served(ids, adapter_ids=mix).logits
    copied = copy.deepcopy(served)
    hooked = [m for m in copied.model.modules() if isinstance(m.__dict__.get("forward"), LoraHook)]
    assert hooked and all(m.forward.module is m for m in hooked)  # each copied hook calls its own copied module
    served.unload_adapter("a")
    served.load_adapters({"a": _other_adapter(served)})
    with torch.no_grad():
        served.model.model.layers[0].self_attn.q_proj.weight.zero_()  # the original's weights: not the copy's
        torch.testing.assert_close(copied(ids, adapter_ids=mix).logits, expected, rtol=0, atol=0)
        assert not torch.equal(served(ids, adapter_ids=mix).logits, expected)
    copied.unload_adapter("c")
    assert "c" in served.adapters


def _other_adapter(model: MultiLoraModel):
    """Adapter weights for the model that differ from any saved one (from an in-memory PEFT state)."""
    from punica_hf.formats import AdapterWeights, LoraAdapterConfig, ModuleLora

    torch.manual_seed(11)
    config = LoraAdapterConfig(r=2, lora_alpha=2)
    q = model.model.model.layers[0].self_attn.q_proj
    modules = {"model.layers.0.self_attn.q_proj": ModuleLora(torch.randn(2, q.in_features), torch.randn(q.out_features, 2))}
    return AdapterWeights(modules=modules, config=config, source="memory")


def test_pickle_round_trip(served):
    ids, mix = batch(3, 4), ["b", None, "a"]
    with torch.no_grad():
        expected = served(ids, adapter_ids=mix).logits
        restored = pickle.loads(pickle.dumps(served))
        torch.testing.assert_close(restored(ids, adapter_ids=mix).logits, expected, rtol=0, atol=0)
    hooked = [m for m in restored.model.modules() if isinstance(m.__dict__.get("forward"), LoraHook)]
    assert hooked and all(m.forward.module is m for m in hooked)
    # Each adapter of the copy is a registration of this process: the pickled numbers were another process's, and
    # here may be another adapter's (an engine keys its shared KV pages by them).
    given_before = max(served.adapter_registration(name) for name in served.adapters)
    registrations = [restored.adapter_registration(name) for name in restored.adapters]
    assert len(set(registrations)) == len(registrations) and min(registrations) > given_before


def test_state_dict_and_save_pretrained_are_the_clean_base(served, base, tmp_path):
    assert served.model.state_dict().keys() == base.state_dict().keys()
    served.model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = batch(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, base(ids).logits, rtol=0, atol=0)


def test_unwrap_returns_the_untouched_base(served, base):
    ids = batch(2, 6)
    model = served.unwrap()
    assert "forward" not in model.__dict__
    assert not any(module._forward_hooks or "forward" in module.__dict__ for module in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    assert torch.equal(model.generate(ids, **GREEDY), base.generate(ids, **GREEDY))
    MultiLoraModel(model)  # can be wrapped again


def test_unwrap_is_refused_while_a_running_call_holds_adapters(served, base):
    """unwrap() in the middle of a generate() with adapters used to take the hooks away under it: its remaining steps
    ran the base model (the restored forward swallowed adapter_ids). Now it is refused, and works once the call ends."""
    ids = batch(2, 8)
    expected = served.generate(ids, adapter_ids=["a", "c"], **GREEDY)
    refused = []

    def unwrap_midway():
        try:
            served.unwrap()
        except RuntimeError as error:
            refused.append(error)

    out = served.generate(ids, adapter_ids=["a", "c"], streamer=_CallbackStreamer(unwrap_midway), **GREEDY)
    assert torch.equal(out, expected)
    assert len(refused) == 1 and "running calls hold the adapters ['a', 'c']" in str(refused[0])
    model = served.unwrap()  # nothing holds an adapter now
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ generate modes
def test_assisted_generation_with_adapters_is_refused_clearly(served, base):
    with pytest.raises(ValueError, match="assistant_model=.*not supported.*prompt_lookup_num_tokens"):
        served.generate(batch(1, 0), adapter_ids=["a"], assistant_model=base, **GREEDY)


def test_prompt_lookup_decoding_keeps_the_adapter(served):
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    plain = served.generate(ids, adapter_ids=["b"], **GREEDY)
    looked_up = served.generate(ids, adapter_ids=["b"], prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(plain, looked_up)
