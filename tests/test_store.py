"""The adapter store: more registered adapters than fit on the device, LRU residency, the host tier, background
reads, counters and rank-proportional memory; outputs equal PEFT's row by row throughout."""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time

import pytest
import torch
from helpers import save_peft_adapter
from peft import PeftModel

from punica_hf import AdapterWeights, MultiLoraModel, load_adapter_weights
from punica_hf.base_layers import LinearModule
from punica_hf.store import AdapterCapacityError, AdapterNotReady, AdapterReadError, AdapterStore
from punica_hf.store import host as host_module
from punica_hf.store import store as store_module

IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]])
SPECS = {  # name -> (rank, targets): mixed ranks and target sets
    "r2": (2, ["q_proj", "v_proj"]),
    "r4": (4, ["k_proj", "o_proj", "down_proj"]),
    "r8": (8, ["q_proj", "gate_proj"]),
    "r4b": (4, ["v_proj", "up_proj"]),
    "r8b": (8, ["o_proj"]),
}


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_peft_adapter(base, root / name, r=rank, lora_alpha=2 * rank, target_modules=targets, seed=i)
        for i, (name, (rank, targets)) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def peft_logits(base, paths):
    """Each adapter's PEFT logits for every row of IDS, and the base model's."""
    with torch.no_grad():
        logits = {name: PeftModel.from_pretrained(copy.deepcopy(base), path).eval()(IDS).logits for name, path in paths.items()}
        logits[None] = base(IDS).logits
    return logits


def wrap(base, **kwargs) -> MultiLoraModel:
    return MultiLoraModel(copy.deepcopy(base), **{"max_adapters": 2, "max_rank": 8, **kwargs})


def check_rows(model: MultiLoraModel, mix: list, peft_logits) -> None:
    with torch.no_grad():
        logits = model(IDS, adapter_ids=mix).logits
    for row, name in enumerate(mix):
        torch.testing.assert_close(logits[row], peft_logits[name][row], rtol=0, atol=2e-5)


def test_more_registered_than_fit_with_evictions(base, paths, peft_logits):
    model = wrap(base)
    indices = model.load_adapters(paths)
    assert sorted(indices.values()) == list(range(5)) and model.adapter_stats["registered"] == 5
    batches = [["r2", "r4", None], ["r8", None, "r8"], ["r4b", "r8b", "r4b"], ["r2", "r4", "r2"], [None, "r8b", "r8"]]
    for mix in batches * 2:
        check_rows(model, mix, peft_logits)
    stats = model.adapter_stats
    assert stats["evictions"] > 0 and stats["resident"] <= 2 and model.adapters == indices  # indices stay stable
    # by index, too
    check_rows(model, [indices["r4b"], -1, indices["r2"]], {indices[k]: v for k, v in peft_logits.items() if k} | {-1: peft_logits[None]})


def test_lru_evicts_the_least_recently_used_unheld_adapter(base, paths):
    model = wrap(base, max_adapters=2)
    model.load_adapters(paths)  # r2 and r4 land on the device at load, the rest wait on the host
    store = model._store
    resident = lambda: {a.name for a in store._resident.values()}  # noqa: E731
    assert resident() == {"r2", "r4"}
    with torch.no_grad():
        model(IDS[:1], adapter_ids=["r2"])  # r4 is now the least recently used
        model(IDS[:1], adapter_ids=["r8"])
    assert resident() == {"r2", "r8"}
    with model.acquire(["r2"]):  # held: not evicted although least recently used
        with torch.no_grad():
            model(IDS[:1], adapter_ids=["r4"])
        assert resident() == {"r2", "r4"}
        with pytest.raises(AdapterCapacityError, match="held by running calls"):
            model.acquire(["r8", "r4b"], block=False)  # a blocking call would wait for the lease to end
    assert resident() == {"r2", "r4"}


