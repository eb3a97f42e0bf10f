"""The adapter kinds beyond plain LoRA (DoRA, LoRA biases, embed_tokens / lm_head, MoE experts, aLoRA) under what a
careless or hostile user does. Malformed checkpoints, and combinations of settings that PEFT refuses or serves
otherwise, are refused by name and change nothing. Every kind in one batch equals PEFT row by row (generate() and
the engine, with fewer slots than adapters), after eviction and re-reads, in copies and moves of the model, and
while two threads load and unload adapters as the engine serves; a file that changes under a loaded adapter is
refused when read again.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_state_unchanged, capture_state, left_padded, tiny_llama
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_embedding_lora import _BackendWithoutKernelSizes
from test_moe_lora import save_moe_adapters, tiny_qwen3_moe
from vector_adapters import make_base, peft_oracles, save_vector_adapter

from punica_hf import MultiLoraModel
from punica_hf.formats import LoraAdapterConfig, ModuleLora, convert_adapter
from punica_hf.serving import Engine, EngineConfig, SamplingParams
from punica_hf.store import store as store_module

ATOL = 2e-5
VOCAB = 96  # vector_adapters' tiny Llama, with attention and MLP biases
INVOCATION = [3, 4]
# One adapter of every kind for the tiny Llama, by name: LoraConfig kwargs (saved with random factors and vectors)
KINDS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "lora_bias": dict(r=2, lora_alpha=4, lora_bias=True, target_modules=["k_proj", "up_proj"]),
    "lora_only": dict(r=4, lora_alpha=8, bias="lora_only", target_modules=["o_proj", "gate_proj"]),
    "vocab": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "v_proj"]),
    "alora": dict(r=4, lora_alpha=8, task_type="CAUSAL_LM", alora_invocation_tokens=INVOCATION,
                  target_modules=["q_proj", "v_proj", "down_proj"]),
}
ROWS = ["alora", "dora", None, "vocab", "lora_bias", "plain", "lora_only", "dora"]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """``(base, {name: PEFT folder}, {name or None: PEFT oracle})``."""
    base = make_base("llama")
    root = tmp_path_factory.mktemp("kinds")
    paths = {name: save_vector_adapter(base, root / name, seed, **config)
             for seed, (name, config) in enumerate(KINDS.items(), start=1)}
    return base, paths, peft_oracles(base, paths)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 4 to 9 tokens from [10, VOCAB), the aLoRA invocation in the middle of every other one."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(count):
        tokens = torch.randint(10, VOCAB, (4 + (row * 3) % 6,), generator=generator).tolist()
        if row % 2 == 0:
            tokens[1:3] = INVOCATION
        rows.append(tokens)
    return rows


def peft_tokens(oracles, adapter: str | None, tokens: list[int], new_tokens: int) -> list[int]:
    output = oracles[adapter].generate(torch.tensor([tokens]), max_new_tokens=new_tokens, do_sample=False)
    return output[0, len(tokens):].tolist()


@torch.no_grad()
def assert_rows_match_peft(model, oracles, rows, input_ids, attention_mask):
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
    real = attention_mask.bool()
    base_logits = oracles[None](input_ids, attention_mask=attention_mask).logits
    for row, adapter in enumerate(rows):
        expected = oracles[adapter](input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
        if adapter is not None:  # the adapter really changes this row
            assert (expected[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3, adapter


# ---------------------------------------------------------------------------------------------- every kind at once
@torch.no_grad()
def test_every_kind_in_one_batch_equals_peft_row_by_row(kinds):
    base, paths, oracles = kinds
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=len(paths), max_rank=8)
    model.load_adapters(paths)
    rows_tokens = prompts(len(ROWS))
    assert_rows_match_peft(model, oracles, ROWS, *left_padded(rows_tokens))
    input_ids, attention_mask = left_padded(rows_tokens)
    generated = model.generate(input_ids, attention_mask=attention_mask, adapter_ids=ROWS, max_new_tokens=4,
                               do_sample=False)
    for row, adapter in enumerate(ROWS):
        expected = oracles[adapter].generate(input_ids[row:row + 1], attention_mask=attention_mask[row:row + 1],
                                             max_new_tokens=4, do_sample=False)
        assert generated[row, input_ids.shape[1]:].tolist() == expected[0, input_ids.shape[1]:].tolist(), adapter


@torch.no_grad()
def test_the_engine_serves_every_kind_with_fewer_slots_than_adapters(kinds):
    """Three slots for six adapters: requests of every kind interleaved evict one another's adapters (each placed
    again from the host tier); each request's tokens are PEFT's."""
    base, paths, oracles = kinds
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    plan = list(zip([*ROWS, "vocab", "alora", None], prompts(len(ROWS) + 3, seed=1)))
    with Engine(model, config=EngineConfig(max_running=3)) as engine:
        handles = [engine.submit(tokens, adapter, SamplingParams(max_new_tokens=3)) for adapter, tokens in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    for (adapter, tokens), completion in zip(plan, completions):
        assert list(completion.token_ids) == peft_tokens(oracles, adapter, tokens, 3), adapter
    assert model.adapter_stats["evictions"] > 0


# ---------------------------------------------------------------------------------------------- malformed checkpoints
def edited_copy(folder: Path, destination: Path, tensors=None, config=None) -> Path:
    """A copy of PEFT folder ``folder`` whose state dict ``tensors(state_dict)`` and config dict ``config(dict)``
    edited in place."""
    shutil.copytree(folder, destination)
    if tensors is not None:
        state_dict = load_file(destination / "adapter_model.safetensors")
        tensors(state_dict)
        save_file({key: value.contiguous() for key, value in state_dict.items()},
                  destination / "adapter_model.safetensors")
    if config is not None:
        raw = json.loads((destination / "adapter_config.json").read_text())
        config(raw)
        (destination / "adapter_config.json").write_text(json.dumps(raw))
    return destination


def first_key(state_dict: dict, marker: str) -> str:
    return next(key for key in sorted(state_dict) if marker in key)


def change(marker: str, how):
    def edit(state_dict):
        key = first_key(state_dict, marker)
        state_dict[key] = how(state_dict[key])
    return edit


def retype(marker: str, dtype: torch.dtype):
    return change(marker, lambda tensor: tensor.to(dtype))


def drop(marker: str):
    def edit(state_dict):
        del state_dict[first_key(state_dict, marker)]
    return edit


def add_magnitude(state_dict):
    key = first_key(state_dict, "lora_B.weight")
    state_dict[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.rand(state_dict[key].shape[0]) + 0.5


def set_config(**settings):
    return lambda raw: raw.update(settings)


# name -> (adapter of KINDS edited, state dict edit, config edit, the error it must raise)
MALFORMED = {
    "integer-magnitude": ("dora", retype("lora_magnitude_vector", torch.int64), None,
                          r"tensor '.*lora_magnitude_vector.*' holds torch.int64, not floating-point values"),
    "boolean-lora-bias": ("lora_bias", retype("lora_B.bias", torch.bool), None, r"lora_B.bias' holds torch.bool"),
    "integer-embedding-factor": ("vocab", retype("lora_embedding_A", torch.int32), None,
                                 r"lora_embedding_A' holds torch.int32"),
    "dora-without-a-magnitude": ("dora", drop("lora_magnitude_vector"), None,
                                 r"has no lora_magnitude_vector but its config sets use_dora=True"),
    "magnitude-without-dora": ("plain", add_magnitude, None,
                               r"has a lora_magnitude_vector but its config sets use_dora=False"),
    "lora-bias-without-the-setting": ("lora_bias", None, set_config(lora_bias=False),
                                      r"has a lora_B bias but its config sets lora_bias=False"),
    "lora-bias-setting-without-biases": ("plain", None, set_config(lora_bias=True),
                                         r"has no lora_B bias but its config sets lora_bias=True"),
    "short-lora-bias": ("lora_bias", change("lora_B.bias", lambda t: t[:-1]), None,
                        r"lora_bias has shape \[47\], expected \[48\]"),
    "matrix-magnitude": ("dora", change("lora_magnitude_vector", lambda t: t[None]), None,
                         r"magnitude has shape \[1, 32\], expected \[32\]"),
    "nan-magnitude": ("dora", change("lora_magnitude_vector", lambda t: t / 0 * 0), None,
                      r"has NaN or Inf values in its magnitude"),
    "inf-base-bias": ("lora_only", change("base_layer.bias", lambda t: t / 0), None,
                      r"has NaN or Inf values in its base_bias"),
}
# Fine as files (a converted file holds them as they are), refused against the base model they do not fit
MISFITS = {
    "embedding-of-another-vocabulary": ("vocab", change("lora_embedding_A", lambda t: t[:, :90]), None,
                                        r"module model.embed_tokens takes lora_A \[r, 96\] .* has \[4, 90\]"),
    "output-layer-of-another-vocabulary": ("vocab", change("lm_head.lora_B", lambda t: t[:90]), None,
                                           r"module lm_head takes lora_A \[r, 32\] and lora_B \[96, r\]"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED) + sorted(MISFITS))
def test_a_malformed_checkpoint_is_refused_by_name_and_changes_nothing(kinds, tmp_path, case):
    """Refused when loaded from its folder (beside a good adapter, which is not registered either) and, unless it
    only misfits the model, when converted: PEFT would cast a tensor of another dtype, ignore a vector its config
    does not ask for and start one its checkpoint lacks from its own initialisation, so the checkpoint alone does
    not say what to serve."""
    base, paths, _ = kinds
    adapter, tensors, config, error = {**MALFORMED, **MISFITS}[case]
    folder = edited_copy(paths[adapter], tmp_path / case, tensors, config)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"dora": paths["dora"]})
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["dora", None])
    with pytest.raises(ValueError, match=error):
        model.load_adapters({"good": paths["plain"], case: folder})
    assert_state_unchanged(model, state)
    if case in MISFITS:
        return
    with pytest.raises(ValueError, match=error):
        convert_adapter(folder, tmp_path / f"{case}.safetensors")


def test_an_adapter_with_base_layer_biases_on_a_model_without_them_is_refused(kinds):
    """A bias="lora_only" adapter of a model with biases, given a base model of the same shapes without them: PEFT
    would drop its biases without a word; serving refuses it by name (another base model)."""
    _, paths, _ = kinds
    torch.manual_seed(0)
    without_biases = make_base("llama")
    for module in without_biases.modules():
        if isinstance(module, torch.nn.Linear):
            module.bias = None
    model = MultiLoraModel(without_biases, max_adapters=3, max_rank=8)
    model.load_adapters({"dora": paths["dora"]})  # DoRA needs the weights alone
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["dora", None])
    with pytest.raises(ValueError, match=r"module model.layers.0.mlp.gate_proj has no bias in the base model, but "
                                         r"the adapter holds one for it"):
        model.load_adapters({"good": paths["plain"], "lora_only": paths["lora_only"]})
    assert_state_unchanged(model, state)


@pytest.mark.parametrize("factor", ["lora_a", "magnitude", "lora_bias"])
def test_factors_made_in_code_must_be_floating_point(factor):
    factors = dict(lora_a=torch.randn(2, 32), lora_b=torch.randn(32, 2), magnitude=torch.rand(32) + 0.5)
    factors[factor] = torch.ones(factors.get(factor, factors["magnitude"]).shape, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"{factor} holds torch.int64, not floating-point values"):
        ModuleLora(**factors)


def three_experts_of_four(state_dict):
    """Every expert parameter's factors cut to three experts' rows and columns (rank 4 on gate_up_proj)."""
    for key in [key for key in state_dict if ".experts.base_layer.lora_" in key]:
        factor = state_dict[key]
        state_dict[key] = factor[:12] if ".lora_A." in key else factor[:, :12]


@pytest.mark.parametrize("case, edit, error", [
    ("three-experts", three_experts_of_four, r"gate_up_proj \(4 experts, rank 4\) takes lora_A \[16, 32\] and "
                                             r"lora_B \[32, 16\], the adapter has \[12, 32\] and \[32, 12\]"),
    ("integer-experts", retype("experts.lora_A", torch.int64), r"experts.lora_A.weight' holds torch.int64"),
    ("missing-expert-factor", drop("experts.lora_B"), r"module model.layers.\d.mlp.experts has no lora_B weight"),
], ids=["three-experts", "integer", "missing-factor"])
def test_a_malformed_moe_checkpoint_is_refused_by_name_and_changes_nothing(tmp_path, case, edit, error):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    folder = edited_copy(paths["experts"], tmp_path / case, edit)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"down_only": paths["down_only"]})
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["down_only", None])
    with pytest.raises(ValueError, match=error):
        model.load_adapters({"attn": paths["attn"], case: folder})
    assert_state_unchanged(model, state)


def converted_tensor(tensors: dict, kind: str) -> str:
    return next(key for key in sorted(tensors) if key.endswith(f".{kind}"))


def edit_vector(kind: str, change):
    def edit(tensors):
        key = converted_tensor(tensors, kind)
        tensors[key] = change(tensors[key])
    return edit


def vector_for_a_module_without_lora(tensors):
    tensors["model.layers.0.mlp.up_proj.magnitude"] = torch.ones(48)


# name -> (adapter of KINDS converted, edit of the file's tensors, the error it must raise)
MALFORMED_CONVERTED = {
    "integer-magnitude": ("dora", edit_vector("magnitude", lambda t: t.to(torch.int32)), r"non-float vectors"),
    "short-magnitude": ("dora", edit_vector("magnitude", lambda t: t[:-1]), r"magnitude has shape \[31\], expected"),
    "nan-lora-bias": ("lora_bias", edit_vector("lora_bias", lambda t: t * float("nan")), r"NaN or Inf .* lora_bias"),
    "long-base-bias": ("lora_only", edit_vector("base_bias", lambda t: torch.cat([t, t])), r"base_bias has shape"),
    "inf-magnitude": ("dora", edit_vector("magnitude", lambda t: t / 0), r"NaN or Inf values in its magnitude"),
    "stray-vector": ("dora", vector_for_a_module_without_lora, r"unexpected: \['model.layers.0.mlp.up_proj.magnitude"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CONVERTED))
def test_a_malformed_converted_file_is_refused_by_name_and_changes_nothing(kinds, tmp_path, case):
    base, paths, _ = kinds
    adapter, edit, error = MALFORMED_CONVERTED[case]
    good = convert_adapter(paths[adapter], tmp_path / "good.safetensors")
    with safe_open(good, framework="pt") as reader:
        metadata, tensors = reader.metadata(), {key: reader.get_tensor(key) for key in reader.keys()}
    edit(tensors)
    bad = tmp_path / f"{case}.safetensors"
    save_file({key: value.contiguous() for key, value in tensors.items()}, bad, metadata=metadata)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"dora": paths["dora"]})
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["dora", None])
    with pytest.raises(ValueError, match=error):
        model.load_adapters({"good": paths["plain"], case: bad})
    assert_state_unchanged(model, state)


@pytest.mark.parametrize("setting, refused", [
    ({"use_dora": True}, "use_dora=True"), ({"lora_bias": True}, "lora_bias=True"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
    ({"alora_invocation_tokens": INVOCATION, "task_type": "CAUSAL_LM"}, r"aLoRA \(alora_invocation_tokens\)"),
], ids=["dora", "lora_bias", "fan_in_fan_out", "alora"])
def test_settings_peft_refuses_on_expert_parameters_are_refused(setting, refused):
    """PEFT's ParamWrapper (LoRA on a parameter) implements none of these and refuses them."""
    raw = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "target_parameters": ["experts.down_proj"]}
    with pytest.raises(ValueError, match=f"target_parameters with {refused} is refused by PEFT"):
        LoraAdapterConfig.from_dict({**raw, **setting})


