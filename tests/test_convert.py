"""The converted serving format: same outputs as the PEFT adapter, clear refusals of anything else.

Converted files are checked against the PEFT checkpoints they came from (factors and logits exactly equal in
float32), and every refusal is checked to leave a served model exactly as it was (``capture_state``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from architectures import left_padded_batch, make_base_and_adapters
from helpers import assert_state_unchanged, capture_state, save_peft_adapter, tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from punica_hf import MultiLoraModel, load_adapter_weights
from punica_hf.cli import main
from punica_hf.formats import (
    FORMAT, AdapterWeights, LoraAdapterConfig, ModuleLora, convert_adapter, load_converted, save_converted,
)

MAX_RANK = 8


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def peft_adapters(request, tmp_path_factory):
    """``(architecture, base model, {name: PEFT folder})``: four adapters using rank/alpha patterns, rsLoRA,
    layers_to_transform and regex targets (GPT-2: Conv1D layers)."""
    folder = tmp_path_factory.mktemp(f"peft-{request.param}")
    base, paths = make_base_and_adapters(request.param, folder)
    return request.param, base, paths


@pytest.fixture(scope="module")
def converted(peft_adapters, tmp_path_factory):
    """The fp32 converted file of every adapter of ``peft_adapters``."""
    architecture, _, paths = peft_adapters
    folder = tmp_path_factory.mktemp(f"converted-{architecture}")
    return {name: convert_adapter(path, folder) for name, path in paths.items()}


def assert_same_factors(left: AdapterWeights, right: AdapterWeights) -> None:
    assert left.modules.keys() == right.modules.keys()
    for name, factors in left.modules.items():
        assert factors.lora_a.dtype == right.modules[name].lora_a.dtype == torch.float32
        assert torch.equal(factors.lora_a, right.modules[name].lora_a), name
        assert torch.equal(factors.lora_b, right.modules[name].lora_b), name


# ------------------------------------------------------------------------------------------------ same outputs
def test_converted_file_holds_the_peft_factors(peft_adapters, converted):
    _, _, paths = peft_adapters
    for name, path in paths.items():
        assert converted[name].name == f"{name}.safetensors"
        assert_same_factors(load_converted(converted[name]), load_adapter_weights(path))


def test_converted_and_peft_adapters_give_identical_logits(peft_adapters, converted):
    _, base, paths = peft_adapters
    from_peft = MultiLoraModel(copy.deepcopy(base), max_adapters=len(paths), max_rank=MAX_RANK)
    from_files = MultiLoraModel(copy.deepcopy(base), max_adapters=len(paths), max_rank=MAX_RANK)
    assert from_peft.load_adapters(paths) == from_files.load_adapters(converted)  # files load by path

    input_ids, attention_mask = left_padded_batch([5, 3, 6, 4, 2], torch.Generator().manual_seed(0))
    adapter_ids = [*paths, None]
    with torch.no_grad():
        expected = from_peft(input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids).logits
        actual = from_files(input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids).logits
        base_logits = base(input_ids, attention_mask=attention_mask).logits
    assert torch.equal(actual, expected)
    assert not torch.equal(actual[0], base_logits[0])  # the adapters really act


def test_metadata_describe_the_adapter(peft_adapters, converted):
    _, _, paths = peft_adapters
    name = "all"
    with safe_open(converted[name], framework="pt") as file:
        metadata = file.metadata()
    source_config = json.loads((paths[name] / "adapter_config.json").read_text())
    assert metadata["format"] == FORMAT
    assert json.loads(metadata["adapter_config"]) == source_config
    assert metadata["dtype"] == "float32"
    peft_weights = load_adapter_weights(paths[name])
    assert json.loads(metadata["modules"]) == {
        module: [factors.lora_a.shape[1], factors.lora_b.shape[0], factors.rank]
        for module, factors in peft_weights.modules.items()
    }
    if source_config.get("base_model_name_or_path"):
        assert metadata["base_model"] == source_config["base_model_name_or_path"]


def test_base_model_can_be_given(peft_adapters, tmp_path):
    _, _, paths = peft_adapters
    path = convert_adapter(paths["attn"], tmp_path / "x.safetensors", base_model="org/my-base")
    assert load_converted(path).config.base_model_name_or_path == "org/my-base"
    with safe_open(path, framework="pt") as file:
        assert file.metadata()["base_model"] == "org/my-base"


def test_half_precision_file_is_half_the_size(peft_adapters, converted, tmp_path):
    _, _, paths = peft_adapters
    path = convert_adapter(paths["all"], tmp_path / "all.safetensors", dtype=torch.bfloat16)
    full = load_converted(converted["all"])
    half = load_converted(path)
    def tensor_bytes(file: Path) -> int:
        return sum(t.numel() * t.element_size() for t in load_file(file).values())

    assert tensor_bytes(path) * 2 == tensor_bytes(converted["all"])
    for name, factors in half.modules.items():
        assert factors.lora_a.dtype == torch.bfloat16  # kept as stored: the copy into a slot casts
        assert torch.equal(factors.lora_b, full.modules[name].lora_b.bfloat16())

    _, base, _ = peft_adapters
    served = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=MAX_RANK)
    served.load_adapters({"full": converted["all"], "half": path})
    input_ids, _ = left_padded_batch([4], torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = served(input_ids.repeat(2, 1), adapter_ids=["full", "half"]).logits
        base_logits = base(input_ids).logits[0]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-2, rtol=1e-2)  # bf16 rounding of the factors only
    assert not torch.equal(logits[1], base_logits)


def test_a_converted_file_converts_again(converted, tmp_path):
    again = convert_adapter(converted["attn"], tmp_path)
    assert again == tmp_path / "attn.safetensors"
    assert_same_factors(load_converted(again), load_converted(converted["attn"]))


def test_hand_made_adapter_weights_round_trip(tmp_path):
    weights = AdapterWeights(
        modules={"model.layers.0.self_attn.q_proj": ModuleLora(torch.randn(2, 32), torch.randn(32, 2))},
        config=LoraAdapterConfig(r=2, lora_alpha=4),
        source="built in memory",
    )
    loaded = load_converted(save_converted(weights, tmp_path / "sub" / "hand.safetensors"))
    assert_same_factors(loaded, weights)
    assert loaded.config == weights.config


def test_v1_files_with_untransposed_b_still_load(converted, tmp_path):
    """v1 stored ``<module>.lora_b`` ``[out, r]``; v2 stores ``lora_b_t`` ``[r, out]``: both read the same."""
    path = next(iter(converted.values()))
    with safe_open(path, framework="pt") as reader:
        metadata, tensors = reader.metadata(), {key: reader.get_tensor(key) for key in reader.keys()}
    v1 = {key.replace(".lora_b_t", ".lora_b"): t.T.contiguous() if key.endswith(".lora_b_t") else t
          for key, t in tensors.items()}
    save_file(v1, tmp_path / "v1.safetensors", metadata={**metadata, "format": "punica_hf.lora.v1"})
    old, new = load_converted(tmp_path / "v1.safetensors"), load_converted(path)
    assert old.modules.keys() == new.modules.keys()
    for name, factors in new.modules.items():
        assert torch.equal(old.modules[name].lora_a, factors.lora_a) and torch.equal(old.modules[name].lora_b, factors.lora_b)


def test_many_sources_into_a_folder(peft_adapters, tmp_path, capsys):
    _, _, paths = peft_adapters
    destination = tmp_path / "out"
    assert main(["convert", *map(str, paths.values()), str(destination)]) == 0
    assert sorted(p.name for p in destination.iterdir()) == sorted(f"{name}.safetensors" for name in paths)
    for name, path in paths.items():
        assert_same_factors(load_converted(destination / f"{name}.safetensors"), load_adapter_weights(path))
    output = capsys.readouterr().out
    assert f"{len(paths)}/{len(paths)}" in output  # the progress bar's final state


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_converted_files_get_the_mode_open_gives_new_files(peft_adapters, tmp_path, umask):
    _, _, paths = peft_adapters
    name, path = next(iter(paths.items()))
    previous = os.umask(umask)
    try:
        assert main(["convert", str(path), str(tmp_path / "out")]) == 0
        (tmp_path / "by-open").open("w").close()
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "out" / f"{name}.safetensors").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "by-open").stat().st_mode) == 0o666 & ~umask


# ------------------------------------------------------------------------------------------------ refusals
@pytest.fixture
def served(tmp_path):
    """A tiny Llama (hidden 32) serving one adapter, with free slots; ``(model, its PEFT adapter)``."""
    base = tiny_llama()
    good = save_peft_adapter(base, tmp_path / "good", r=4, target_modules=["q_proj", "v_proj"])
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=MAX_RANK)
    model.load_adapters({"good": good})
    return model


@pytest.fixture
def fitting_peft(tmp_path):
    """The PEFT folder of a second adapter that fits ``served`` (q/v of hidden 32, rank 4)."""
    return save_peft_adapter(tiny_llama(), tmp_path / "fits", seed=5, r=4, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def fitting_file(fitting_peft, tmp_path):
    """``fitting_peft`` converted: a good file to damage."""
    return convert_adapter(fitting_peft, tmp_path / "fits.safetensors")


def refused_and_unchanged(model: MultiLoraModel, path: Path, error: type[Exception], match: str) -> None:
    before = capture_state(model, torch.tensor([[5, 17, 42, 8], [1, 2, 3, 4]]), ["good", None])
    with pytest.raises(error, match=match):
        model.load_adapters({"new": path})
    assert_state_unchanged(model, before)


def test_file_for_another_base_model_is_refused(served, tmp_path):
    wider = tiny_llama(hidden_size=48)
    peft_folder = save_peft_adapter(wider, tmp_path / "wide", r=4, target_modules=["q_proj", "v_proj"])
    path = convert_adapter(peft_folder, tmp_path / "wide.safetensors")
    refused_and_unchanged(
        served, path, ValueError,
        r"does not fit the base model: module model\.layers\.0\.self_attn\.q_proj takes lora_A \[r, 32\].*\[4, 48\]",
    )


def test_truncated_file_is_refused(served, fitting_file, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(fitting_file.read_bytes()[:-100])
    refused_and_unchanged(served, truncated, ValueError, r"truncated\.safetensors is not a readable safetensors file")


def test_garbage_file_is_refused(served, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + bytes(64))
    refused_and_unchanged(served, garbage, ValueError, r"garbage\.safetensors is not a readable safetensors file")


def test_peft_weights_file_renamed_is_refused(served, fitting_peft, tmp_path):
    renamed = tmp_path / "renamed.safetensors"
    shutil.copy(fitting_peft / "adapter_model.safetensors", renamed)
    refused_and_unchanged(served, renamed, ValueError, r"renamed\.safetensors is not a punica_hf converted adapter")


def test_missing_file_is_refused(served, tmp_path):
    refused_and_unchanged(served, tmp_path / "nope.safetensors", FileNotFoundError, "no converted adapter file at")


@pytest.mark.parametrize(
    "tamper, match",
    [
        pytest.param(lambda t, m: m.update(format="punica_hf.lora.v9"), "has format 'punica_hf.lora.v9'", id="format"),
        pytest.param(lambda t, m: m.pop("modules"), "without the metadata modules", id="no-modules"),
        pytest.param(lambda t, m: m.update(modules="{"), "metadata 'modules' is not valid JSON", id="bad-json"),
        pytest.param(
            lambda t, m: m.update(adapter_config=json.dumps({"peft_type": "IA3"})),
            "adapter_config metadata is refused: only LoRA", id="not-lora",
        ),
        pytest.param(
            lambda t, m: t.update({"model.layers.0.mlp.up_proj.lora_a": torch.zeros(4, 32)}),
            r"tensors do not match its module list \(missing: none, unexpected: \['model.layers.0.mlp.up_proj",
            id="extra-tensor",
        ),
        pytest.param(
            lambda t, m: t.pop("model.layers.1.self_attn.v_proj.lora_b_t"),
            r"missing: \['model.layers.1.self_attn.v_proj.lora_b_t'\]", id="missing-tensor",
        ),
        pytest.param(
            lambda t, m: t.update({"model.layers.0.self_attn.q_proj.lora_a": torch.zeros(3, 32)}),
            r"module model.layers.0.self_attn.q_proj has lora_a \[3, 32\].*\[r, in\] = \[4, 32\]", id="shape",
        ),
    ],
)
def test_inconsistent_file_is_refused(served, fitting_file, tmp_path, tamper, match):
    with safe_open(fitting_file, framework="pt") as file:
        metadata = file.metadata()
    tensors = load_file(fitting_file)
    tamper(tensors, metadata)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata=metadata)
    refused_and_unchanged(served, bad, ValueError, rf"bad\.safetensors.*{match}")
