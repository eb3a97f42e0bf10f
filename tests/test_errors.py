"""Bad inputs get a clear error of the right type that names the problem, and change nothing.

"Nothing changed" is checked for real after every refused call: the adapter table, the model's module tree
(names and types: no layer wrapped by a failed load), every buffer of the model (the stacked LoRA factors and
ranks included) and the logits of a mixed batch that uses two adapters and the base model.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ModelState, assert_state_unchanged, capture_state, save_peft_adapter, tiny_llama
from peft import IA3Config, LoHaConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from punica_hf import MultiLoraModel

MAX_ADAPTERS = 3
MAX_RANK = 8
INPUT_IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]])
MIXED = ["a", "b", None]  # one row per adapter loaded by the `served` fixture, and one base-model row
GENERATE = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
MLP = ["gate_proj", "up_proj", "down_proj"]  # modules no adapter of the `served` fixture wraps


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    """``adapter(key, **lora_kwargs)``: a PEFT checkpoint of ``base`` saved once per key for the module."""
    root = tmp_path_factory.mktemp("adapters")
    saved: dict[str, Path] = {}

    def make(key: str, model=None, **lora_kwargs) -> Path:
        if key not in saved:
            saved[key] = save_peft_adapter(base if model is None else model, root / key, **lora_kwargs)
        return saved[key]

    return make


@pytest.fixture
def path_a(adapter):
    return adapter("a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1)


@pytest.fixture
def path_b(adapter):
    return adapter("b", r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj"], seed=2)


@pytest.fixture
def path_mlp(adapter):
    """A good adapter on modules that no adapter of ``served`` has wrapped yet."""
    return adapter("mlp", r=4, target_modules=MLP, seed=3)


@pytest.fixture
def served(base, path_a, path_b):
    """3 slots, max_rank 8: "a" (slot 0) and "b" (slot 1) loaded, slot 2 free, MLP modules not wrapped."""
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=MAX_ADAPTERS, max_rank=MAX_RANK)
    assert model.load_adapters({"a": path_a, "b": path_b}) == {"a": 0, "b": 1}
    assert model.adapter_stats["resident"] == 2
    return model


# ------------------------------------------------------------------------------------------------ snapshots
def mixed_logits(model: MultiLoraModel, adapter_ids=MIXED) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS, adapter_ids=adapter_ids).logits


def snapshot(model: MultiLoraModel, adapter_ids=MIXED) -> ModelState:
    """Everything a refused call must leave alone; ``adapter_ids`` picks the rows of the logits batch."""
    return capture_state(model, INPUT_IDS, adapter_ids)


@pytest.fixture
def unchanged(served):
    """Yields the served model; after the test body, asserts nothing about it changed (a change shows as an
    error at teardown)."""
    before = snapshot(served)
    yield served
    assert_state_unchanged(served, before)


def peft_logits(base, path: Path) -> torch.Tensor:
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    with torch.no_grad():
        return peft_model(INPUT_IDS).logits


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_config(folder: Path, **changes) -> Path:
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return folder


# --------------------------------------------------------------------------- adapter_ids in forward/generate
CALLS = ["forward", "generate"]


def run_batch(model: MultiLoraModel, call: str, adapter_ids):
    if call == "forward":
        return model(INPUT_IDS, adapter_ids=adapter_ids)
    return model.generate(INPUT_IDS, adapter_ids=adapter_ids, **GENERATE)


@pytest.mark.parametrize("call", CALLS)
def test_unknown_adapter_name_is_a_key_error(unchanged, call):
    with pytest.raises(KeyError, match="unknown adapter 'nope'"):
        run_batch(unchanged, call, ["a", "nope", None])


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("index", [2, 7, -2], ids=["free-slot", "beyond-max-adapters", "negative"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_unknown_adapter_index_is_a_key_error(unchanged, call, index, as_tensor):
    ids = [0, index, -1]
    with pytest.raises(KeyError, match=f"no adapter is loaded at index {index}"):
        run_batch(unchanged, call, torch.tensor(ids) if as_tensor else ids)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("ids", [["a", "b"], ["a", "b", None, "a"], []], ids=["short", "long", "empty"])
def test_adapter_ids_of_the_wrong_length(unchanged, call, ids):
    with pytest.raises(ValueError, match=r"adapter_ids has shape .* but the batch has 3 rows"):
        run_batch(unchanged, call, ids)


def test_per_token_adapter_ids_of_the_wrong_length(unchanged):
    with pytest.raises(ValueError, match="of 6 tokens"):
        unchanged(INPUT_IDS, adapter_ids=torch.zeros(3, 5, dtype=torch.long))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_adapter_id_tensor(unchanged, call, dtype):
    with pytest.raises(ValueError, match="adapter_ids must be an integer tensor"):
        run_batch(unchanged, call, torch.tensor([0, 1, 0]).to(dtype))


@pytest.mark.parametrize("call", CALLS)
def test_float_adapter_ids_in_a_list(served, call):
    before = snapshot(served)
    with pytest.raises((TypeError, ValueError), match="adapter_ids"):
        run_batch(served, call, [0.5, 1.0, None])
    assert_state_unchanged(served, before)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param("a", id="string"),
        pytest.param(torch.zeros(3, 6, 1, dtype=torch.long), id="3-D-tensor"),
        pytest.param({"a": 0}, id="dict"),
    ],
)
def test_adapter_ids_of_the_wrong_kind(unchanged, ids):
    with pytest.raises(ValueError, match="adapter_ids must be"):
        unchanged(INPUT_IDS, adapter_ids=ids)


def test_generate_refuses_per_token_adapter_ids(unchanged):
    with pytest.raises(ValueError, match=r"one adapter per row.*\(3, 6\)"):
        unchanged.generate(INPUT_IDS, adapter_ids=torch.zeros(3, 6, dtype=torch.long), **GENERATE)


@pytest.mark.parametrize("call", CALLS)
def test_a_nested_list_of_adapter_ids_is_refused(served, call):
    before = snapshot(served)
    with pytest.raises((TypeError, ValueError), match="adapter_ids"):
        run_batch(served, call, [["a"] * 6, ["b"] * 6, [None] * 6])
    assert_state_unchanged(served, before)


def test_an_error_inside_forward_leaves_no_adapter_mapping_behind(unchanged, base):
    with pytest.raises(ValueError, match="batch_size"):  # raised by the loss, after the LoRA layers ran
        unchanged(INPUT_IDS, adapter_ids=MIXED, labels=torch.zeros(2, 6, dtype=torch.long))
    assert unchanged._injection.context.segments is None
    with torch.no_grad():
        torch.testing.assert_close(unchanged(INPUT_IDS).logits, base(INPUT_IDS).logits, rtol=0, atol=0)


# -------------------------------------------------------------------------------- loads refused by the store
def test_rank_above_max_rank(unchanged, adapter):
    path = adapter("rank16", r=16, target_modules=MLP)
    with pytest.raises(ValueError, match=r"module model\.layers\.\d\.mlp\.\w+_proj has rank 16 > max_rank=8"):
        unchanged.load_adapters({"big": path})


@pytest.mark.parametrize("call", CALLS)
def test_a_batch_needing_more_adapters_than_fit(base, path_a, path_mlp, call):
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=MAX_RANK)
    model.load_adapters({"a": path_a, "mlp": path_mlp})  # registering has no limit
    before = snapshot(model, ["a", None, "a"])
    with pytest.raises(ValueError, match="uses 2 different adapters but at most max_adapters=1 fit"):
        run_batch(model, call, ["a", "mlp", None])
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("second_source", ["same", "other"])
def test_loading_a_loaded_name_again(unchanged, path_a, path_mlp, second_source):
    with pytest.raises(ValueError, match="an adapter named 'a' is already loaded"):
        unchanged.load_adapters({"a": path_a if second_source == "same" else path_mlp})


@pytest.mark.parametrize("name", ["", 3, None])
def test_adapter_names_must_be_non_empty_strings(unchanged, path_mlp, name):
    with pytest.raises(ValueError, match="adapter names must be non-empty strings"):
        unchanged.load_adapters({name: path_mlp})


def test_checkpoint_whose_shapes_do_not_fit(unchanged, adapter):
    path = adapter("hidden48", model=tiny_llama(hidden_size=48), r=4, target_modules=MLP)
    with pytest.raises(
        ValueError,
        match=r"does not fit the base model: module model\.layers\.\d\.mlp\.\w+_proj takes .* the adapter has "
        r"\[4, (48|64)\] and \[(48|64), 4\]",
    ):
        unchanged.load_adapters({"wide": path})


def test_checkpoint_naming_a_layer_the_base_model_lacks(unchanged, adapter):
    path = adapter("layers3", model=tiny_llama(num_hidden_layers=3), r=4, target_modules=MLP)
    with pytest.raises(ValueError, match=r"it has no module model\.layers\.2\.mlp\.\w+_proj"):
        unchanged.load_adapters({"deep": path})


def _rename_modules(src: Path, dst: Path, old: str, new: str) -> Path:
    copy_checkpoint(src, dst)
    state_dict = load_file(dst / "adapter_model.safetensors")
    save_file({key.replace(old, new): value for key, value in state_dict.items()}, dst / "adapter_model.safetensors")
    return dst


def test_checkpoint_naming_a_module_that_is_not_linear(unchanged, path_a, tmp_path):
    path = _rename_modules(path_a, tmp_path / "attn", "self_attn.q_proj.", "self_attn.")
    with pytest.raises(ValueError, match=r"module model\.layers\.\d\.self_attn is a [\w.]+LlamaAttention: not an nn.Linear"):
        unchanged.load_adapters({"attn": path})


def test_checkpoint_naming_a_module_of_the_wrapper(served, path_a, tmp_path):
    path = _rename_modules(path_a, tmp_path / "nested", "q_proj.", "q_proj.base_layer.")
    before = snapshot(served)
    with pytest.raises(ValueError, match=r"no module model\.layers\.\d\.self_attn\.q_proj\.base_layer"):
        served.load_adapters({"nested": path})
    assert_state_unchanged(served, before)


# ------------------------------------------------------------------------------- files that cannot be read
@pytest.mark.parametrize("as_str", [False, True], ids=["Path", "str"])
def test_missing_folder(unchanged, tmp_path, as_str):
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(FileNotFoundError, match="no-such-adapter"):
        unchanged.load_adapters({"x": str(missing) if as_str else missing})


def test_folder_without_adapter_config(unchanged, path_mlp, tmp_path):
    folder = copy_checkpoint(path_mlp, tmp_path / "x")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        unchanged.load_adapters({"x": folder})


def test_folder_without_weights(unchanged, path_mlp, tmp_path):
    folder = copy_checkpoint(path_mlp, tmp_path / "x")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        unchanged.load_adapters({"x": folder})


@pytest.mark.parametrize("keep", [0.5, 0.0, 7 / 8])
def test_truncated_safetensors(unchanged, path_mlp, tmp_path, keep):
    folder = copy_checkpoint(path_mlp, tmp_path / "x")
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises((ValueError, OSError), match="adapter_model.safetensors"):
        unchanged.load_adapters({"x": folder})


@pytest.mark.parametrize(
    "text, problem",
    [
        pytest.param('{"peft_type": "LORA", "r": 4', "not valid JSON", id="truncated-json"),
        pytest.param("", "not valid JSON", id="empty-file"),
        pytest.param('["LORA"]', "must be a JSON object", id="json-list"),
        pytest.param('{"r": 4, "lora_alpha": 8}', "peft_type=None", id="no-peft-type"),
    ],
)
def test_unusable_adapter_config(unchanged, path_mlp, tmp_path, text, problem):
    folder = copy_checkpoint(path_mlp, tmp_path / "x")
    (folder / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=problem):
        unchanged.load_adapters({"x": folder})


def test_weights_whose_rank_contradicts_the_config(unchanged, path_mlp, tmp_path):
    folder = rewrite_config(copy_checkpoint(path_mlp, tmp_path / "x"), r=2)
    problem = r"module model\.layers\.\d\.mlp\.\w+_proj has rank 4 but its config gives r=2"
    with pytest.raises(ValueError, match=problem):
        unchanged.load_adapters({"x": folder})


# ------------------------------------------------------------------------------- unsupported PEFT features
UNSUPPORTED = {  # id: (LoraConfig kwargs, how the error names the feature)
    "modules-to-save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "trainable-tokens": (dict(trainable_token_indices=[1, 2]), "trainable_token_indices"),
}


def unsupported_adapter(adapter, kind: str) -> Path:
    return adapter(f"unsupported-{kind}", r=4, target_modules=MLP, **UNSUPPORTED[kind][0])


@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_unsupported_lora_feature_is_refused_by_name(unchanged, adapter, kind):
    with pytest.raises(ValueError, match=f"{UNSUPPORTED[kind][1]} is not supported"):
        unchanged.load_adapters({"x": unsupported_adapter(adapter, kind)})


@pytest.mark.parametrize(
    "peft_config, peft_type",
    [
        pytest.param(lambda: IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
                     "IA3", id="ia3"),
        pytest.param(lambda: LoHaConfig(target_modules=MLP), "LOHA", id="loha"),
    ],
)
def test_non_lora_adapter_is_refused(unchanged, base, tmp_path, peft_config, peft_type):
    get_peft_model(copy.deepcopy(base), peft_config()).save_pretrained(tmp_path / "x")
    with pytest.raises(ValueError, match=f"only LoRA adapters are supported, this config has peft_type='{peft_type}'"):
        unchanged.load_adapters({"x": tmp_path / "x"})


# ----------------------------------------------------------------------------------------- all or nothing
BAD_SOURCES = ["rank-too-high", "truncated-weights", "unsupported-feature", "missing-folder", "does-not-fit"]


def _bad_source(kind: str, adapter, tmp_path: Path) -> Path:
    if kind == "rank-too-high":
        return adapter("rank16", r=16, target_modules=MLP)
    if kind == "truncated-weights":
        folder = copy_checkpoint(adapter("v-only", r=4, target_modules=["v_proj"], seed=5), tmp_path / "cut")
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        return folder
    if kind == "unsupported-feature":
        return unsupported_adapter(adapter, "modules-to-save")
    if kind == "missing-folder":
        return tmp_path / "missing"
    if kind == "does-not-fit":
        return adapter("layers3", model=tiny_llama(num_hidden_layers=3), r=4, target_modules=MLP)
    raise AssertionError(kind)


@pytest.mark.parametrize("bad_kind", BAD_SOURCES)
def test_a_bad_adapter_leaves_the_good_one_of_the_same_call_unloaded(unchanged, path_mlp, adapter, tmp_path, bad_kind):
    bad = _bad_source(bad_kind, adapter, tmp_path)
    with pytest.raises((ValueError, OSError)):
        unchanged.load_adapters({"good": path_mlp, "bad": bad})
    assert "good" not in unchanged.adapters


def test_the_good_adapter_loads_after_a_failed_call(served, path_mlp, adapter, base):
    with pytest.raises(ValueError):
        served.load_adapters({"good": path_mlp, "bad": adapter("rank16", r=16, target_modules=MLP)})
    assert served.load_adapters({"good": path_mlp}) == {"good": 2}
    logits = mixed_logits(served, ["good", "good", "good"])
    torch.testing.assert_close(logits, peft_logits(base, path_mlp), rtol=0, atol=1e-5)


def test_load_adapters_needs_a_mapping(unchanged, path_mlp):
    with pytest.raises(ValueError, match=r"mapping \{name: path or Hub repo id\}"):
        unchanged.load_adapters([path_mlp])


def test_wrapping_a_wrapped_model_again(unchanged):
    with pytest.raises(ValueError, match="already wrapped"):
        MultiLoraModel(unchanged.model)


@pytest.mark.parametrize(
    "arg, value", [("max_adapters", 0), ("max_rank", -1), ("max_rank", 2.5), ("max_adapters", True)]
)
def test_bad_wrapper_settings(base, arg, value):
    model = copy.deepcopy(base)
    modules = [(name, type(module)) for name, module in model.named_modules()]
    with pytest.raises(ValueError, match=f"{arg} must be a positive integer"):
        MultiLoraModel(model, **{arg: value})
    assert [(name, type(module)) for name, module in model.named_modules()] == modules
    assert getattr(model, "_punica_hf_context", None) is None


# ------------------------------------------------------------------------------------------------- unload
def test_unloading_an_unknown_adapter(unchanged):
    with pytest.raises(KeyError, match="unknown adapter 'nope'"):
        unchanged.unload_adapter("nope")


def test_unloading_twice(served):
    served.unload_adapter("b")
    before = snapshot(served, ["a", None, "a"])
    with pytest.raises(KeyError, match="unknown adapter 'b'"):
        served.unload_adapter("b")
    assert_state_unchanged(served, before)


def test_unload_frees_the_index_and_the_device_memory(served):
    logits_a = mixed_logits(served, ["a", None, "a"])
    used = served.adapter_stats["gpu_bytes_used"]
    served.unload_adapter("b")

    assert served.adapters == {"a": 0}
    for ids in (["a", "b", None], [0, 1, -1]):
        with pytest.raises(KeyError):
            served(INPUT_IDS, adapter_ids=ids)
    stats = served.adapter_stats
    assert stats["registered"] == stats["resident"] == 1 and 0 < stats["gpu_bytes_used"] < used
    torch.testing.assert_close(mixed_logits(served, ["a", None, "a"]), logits_a, rtol=0, atol=0)


def test_a_reloaded_slot_gives_the_new_adapters_outputs(served, base, adapter, path_a):
    # "c" touches v_proj only, none of the modules "b" (q, k, o) used: stale factors of "b" would show.
    path_c = adapter("c", r=2, lora_alpha=4, target_modules=["v_proj"], seed=6)
    before = mixed_logits(served, ["a", "b", None])
    served.unload_adapter("b")
    assert served.load_adapters({"c": path_c}) == {"c": 1}

    logits = mixed_logits(served, ["a", "c", None])
    with torch.no_grad():
        base_logits = base(INPUT_IDS).logits
    torch.testing.assert_close(logits[1], peft_logits(base, path_c)[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(logits[2], base_logits[2], rtol=0, atol=1e-5)
    assert not torch.allclose(logits[1], before[1], atol=1e-3)
    # index 1 now means "c"
    torch.testing.assert_close(mixed_logits(served, [0, 1, -1]), logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ legacy .bin
def _as_bin(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst)
    torch.save(load_file(src / "adapter_model.safetensors"), dst / "adapter_model.bin")
    return dst


def test_legacy_bin_loads_like_safetensors(base, path_b, tmp_path):
    from_safetensors = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=MAX_RANK)
    from_bin = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=MAX_RANK)
    from_safetensors.load_adapters({"b": path_b})
    from_bin.load_adapters({"b": _as_bin(path_b, tmp_path / "bin")})

    buffers = dict(from_bin.model.named_buffers())
    for name, tensor in from_safetensors.model.named_buffers():
        assert torch.equal(buffers[name], tensor), name
    ids = ["b", None, "b"]
    torch.testing.assert_close(mixed_logits(from_bin, ids), mixed_logits(from_safetensors, ids), rtol=0, atol=0)
    torch.testing.assert_close(mixed_logits(from_bin, ["b"] * 3), peft_logits(base, path_b), rtol=0, atol=1e-5)


class _CreatesMarkerWhenUnpickled:
    """A pickled object whose unpickling would run code: it opens (creates) a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_bin_with_a_pickled_object_is_refused_without_running_it(unchanged, path_mlp, tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    shutil.copy(path_mlp / "adapter_config.json", folder)
    state_dict = load_file(path_mlp / "adapter_model.safetensors")
    marker = tmp_path / "payload-ran"
    state_dict[next(iter(state_dict))] = _CreatesMarkerWhenUnpickled(marker)
    torch.save(state_dict, folder / "adapter_model.bin")

    with pytest.raises(ValueError, match="could not read adapter weights .*adapter_model.bin"):
        unchanged.load_adapters({"evil": folder})
    assert not marker.exists()

    # the payload is live: an unrestricted unpickler runs it
    unpickled = torch.load(folder / "adapter_model.bin", weights_only=False)
    assert marker.exists()
    next(iter(unpickled.values())).close()