def test_an_invocation_outside_the_vocabulary_is_refused_and_an_empty_one_is_plain_lora(kinds, tmp_path):
    """Token ids the model's vocabulary lacks can never occur in an input: the adapter would silently never apply.
    An empty invocation is unset, as in PEFT: the adapter is plain LoRA."""
    base, paths, _ = kinds
    outside = edited_copy(paths["alora"], tmp_path / "outside", config=set_config(alora_invocation_tokens=[3, VOCAB]))
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"alora": paths["alora"]})
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["alora", None])
    refusal = rf"'outside': its alora_invocation_tokens \[3, {VOCAB}\] hold token ids beyond the model's vocabulary"
    with pytest.raises(ValueError, match=refusal):
        model.load_adapters({"good": paths["plain"], "outside": outside})
    assert_state_unchanged(model, state)
    assert LoraAdapterConfig.from_dict({"peft_type": "LORA", "alora_invocation_tokens": []}).alora_invocation_tokens \
        is None


@pytest.mark.parametrize("kind, refusal", [
    ("dora", r"aLoRA with DoRA is not supported \(PEFT refuses it\)"),
    ("lora_only", r"aLoRA with biases of its own for the base layers \(bias='lora_only' or 'all'\) are not supported"),
], ids=["dora", "lora_only"])
def test_alora_with_dora_or_base_layer_biases_is_refused(kinds, tmp_path, kind, refusal):
    """PEFT has no aLoRA variant of DoRA; and it loads a bias="lora_only" adapter's biases into the base layers,
    where they change the positions before the invocation, which serving runs as the base model."""
    base, paths, _ = kinds
    invoked = edited_copy(paths[kind], tmp_path / kind,
                          config=set_config(alora_invocation_tokens=INVOCATION, task_type="CAUSAL_LM"))
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"alora": paths["alora"]})
    input_ids, _ = left_padded(prompts(2))
    state = capture_state(model, input_ids, ["alora", None])
    with pytest.raises(ValueError, match=refusal):
        model.load_adapters({"good": paths["plain"], "invoked": invoked})
    assert_state_unchanged(model, state)