def test_an_acquire_that_finds_no_long_enough_extent_evicts_nothing(base, tmp_path):
    """The pool has the bytes for X once the unheld A and B go, but not in one piece while H, held, sits between
    them: the acquire fails having evicted nothing (it used to evict A and B first), and a later one finds them
    where they were. Under tensor parallelism only rank 0 makes a failed attempt: its slots would part from the
    other ranks'. When H is let go, X gets its room."""
    q_proj = ["model.layers.0.self_attn.q_proj"]
    paths = {name: save_peft_adapter(base, tmp_path / name, seed=seed, r=rank, target_modules=q_proj)
             for seed, (name, rank) in enumerate([("A", 2), ("H", 2), ("B", 2), ("X", 6)])}
    # q_proj is 32 x 32 in float32: a rank-r chunk is 64 r elements; the pool holds four rank-2 chunks
    model = wrap(base, max_adapters=4, gpu_pool_bytes=512 * 4)
    model.load_adapters(paths)
    model.acquire(["A"]).release()
    held = model.acquire(["H"])
    model.acquire(["B"]).release()
    slots = lambda: {name: model._store._by_name[name].slot for name in "AHBX"}  # noqa: E731
    before = slots()
    assert before == {"A": 0, "H": 1, "B": 2, "X": None}
    for block in (False, True):
        with pytest.raises(AdapterCapacityError, match="no free extent long enough"):
            model.acquire(["X"], block=block, timeout=0)
        assert slots() == before and model.adapter_stats["evictions"] == 0
    model.prefetch(["X"])  # nor does a prefetch that finds no room
    assert slots() == before and model.adapter_stats["evictions"] == 0
    held.release()
    with model.acquire(["X"], block=False) as lease:
        assert lease.slots[0] is not None and model.adapter_stats["evictions"] >= 2


@pytest.mark.parametrize("host_pool_bytes", [None, 1536], ids=["host-copies-kept", "no-host-copy-of-R"])
@pytest.mark.parametrize(("r_rank", "pool_elements"), [(2, 512), (4, 640)], ids=["room-to-spare", "exact-fit"])
def test_an_acquire_moves_its_own_resident_adapter_that_splits_the_room(base, tmp_path, r_rank, pool_elements,
                                                                        host_pool_bytes):
    """Nothing is held; R sits in the middle of the pool, so X finds no extent long enough while R stays where it
    is. acquire(["R", "X"]) moves R (and evicts A, unheld) rather than wait for a release that cannot help: it used
    to wait its whole timeout, then refuse. Whether R's host copy was kept does not matter (under tensor
    parallelism ranks may keep different copies, and must place alike): R is read again before anything moves."""
    q_proj = ["model.layers.0.self_attn.q_proj"]
    paths = {name: save_peft_adapter(base, tmp_path / name, seed=seed, r=rank, target_modules=q_proj)
             for seed, (name, rank) in enumerate([("A", 2), ("R", r_rank), ("X", 6)])}
    # rank r on q_proj (32 x 32, float32) is 64 r elements
    model = wrap(base, max_adapters=4, gpu_pool_bytes=pool_elements * 4, host_pool_bytes=host_pool_bytes)
    model.load_adapters(paths)
    store = model._store
    assert store._by_name["R"].chunk_starts == {torch.device("cpu"): 128}
    with torch.no_grad():
        before = model(IDS, adapter_ids=["R", None, "R"]).logits
    for block in (False, True):
        if block is False and host_pool_bytes is not None:
            continue  # R would be read in the background first (AdapterNotReady)
        with model.acquire(["R", "X"], block=block, timeout=0) as lease:
            assert lease.slots == [store._by_name["R"].slot, store._by_name["X"].slot]
        with torch.no_grad():  # R computes as before, from where it was moved to
            torch.testing.assert_close(model(IDS, adapter_ids=["R", None, "R"]).logits, before, rtol=0, atol=0)
    assert store._by_name["R"].chunk_starts != {torch.device("cpu"): 128}


def test_reading_one_adapter_of_an_acquire_keeps_the_host_copies_of_the_others(base, tmp_path):
    """acquire(["X", "Y"]): X is read from its folder into a host tier with room for one copy, where Y's copy is.
    Y's copy stays (X's is kept outside the tier for this use), so placing Y needs no read of its folder, gone
    since: the acquire succeeds. Reading X used to drop Y's copy; placing Y then read its folder, and the acquire
    failed having evicted P, Q and R and placed X."""
    q_proj = ["model.layers.0.self_attn.q_proj"]
    paths = {name: save_peft_adapter(base, tmp_path / name, seed=seed, r=rank, target_modules=q_proj)
             for seed, (name, rank) in enumerate([("P", 2), ("Q", 2), ("R", 4), ("X", 4), ("Y", 2)])}
    model = wrap(base, max_adapters=4, gpu_pool_bytes=512 * 4, host_pool_bytes=3072)
    for name in "PQRXY":
        model.load_adapters({name: paths[name]})
    store = model._store
    assert store._by_name["Y"].index in store.host and store._by_name["X"].index not in store.host
    shutil.rmtree(paths["Y"])
    with model.acquire(["X", "Y"], timeout=1) as lease:
        assert all(slot >= 0 for slot in lease.slots)