# ---------------------------------------------------------------------------------------------- vectors on lm_head
@torch.no_grad()
def test_dora_and_lora_bias_on_the_output_layer_apply_on_the_fixed_shape_ops(kinds, tmp_path):
    """An output layer the kernels cannot take (a vocabulary that is no multiple of 8, as GPT-2's) runs PyTorch ops
    of its own: DoRA's scale and lora_B's bias apply there too."""
    base, _, _ = kinds
    paths = {
        "head_dora": save_vector_adapter(base, tmp_path / "head_dora", 1, r=4, use_dora=True,
                                         target_modules=["lm_head", "q_proj"]),
        "head_bias": save_vector_adapter(base, tmp_path / "head_bias", 2, r=4, lora_bias=True,
                                         target_modules=["lm_head"]),
    }
    oracles = peft_oracles(base, paths)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    model._injection.context._backends[torch.device("cpu")] = _BackendWithoutKernelSizes()
    rows = ["head_dora", None, "head_bias"]
    input_ids, attention_mask = left_padded(prompts(3))
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=rows, logits_to_keep=1).logits
    for row, adapter in enumerate(rows):
        expected = oracles[adapter](input_ids, attention_mask=attention_mask).logits[row, -1]
        torch.testing.assert_close(logits[row, -1], expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_every_kind_evicted_and_read_again_from_its_folder_equals_peft(kinds, monkeypatch):
    """Two slots and a host tier that holds one adapter: each kind in turn is evicted, dropped from the host tier
    and read again from its folder (its base-weight copy checked again, its invocation kept)."""
    base, paths, oracles = kinds
    one_adapter = 0
    for name, path in paths.items():
        scratch = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
        scratch.load_adapters({name: path})
        one_adapter = max(one_adapter, scratch.adapter_stats["host_bytes_used"])
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8, host_pool_bytes=one_adapter)
    model.load_adapters(paths)
    read_again = []
    load = store_module.load_adapter_weights
    monkeypatch.setattr(store_module, "load_adapter_weights",
                        lambda source, **options: read_again.append(Path(source)) or load(source, **options))
    names = list(paths)
    for _ in range(2):
        for first, second in zip(names, names[1:] + names[:1]):
            for name in (first, second):  # kept on no tier but the device: placed again, it is read again
                model._store.host.drop(model.adapters[name])
            assert_rows_match_peft(model, oracles, [first, None, second], *left_padded(prompts(3)))
    assert set(read_again) == {Path(path) for path in paths.values()}


# ---------------------------------------------------------------------------------------------- files that change
@pytest.mark.parametrize("kind, other_kind", [("dora", "plain"), ("plain", "dora")], ids=["loses", "gains"])
@torch.no_grad()
def test_a_file_whose_vectors_change_after_loading_is_refused_when_read_again(kinds, tmp_path, kind, other_kind):
    """One slot and a host tier that holds one adapter: an adapter used after others were read again is read again
    from its folder. A folder whose adapter now has other vectors (DoRA's, same modules and shapes) is refused by
    name rather than filling the chunk laid out for the old one (a scale of 0, or a vector written outside it)."""
    base, paths, _ = kinds
    folder = shutil.copytree(paths[kind], tmp_path / "x")
    replacement = save_vector_adapter(base, tmp_path / "replacement", 9,
                                      **{**KINDS[kind], "use_dora": KINDS[other_kind].get("use_dora", False)})
    sources = {"x": folder, "y": paths["lora_bias"], "z": paths["lora_only"]}
    one_adapter = 0
    for name, source in sources.items():
        scratch = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
        scratch.load_adapters({name: source})
        one_adapter = max(one_adapter, scratch.adapter_stats["host_bytes_used"])
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8, host_pool_bytes=one_adapter)
    model.load_adapters(sources)
    input_ids, _ = left_padded(prompts(2))
    for name in ["x", "y", "z", "y", "z"]:  # y and z read again: x's copy leaves the host tier
        model(input_ids, adapter_ids=[name, None])
    shutil.rmtree(folder)
    shutil.copytree(replacement, folder)
    disk_loads = model.adapter_stats["disk_loads"]
    with pytest.raises(ValueError, match=r"adapter 'x' changed at .* since it was loaded"):
        model(input_ids, adapter_ids=["x", None])
    assert model.adapter_stats["disk_loads"] == disk_loads + 1