def test_counters_and_rank_proportional_memory(base, paths):
    model = wrap(base, max_adapters=5)
    model.load_adapters({"r8b": paths["r8b"]})
    used_r8 = model.adapter_stats["gpu_bytes_used"]
    o_proj = model.model.model.layers[0].self_attn.o_proj
    factor_bytes = 2 * 8 * (o_proj.in_features + o_proj.out_features) * 4  # 2 layers, rank 8, fp32
    assert used_r8 == factor_bytes
    rank4 = save_peft_adapter(base, paths["r8b"].parent / "o_r4", r=4, target_modules=["o_proj"])
    model.load_adapters({"o4": rank4})
    assert model.adapter_stats["gpu_bytes_used"] - used_r8 == factor_bytes // 2
    with torch.no_grad():
        model(IDS, adapter_ids=["r8b", "o4", "o4"])
    stats = model.adapter_stats
    assert stats["hits"] == 2 and stats["host_loads"] == 2 and stats["disk_loads"] == 0
    assert stats["bytes_to_gpu"] == stats["gpu_bytes_used"] == stats["host_bytes_used"]


def test_host_budget_forces_reads_from_disk(base, paths, peft_logits):
    sizes = []
    for name, path in paths.items():
        scratch = wrap(base)
        scratch.load_adapters({name: path})
        sizes.append(scratch.adapter_stats["host_bytes_used"])
    one_adapter = max(sizes)  # the host tier holds one adapter at a time
    model = wrap(base, max_adapters=2, host_pool_bytes=one_adapter)
    model.load_adapters(paths)
    for mix in (["r8", "r8b", None], ["r4b", "r2", None], ["r8", None, "r8b"], ["r4", "r2", "r4"]):
        check_rows(model, mix, peft_logits)
    stats = model.adapter_stats
    assert stats["disk_loads"] >= 2 and stats["host_bytes_used"] <= one_adapter


def test_a_host_budget_too_small_for_one_adapter_is_refused(base, paths):
    model = wrap(base, host_pool_bytes=100)
    with pytest.raises(ValueError, match="host memory but host_pool_bytes is"):
        model.load_adapters({"r2": paths["r2"]})
    assert model.adapters == {} and model.adapter_stats["host_bytes_used"] == 0


def test_a_pool_too_small_for_one_adapter_is_refused(base, paths):
    model = wrap(base, gpu_pool_bytes=1000)
    with pytest.raises(ValueError, match="whole pool there is .* MiB \\(raise gpu_pool_bytes\\)"):
        model.load_adapters({"r8": paths["r8"]})
    assert model.adapters == {}


def test_a_source_changed_on_disk_is_refused_when_read_again(base, paths, tmp_path, peft_logits):
    moved = shutil.copytree(paths["r4"], tmp_path / "r4")
    model = wrap(base, max_adapters=1, host_pool_bytes=1)  # nothing stays on the host: every use re-reads
    with pytest.raises(ValueError):
        model.load_adapters({"r4": moved})  # even one adapter does not fit a 1-byte host tier
    model = wrap(base, max_adapters=1)
    model.load_adapters({"r4": moved, "r2": paths["r2"]})
    model._store.host.drop(model.adapters["r4"])
    check_rows(model, ["r2", None, None], peft_logits)  # evicts r4
    shutil.rmtree(moved)
    shutil.copytree(paths["r8b"], moved)  # another adapter at the same path
    with pytest.raises(ValueError, match="changed at .* since it was loaded"):
        model(IDS, adapter_ids=["r4", None, None])
    check_rows(model, ["r2", None, "r2"], peft_logits)  # still serving


def test_in_memory_weights_changed_after_their_load_are_refused_when_read_again(base, paths, peft_logits):
    """AdapterWeights are kept by reference and read again once their host copy is dropped: tensors a caller reused
    for other values (NaN here) used to go onto the device unchecked."""
    weights = load_adapter_weights(paths["r8"])
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r8": weights, "r2": paths["r2"]})
    check_rows(model, ["r8", "r2", None], peft_logits)
    model.load_adapters({"r4": paths["r4"]})
    check_rows(model, ["r4", "r2", None], peft_logits)  # r8 leaves the device
    model._store.host.drop(model.adapters["r8"])  # and the host
    next(iter(weights.modules.values())).lora_a.fill_(float("nan"))  # the caller reuses its tensors
    with pytest.raises(ValueError, match=r"adapter 'r8' changed in the AdapterWeights of .* since it was loaded: "
                                         r".*NaN or Inf values.*keep them unchanged"):
        model(IDS, adapter_ids=["r8", None, None])
    check_rows(model, ["r4", "r2", None], peft_logits)  # still serving


def test_block_false_reads_in_the_background(base, paths, peft_logits):
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"], "r8": paths["r8"]})
    model._store.host.drop(model.adapters["r8"])
    with pytest.raises(AdapterNotReady, match="'r8' is being read"):
        model.acquire(["r8"], block=False)
    deadline = time.monotonic() + 10
    while True:
        try:
            lease = model.acquire(["r8"], block=False)
            break
        except AdapterNotReady:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    lease.release()
    check_rows(model, ["r8", None, "r8"], peft_logits)


def _acquire_when_read(model, names, deadline_s=10.0):
    """``acquire(block=False)`` until the background read is over: its lease, or the error it raised."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return model.acquire(names, block=False)
        except AdapterNotReady:
            assert time.monotonic() < deadline, "the background read never ended"
            time.sleep(0.01)


def host_bytes(base, path) -> int:
    """What one adapter's copy takes in the host tier."""
    scratch = wrap(base)
    scratch.load_adapters({"one": path})
    return scratch.adapter_stats["host_bytes_used"]


def test_non_blocking_acquires_of_two_cold_adapters_whose_copies_do_not_fit_together_get_there(base, paths,
                                                                                                  peft_logits):
    """Each non-blocking try reads one missing adapter of the batch in the background: that read used to drop the
    host copy of the batch's other adapter, read by the try before, so every try found one missing (one more disk
    read each, never ready), where a blocking acquire keeps the batch's copies."""
    r8, r4 = host_bytes(base, paths["r8"]), host_bytes(base, paths["r4"])
    model = wrap(base, max_adapters=2, host_pool_bytes=r8 + r4 - 512)  # room for either, not both
    model.load_adapters({"r2": paths["r2"], "r8b": paths["r8b"]})  # resident: the two slots
    model.load_adapters({"r4": paths["r4"]})  # its copy in the host tier
    model.load_adapters({"r8": paths["r8"]})  # its copy in the host tier, in place of r4's
    model.unload_adapter("r2")
    model.unload_adapter("r8b")
    assert model.adapters["r8"] in model._store.host and model.adapters["r4"] not in model._store.host
    lease = _acquire_when_read(model, ["r8", "r4"])
    lease.release()
    check_rows(model, ["r8", "r4", None], peft_logits)


def test_a_copy_that_cannot_fit_the_host_tier_drops_no_other_copy(base, paths):
    """Dropping every other copy could not make room for it (a resident adapter's copy stays): it used to drop them
    all, be kept outside the tier anyway, and the dropped adapters were read from their sources again."""
    r8, r2, r4 = (host_bytes(base, paths[name]) for name in ("r8", "r2", "r4"))
    model = wrap(base, max_adapters=1, host_pool_bytes=r8 + r4 - 512)
    assert r8 + r2 <= r8 + r4 - 512
    model.load_adapters({"r8": paths["r8"]})  # resident: its copy stays
    model.load_adapters({"r2": paths["r2"]})  # no slot: its copy is kept in the tier
    model.load_adapters({"r4": paths["r4"]})  # fits beside r8's copy whatever is dropped
    assert model.adapters["r2"] in model._store.host
    loads = model.adapter_stats["disk_loads"]
    model.acquire(["r2"]).release()
    assert model.adapter_stats["disk_loads"] == loads