# ---------------------------------------------------------------------------------------------- while serving
@torch.no_grad()
def test_two_threads_load_use_and_unload_every_kind_while_the_engine_serves(kinds):
    """Each thread loads one name with a kind after another (the same name, other weights), starts a request with it
    and unloads it while the request runs; meanwhile other requests go on. Three slots for four adapters at times:
    adapters are evicted and placed again. Every request, running through its adapter's unload or not, gets PEFT's
    tokens of the adapter it was submitted with."""
    base, paths, oracles = kinds
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({name: paths[name] for name in ("dora", "plain")})
    served = list(zip(["dora", "plain", None, "dora"] * 3, prompts(12, seed=2)))
    churned, failures = [], []

    def churn(name: str, kinds_in_turn: list[str], seed: int) -> None:
        try:
            for turn, kind in enumerate(kinds_in_turn):
                tokens = prompts(1, seed=seed + turn)[0]
                engine.load_adapters({name: paths[kind]})
                handle = engine.submit(tokens, name, SamplingParams(max_new_tokens=5))
                next(iter(handle))  # running: its first token is out
                engine.unload_adapter(name)
                churned.append((kind, tokens, handle.result(timeout=120)))
        except Exception as error:  # noqa: BLE001 - reported by the test's thread
            failures.append(error)

    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        threads = [threading.Thread(target=churn, args=("a", ["vocab", "alora", "lora_bias"], 10)),
                   threading.Thread(target=churn, args=("b", ["lora_only", "dora", "vocab"], 20))]
        for thread in threads:
            thread.start()
        handles = [engine.submit(tokens, adapter, SamplingParams(max_new_tokens=4)) for adapter, tokens in served]
        completions = [handle.result(timeout=120) for handle in handles]
        for thread in threads:
            thread.join(timeout=120)
    assert not failures
    assert len(churned) == 6
    for kind, tokens, completion in churned:
        assert completion.finish_reason == "length", completion
        assert list(completion.token_ids) == peft_tokens(oracles, kind, tokens, 5), kind
    for (adapter, tokens), completion in zip(served, completions):
        assert list(completion.token_ids) == peft_tokens(oracles, adapter, tokens, 4), adapter
    assert sorted(model.adapters) == ["dora", "plain"]