def test_the_host_tier_drops_no_copy_where_the_room_it_would_free_lies_in_pieces():
    """Its free bytes after dropping may suffice while no free extent is long enough: it used to drop the copies all
    the same (their adapters read from disk again later), and keep the new one outside the tier anyway."""
    tier, cpu = host_module.HostTier(budget=4096), torch.device("cpu")
    for index in range(4):  # 1,024 bytes each: the one segment full
        assert tier.put(index, tier.allocate({cpu: (256, torch.float32)}))
    # 1 and 3 held: dropping 0 and 2 would free 2,048 bytes, in two pieces of 1,024
    outside = tier.allocate({cpu: (512, torch.float32)}, keep=[1, 3])
    assert not outside.extents and [index in tier for index in range(4)] == [True] * 4
    # 2 held: dropping 0, then 1 (least recently used first), frees 2,048 bytes in one piece; 3 stays
    inside = tier.allocate({cpu: (512, torch.float32)}, keep=[2])
    assert inside.extents and [index in tier for index in range(4)] == [False, False, True, True]
    assert tier.used == 4096


def test_the_host_tier_drops_the_copy_used_least_recently_not_the_one_placed_least_recently(base, tmp_path):
    """An adapter served from the device again and again kept the age of its placement in the host tier: once off
    the device, its copy went before those of adapters last used long before it."""
    paths = {name: save_peft_adapter(base, tmp_path / name, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                     seed=40 + i) for i, name in enumerate("ABCDEF")}
    model = wrap(base, max_adapters=2, host_pool_bytes=4 * host_bytes(base, paths["A"]))  # four copies

    def use(*names: str) -> None:
        for name in names:
            model.acquire([name]).release()

    model.load_adapters({"A": paths["A"], "B": paths["B"]})
    use("A")
    model.load_adapters({"C": paths["C"]})
    use("C", "A")  # A, on the device since its load, used last of the three
    model.load_adapters({"D": paths["D"]})
    model.load_adapters({"E": paths["E"]})
    use("D", "E")  # the device holds D and E; used least recently first: B, C, A, D, E
    model.load_adapters({"F": paths["F"]})  # one more copy: C's goes (B's went for E's)
    host = model._store.host
    assert [name for name in "ABCDEF" if model.adapters[name] in host] == ["A", "D", "E", "F"]
    loads = model.adapter_stats["disk_loads"]
    use("A")
    assert model.adapter_stats["disk_loads"] == loads


def test_a_failed_background_read_is_said_once_and_read_again(base, paths, peft_logits, tmp_path):
    """A source missing for a moment (a redeploy, a network file system) fails the background read: the next
    non-blocking acquire says why (once), and the one after reads the source again (it used to stay "being read"
    for good, and an engine's requests for the adapter waited forever)."""
    moved = shutil.copytree(paths["r8"], tmp_path / "r8")
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"], "r8": moved})  # r8 finds no free slot
    model._store.host.drop(model.adapters["r8"])
    away = shutil.move(moved, tmp_path / "away")
    with pytest.raises(AdapterNotReady):
        model.acquire(["r8"], block=False)
    with pytest.raises(AdapterReadError, match=r"'r8' could not be read from .*r8"):
        _acquire_when_read(model, ["r8"])
    shutil.move(away, moved)  # back
    with pytest.raises(AdapterNotReady):
        model.acquire(["r8"], block=False)  # a new read
    _acquire_when_read(model, ["r8"]).release()
    check_rows(model, ["r8", "r2", None], peft_logits)


def test_a_read_failure_nobody_asked_about_in_time_is_not_told_to_a_later_caller(base, paths, tmp_path, monkeypatch):
    """The caller that started a background read went away (a cancelled request): its failure used to be told to
    whichever acquire came next, however much later, though the source was back by then."""
    monkeypatch.setattr(store_module, "READ_FAILURE_TOLD_S", 0.2)
    moved = shutil.copytree(paths["r8"], tmp_path / "r8")
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"], "r8": moved})
    model._store.host.drop(model.adapters["r8"])
    away = shutil.move(moved, tmp_path / "away")
    with pytest.raises(AdapterNotReady):
        model.acquire(["r8"], block=False)
    deadline = time.monotonic() + 10
    while model._store._by_name["r8"].reading is not None:  # the read fails, and nobody asks
        assert time.monotonic() < deadline
        time.sleep(0.01)
    shutil.move(away, moved)
    time.sleep(0.3)
    with pytest.raises(AdapterNotReady):  # not the old failure: a new read
        model.acquire(["r8"], block=False)
    _acquire_when_read(model, ["r8"]).release()


def test_a_failed_prefetch_is_logged_and_the_next_use_reads_again(base, paths, peft_logits, tmp_path, caplog):
    """A prefetch is a hint nobody waits for: its failure is logged, and not handed to a later request."""
    moved = shutil.copytree(paths["r8"], tmp_path / "r8")
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"], "r8": moved})
    model._store.host.drop(model.adapters["r8"])
    away = shutil.move(moved, tmp_path / "away")
    model.prefetch(["r8"])
    deadline = time.monotonic() + 10
    while "prefetching adapter 'r8' failed" not in caplog.text:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    shutil.move(away, moved)
    with pytest.raises(AdapterNotReady):
        model.acquire(["r8"], block=False)
    _acquire_when_read(model, ["r8"]).release()
    check_rows(model, ["r8", "r2", None], peft_logits)


def test_acquire_for_a_registration_refuses_a_reloaded_name_before_placing_it(base, paths):
    """A caller that waited asks for the load it saw: another load under the name is refused, and not placed."""
    model = wrap(base, max_adapters=2)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"], "r8": paths["r8"]})  # r8: no slot free
    seen = model.adapter_registration("r8")
    model.unload_adapter("r8")
    model.load_adapters({"r8": paths["r8b"]})
    resident = model.adapter_stats["resident"], {a.name for a in model._store._resident.values()}
    with pytest.raises(KeyError, match="'r8' was unloaded and loaded again"):
        model.acquire(["r8"], block=False, registrations=[seen])
    assert (model.adapter_stats["resident"], {a.name for a in model._store._resident.values()}) == resident
    with pytest.raises(ValueError, match="1 adapters but 2 registrations"):
        model.acquire(["r8"], registrations=[seen, None])
    model.acquire(["r8", None], registrations=[model.adapter_registration("r8"), None]).release()


def test_prefetch_brings_an_adapter_on_the_device(base, paths):
    model = wrap(base, max_adapters=3)
    model.load_adapters(paths)
    store = model._store
    assert "r8b" not in {a.name for a in store._resident.values()}
    model.prefetch(["r8b"])
    deadline = time.monotonic() + 10
    while "r8b" not in {a.name for a in store._resident.values()}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    hits = model.adapter_stats["hits"]
    model.acquire(["r8b"]).release()
    assert model.adapter_stats["hits"] == hits + 1


def test_a_load_during_generate_leaves_the_running_outputs_unchanged(base, paths):
    model = wrap(base, max_adapters=3)
    model.load_adapters({"r2": paths["r2"], "r4": paths["r4"]})
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(IDS, adapter_ids=["r2", "r4", None], **kwargs)
    done = threading.Event()

    def load_and_use_others():
        while not done.is_set():  # loads and batches that need room: only unheld adapters may be evicted
            name = f"x{time.monotonic_ns()}"
            model.load_adapters({name: paths["r8"]})
            with torch.no_grad():
                model(IDS[:1], adapter_ids=[name])
            model.unload_adapter(name)

    thread = threading.Thread(target=load_and_use_others)
    thread.start()
    try:
        out = model.generate(IDS, adapter_ids=["r2", "r4", None], **kwargs)
    finally:
        done.set()
        thread.join()
    assert torch.equal(out, expected)