# ---------------------------------------------------------------------------------------------- copies and moves
def through_torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("make_copy", ["deepcopy", "torch.save", "float64"])
@torch.no_grad()
def test_a_copy_or_a_move_of_a_model_holding_every_kind_keeps_them(kinds, make_copy):
    """Three slots for six adapters: the copy carries the resident ones in its pools and the others in its host
    tier; each equals PEFT, in a float64 move too."""
    base, paths, oracles = kinds
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    if make_copy == "float64":
        copied = model.to(torch.float64)
        oracles = {name: copy.deepcopy(oracle).double() for name, oracle in oracles.items()}
    else:
        copied = copy.deepcopy(model) if make_copy == "deepcopy" else through_torch_save(model)
    for start in range(0, len(ROWS), 3):
        rows = ROWS[start:start + 3]
        assert_rows_match_peft(copied, oracles, rows, *left_padded(prompts(len(rows), seed=start)))


@torch.no_grad()
def test_a_copy_of_a_model_with_lora_on_moe_experts_keeps_it(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    oracles = {None: base, **{name: PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
                              for name, path in paths.items()}}
    for copied in (copy.deepcopy(model), through_torch_save(model)):
        assert_rows_match_peft(copied, oracles, ["experts", None, "down_only"], *left_padded(prompts(3)))
        assert_rows_match_peft(copied, oracles, ["attn", "experts"], *left_padded(prompts(2, seed=1)))


# ---------------------------------------------------------------------------------------------- prefix pages
@torch.no_grad()
def test_prefix_pages_of_a_dora_adapter_are_shared_and_never_meet_another_kind_loaded_under_its_name(tmp_path):
    """A page is 256 tokens on the CPU: prompts of 300 share their first page."""
    base = tiny_llama(max_position_embeddings=1024)
    base.generation_config.eos_token_id = None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    paths = {"dora": save_vector_adapter(base, tmp_path / "dora", 1, r=4, use_dora=True, target_modules=targets),
             "lora_bias": save_vector_adapter(base, tmp_path / "lora_bias", 2, r=4, lora_bias=True,
                                              target_modules=targets)}
    oracles = peft_oracles(base, paths)
    shared = torch.randint(1, 100, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    other_end = shared[:-20] + shared[:20]
    assert peft_tokens(oracles, "dora", shared, 4) != peft_tokens(oracles, "lora_bias", shared, 4)  # they differ
    model = MultiLoraModel(base, max_adapters=2, max_rank=8)
    model.load_adapters({"x": paths["dora"]})

    def run(tokens: list[int]) -> tuple[list[int], int]:
        hits = engine.stats().prefix_hit_tokens
        completion = engine.submit(tokens, "x", SamplingParams(max_new_tokens=4)).result(timeout=120)
        return list(completion.token_ids), engine.stats().prefix_hit_tokens - hits

    with Engine(model, config=EngineConfig(max_running=2)) as engine:
        assert run(shared) == (peft_tokens(oracles, "dora", shared, 4), 0)
        tokens, hits = run(other_end)
        assert tokens == peft_tokens(oracles, "dora", other_end, 4) and hits >= 256
        engine.unload_adapter("x")
        engine.load_adapters({"x": paths["lora_bias"]})
        assert run(shared) == (peft_tokens(oracles, "lora_bias", shared, 4), 0)