def test_layout_version_counts_new_hooks_and_an_interrupted_load_leaves_none(base, paths, peft_logits, monkeypatch):
    """``layout_version`` (what the engine's CUDA graphs are keyed on) moves when a load hooks new modules, not when
    it reuses hooked ones; a load interrupted while hooking removes the hooks it made and leaves the version ahead
    (graphs captured in between saw them)."""
    import punica_hf.injection as injection

    model = wrap(base, max_adapters=3)
    assert model.layout_version == 0
    model.load_adapters({"r2": paths["r2"]})  # q_proj, v_proj
    hooked = model.layout_version
    assert hooked > 0
    model.load_adapters({"r2b": paths["r2"]})  # the same modules
    assert model.layout_version == hooked
    hooks_before = dict(model._injection.hooks)
    real_hook, made = injection.LoraHook, []

    def interrupted_hook(*args, **kwargs):
        if len(made) == 3:
            raise KeyboardInterrupt
        made.append(real_hook(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(injection, "LoraHook", interrupted_hook)
    with pytest.raises(KeyboardInterrupt):
        model.load_adapters({"r4": paths["r4"]})  # k_proj, o_proj, down_proj: new hooks
    monkeypatch.setattr(injection, "LoraHook", real_hook)
    assert model._injection.hooks == hooks_before and model.layout_version > hooked
    assert all(not hook.installed for hook in made)
    forwards = {name: module.__dict__.get("forward") for name, module in model.model.named_modules() if name}
    assert {name for name, forward in forwards.items() if forward is not None} == set(hooks_before)
    assert sorted(model.adapters) == ["r2", "r2b"]
    model.load_adapters({"r4": paths["r4"]})
    check_rows(model, ["r4", "r2", None], peft_logits)


@pytest.mark.parametrize(
    "available, budget",
    [(8 << 30, 2 << 30), (512 << 20, 1 << 30), (1 << 40, 64 << 30), (None, 1 << 30)],
    ids=["quarter", "floor", "cap", "unknown"],
)
def test_the_default_host_budget_follows_the_available_memory(base, monkeypatch, available, budget):
    """Without host_pool_bytes the host tier takes a quarter of the memory available when the model is wrapped,
    within 1 GiB and 64 GiB; adapter_stats reports it; a given budget wins."""
    monkeypatch.setattr(host_module, "available_memory_bytes", lambda: available)
    assert wrap(base).adapter_stats["host_bytes_budget"] == budget
    assert wrap(base, host_pool_bytes=12345).adapter_stats["host_bytes_budget"] == 12345


def test_available_memory_is_read_from_the_system():
    available = host_module.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PlainModuleHooks:
    """A ``ModuleHooks`` with no model behind it: the modules as plain data, and a record of the hooks asked for."""

    def __init__(self, linear: dict[str, LinearModule]) -> None:
        self.linear = linear
        self.hooked: dict[str, tuple] = {}  # module name -> (the tables its hook reads, its row)
        self.with_vectors: set[str] = set()  # the modules whose hooks apply output vectors

    def linear_modules(self) -> dict[str, LinearModule]:
        return dict(self.linear)

    def select(self, adapter, weights):
        return weights  # every module of the adapter applies

    def check_targets(self, adapter, module_names) -> None:
        for name in module_names:
            if name not in self.linear:
                raise ValueError(f"adapter {adapter!r}: no module {name}")

    def attach(self, module_names, tables, rows) -> list[str]:
        new = [name for name in module_names if name not in self.hooked]
        self.hooked.update({name: (tables[self.linear[name].device], rows[name]) for name in new})
        return new

    def detach(self, module_names) -> None:
        for name in module_names:
            self.hooked.pop(name, None)

    def use_vectors(self, module_names) -> None:
        self.with_vectors = set(module_names)


def test_the_store_manages_adapter_memory_from_plain_module_data(base, paths):
    """The store needs no module of the model: given the linear modules as plain data it registers adapters, asks
    for hooks by name and fills the slot tables those hooks read; a refused adapter asks for none."""
    linear = {
        name: LinearModule(module.in_features, module.out_features, torch.device("cpu"), torch.float32)
        for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)
    }
    hooks = PlainModuleHooks(linear)
    store = AdapterStore(hooks, max_adapters=2, max_rank=8, gpu_pool_bytes=None, host_pool_bytes=None)
    weights = load_adapter_weights(paths["r4"])
    assert store.add({"r4": (weights, weights, {})}) == {"r4": 0}
    assert sorted(hooks.hooked) == sorted(weights.modules)
    with store.acquire(["r4", None]) as lease:
        slot = lease.slots[0]
        for tables, row in hooks.hooked.values():
            assert tables.ranks[row, slot] == 4
    stray = AdapterWeights({"no.such.module": next(iter(weights.modules.values()))}, weights.config, "memory")
    r2 = load_adapter_weights(paths["r2"])
    with pytest.raises(ValueError, match="no module no.such.module"):
        store.add({"r2": (r2, r2, {}), "stray": (stray, stray, {})})
    assert sorted(hooks.hooked) == sorted(weights.modules) and store.indices == {"r4": 0}
