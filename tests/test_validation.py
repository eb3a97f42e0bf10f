"""Malformed adapters are refused with a ValueError naming the field (or module) and the value, and change nothing.

One table of malformed ``adapter_config.json`` contents, each with the error it must give: read alone, through a
converted file's metadata, and loaded by ``MultiLoraModel.load_adapters`` beside a good adapter (the call loads
neither, and the model is as before). Then factors with NaN or Inf, from PEFT files, converted files, a scaling
too large for float32 and code; the configs PEFT writes that must still load; and data that cannot fit the demo
model in the fine-tuning example.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from punica_hf import MultiLoraModel, demo
from punica_hf.formats import DTYPES, AdapterWeights, LoraAdapterConfig, ModuleLora, convert_adapter

INPUT_IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6]])
TARGETS = ["q_proj", "v_proj"]
NAN, INF = float("nan"), float("inf")
V_PROJ = "model.layers.1.self_attn.v_proj"

# id: (changes to a good adapter_config.json, the error's text)
MALFORMED_CONFIGS = {
    "null-r": ({"r": None}, "r must be a positive integer, got None"),
    "zero-r": ({"r": 0}, "r must be a positive integer, got 0"),
    "negative-r": ({"r": -4}, "r must be a positive integer, got -4"),
    "float-r": ({"r": 4.0}, "r must be a positive integer, got 4.0"),
    "bool-r": ({"r": True}, "r must be a positive integer, got True"),
    "string-r": ({"r": "4"}, "r must be a positive integer, got '4'"),
    "null-alpha": ({"lora_alpha": None}, "lora_alpha must be a finite number, got None"),
    "string-alpha": ({"lora_alpha": "8"}, "lora_alpha must be a finite number, got '8'"),
    "bool-alpha": ({"lora_alpha": True}, "lora_alpha must be a finite number, got True"),
    "nan-alpha": ({"lora_alpha": NAN}, "lora_alpha must be a finite number, got nan"),
    "inf-alpha": ({"lora_alpha": -INF}, "lora_alpha must be a finite number, got -inf"),
    "string-rslora": ({"use_rslora": "true"}, "use_rslora must be true or false, got 'true'"),
    "int-rslora": ({"use_rslora": 1}, "use_rslora must be true or false, got 1"),
    "list-rank-pattern": (
        {"rank_pattern": [["q_proj", 2]]}, "rank_pattern must be a JSON object {pattern: value}, got [['q_proj', 2]]"
    ),
    "string-rank-pattern": ({"rank_pattern": "q_proj=2"}, "rank_pattern must be a JSON object"),
    "bad-regex-rank-pattern": (
        {"rank_pattern": {"q_proj(": 2}}, "rank_pattern key 'q_proj(' is not a valid regular expression"
    ),
    "bool-rank-in-pattern": ({"rank_pattern": {"q_proj": True}}, "rank_pattern['q_proj'] must be a positive integer"),
    "zero-rank-in-pattern": ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj'] must be a positive integer"),
    "null-rank-in-pattern": ({"rank_pattern": {"q_proj": None}}, "rank_pattern['q_proj'] must be a positive integer"),
    "list-alpha-pattern": ({"alpha_pattern": [16]}, "alpha_pattern must be a JSON object {pattern: value}, got [16]"),
    "bad-regex-target-modules": ({"target_modules": "(q_proj"}, "target_modules '(q_proj' is not a valid regular "
                                 "expression"),
    "bad-regex-exclude-modules": ({"exclude_modules": "v_proj["}, "exclude_modules 'v_proj[' is not a valid regular "
                                  "expression"),
    "bad-regex-alpha-pattern": (
        {"alpha_pattern": {"*": 16}}, "alpha_pattern key '*' is not a valid regular expression"
    ),
    "nan-alpha-in-pattern": (
        {"alpha_pattern": {"v_proj": NAN}}, "alpha_pattern['v_proj'] must be a finite number, got nan"
    ),
    "string-alpha-in-pattern": (
        {"alpha_pattern": {"v_proj": "16"}}, "alpha_pattern['v_proj'] must be a finite number, got '16'"
    ),
    "number-base-model": ({"base_model_name_or_path": 7}, "base_model_name_or_path must be a string or null, got 7"),
    "number-peft-type": ({"peft_type": 1}, "only LoRA adapters are supported, this config has peft_type=1"),
    "null-peft-type": ({"peft_type": None}, "only LoRA adapters are supported, this config has peft_type=None"),
    "string-use-dora": ({"use_dora": "false"}, "use_dora must be true or false, got 'false'"),
    "int-lora-bias": ({"lora_bias": 1}, "lora_bias must be true or false, got 1"),
    "bool-bias": ({"bias": True}, "bias must be a string ('none', 'lora_only' or 'all'), got True"),
    "layer-replication": ({"layer_replication": [[0, 1]]}, "layer_replication is not supported"),
    "target-parameters-without-module": (
        {"target_parameters": ["gate_up_proj"]}, "target_parameters must be a list of 'module.parameter' names"
    ),
    "target-parameters-with-dropout": (
        {"target_parameters": ["experts.down_proj"], "lora_dropout": 0.1}, "target_parameters with lora_dropout != 0"
    ),
    "megatron": ({"megatron_config": {"tensor_model_parallel_size": 2}}, "Megatron layers (megatron_config)"),
    # finite but absurd: factors scaled by them overflow the model's dtype
    "huge-alpha": ({"lora_alpha": 1e39}, "lora_alpha must be at most 1e+06 in magnitude, got 1e+39"),
    "huge-negative-alpha": ({"lora_alpha": -1e7}, "lora_alpha must be at most 1e+06 in magnitude, got -10000000.0"),
    "huge-alpha-in-pattern": (
        {"alpha_pattern": {"v_proj": 1e39}}, "alpha_pattern['v_proj'] must be at most 1e+06 in magnitude, got 1e+39"
    ),
    "huge-r": ({"r": 10**40}, f"r must be at most 65536, got {10**40}"),
    "huge-rank-in-pattern": ({"rank_pattern": {"q_proj": 1 << 20}}, "rank_pattern['q_proj'] must be at most 65536"),
    # the settings PEFT chose the modules with: not read, but malformed they mark a broken config
    "int-target-modules": (
        {"target_modules": 5}, "target_modules must be a string (a regular expression) or a list of strings, got 5"
    ),
    "mixed-target-modules": ({"target_modules": ["q_proj", 5]}, "target_modules must be a string (a regular"),
    "dict-exclude-modules": ({"exclude_modules": {"q_proj": 1}}, "exclude_modules must be a string (a regular"),
    "int-layers-pattern": ({"layers_pattern": 3}, "layers_pattern must be a string or a list of strings, got 3"),
    "string-layers-to-transform": (
        {"layers_to_transform": "0"}, "layers_to_transform must be a layer index (an integer >= 0) or a list of them"
    ),
    "negative-layer-to-transform": ({"layers_to_transform": [0, -1]}, "layers_to_transform must be a layer index"),
    "bool-layer-to-transform": ({"layers_to_transform": [True]}, "layers_to_transform must be a layer index"),
    "string-dropout": ({"lora_dropout": "0.1"}, "lora_dropout must be a number from 0 to 1, got '0.1'"),
    "dropout-above-one": ({"lora_dropout": 1.5}, "lora_dropout must be a number from 0 to 1, got 1.5"),
    "nan-dropout": ({"lora_dropout": NAN}, "lora_dropout must be a number from 0 to 1, got nan"),
    "string-fan-in-fan-out": ({"fan_in_fan_out": "false"}, "fan_in_fan_out must be true or false, got 'false'"),
    # LoRA variants whose forward differs from plain LoRA
    "qalora": ({"use_qalora": True}, "QALoRA (use_qalora=True) is not supported"),
    "kasa": ({"kasa_config": {"beta": 0.1}}, "KaSA (kasa_config) is not supported"),
    # refused by peft's own LoraConfig
    "layers-with-regex-targets": (
        {"target_modules": ".*q_proj", "layers_to_transform": [0]},
        "peft refuses this LoRA config: `layers_to_transform` cannot be used when `target_modules` is a str",
    ),
    "layers-pattern-alone": ({"layers_pattern": "layers"}, "`layers_to_transform` must also be specified"),
    "unknown-task-type": ({"task_type": "TRANSLATE_POEMS"}, "Invalid task type: 'TRANSLATE_POEMS'"),
    # a setting this peft does not know, set: it may change the math
    "unknown-setting": (
        {"lora_future_trick": {"depth": 2}, "peft_version": "9.0.0"},
        "settings ['lora_future_trick'] are unknown to the installed peft",
    ),
    # peft <= 0.2's LoRA on part of a fused layer's outputs (MergedLinear): gone from peft, and not plain LoRA
    "enable-lora": ({"enable_lora": [True, False, True]}, "settings ['enable_lora'] are unknown to the installed peft"),
}


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, Path]:
    """Good PEFT adapters of ``base``: "template" (copied and broken by the tests), "loaded", "good"."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_peft_adapter(base, root / name, seed=seed, r=4, lora_alpha=8, target_modules=TARGETS)
        for seed, name in enumerate(["template", "loaded", "good"])
    }


@pytest.fixture
def served(base, adapters) -> MultiLoraModel:
    """Three slots, "loaded" in slot 0: room for both adapters of a refused call, so only the bad one fails it."""
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"loaded": adapters["loaded"]})
    return model


def good_config(adapters) -> dict:
    """The ``adapter_config.json`` PEFT wrote for the template adapter."""
    return json.loads((adapters["template"] / "adapter_config.json").read_text())


def broken_copy(adapters, folder: Path, config_changes: dict | None = None, tensor_changes: dict | None = None) -> Path:
    """A copy of the template adapter with ``config_changes`` in its config and, per ``{key: value}`` of
    ``tensor_changes``, the first element of that tensor set to ``value``."""
    shutil.copytree(adapters["template"], folder)
    if config_changes:
        (folder / "adapter_config.json").write_text(json.dumps({**good_config(adapters), **config_changes}))
    if tensor_changes:
        weights = folder / "adapter_model.safetensors"
        tensors = load_file(weights)
        for key, value in tensor_changes.items():
            tensors[key].view(-1)[0] = value
        save_file(tensors, weights)
    return folder


def mixed_logits(model: MultiLoraModel) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS, adapter_ids=["loaded", None]).logits


def assert_refused_and_nothing_changed(served: MultiLoraModel, adapters, bad: Path | str, problem: str) -> None:
    """Loading ``bad`` beside a good adapter in one call raises ``problem`` and loads neither: the adapter table
    and the outputs of the loaded adapter and the base model are as before."""
    logits = mixed_logits(served)
    with pytest.raises(ValueError, match=re.escape(problem)):
        served.load_adapters({"good": adapters["good"], "bad": bad})
    assert served.adapters == {"loaded": 0}
    assert torch.equal(mixed_logits(served), logits)


# ------------------------------------------------------------------------------------------ malformed configs
@pytest.mark.parametrize("case", MALFORMED_CONFIGS)
def test_a_malformed_config_is_refused_by_field_and_value(adapters, case):
    changes, problem = MALFORMED_CONFIGS[case]
    with pytest.raises(ValueError, match=re.escape(problem)):
        LoraAdapterConfig.from_dict({**good_config(adapters), **changes})


@pytest.mark.parametrize("case", MALFORMED_CONFIGS)
def test_loading_a_malformed_config_changes_nothing(served, adapters, tmp_path, case):
    changes, problem = MALFORMED_CONFIGS[case]
    bad = broken_copy(adapters, tmp_path / case, config_changes=changes)
    assert_refused_and_nothing_changed(served, adapters, bad, problem)


def test_the_error_names_the_config_file(served, adapters, tmp_path):
    bad = broken_copy(adapters, tmp_path / "bad", config_changes={"r": None})
    with pytest.raises(ValueError, match=re.escape(f"adapter config {bad / 'adapter_config.json'}: r must be")):
        served.load_adapters({"bad": bad})


@pytest.mark.parametrize(
    "case", ["null-r", "string-alpha", "bad-regex-rank-pattern", "nan-alpha", "huge-alpha", "int-target-modules"]
)
def test_a_converted_file_with_a_malformed_config_is_refused(served, adapters, tmp_path, case):
    changes, problem = MALFORMED_CONFIGS[case]
    file = convert_adapter(adapters["template"], tmp_path / "good.safetensors")
    with safe_open(file, framework="pt") as reader:
        metadata, tensors = reader.metadata(), {key: reader.get_tensor(key) for key in reader.keys()}
    metadata["adapter_config"] = json.dumps({**json.loads(metadata["adapter_config"]), **changes})
    save_file(tensors, tmp_path / "bad.safetensors", metadata=metadata)
    assert_refused_and_nothing_changed(served, adapters, str(tmp_path / "bad.safetensors"), problem)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        pytest.param(dict(r=True, lora_alpha=8), "r must be a positive integer, got True", id="bool-r"),
        pytest.param(dict(r=4, lora_alpha=NAN), "lora_alpha must be a finite number, got nan", id="nan-alpha"),
        pytest.param(dict(r=4, lora_alpha=8, rank_pattern={"a[": 2}), "rank_pattern key 'a['", id="bad-regex"),
        pytest.param(dict(r=4, lora_alpha=1e39), "lora_alpha must be at most 1e+06 in magnitude", id="huge-alpha"),
        pytest.param(dict(r=1 << 17, lora_alpha=8), "r must be at most 65536, got 131072", id="huge-r"),
    ],
)
def test_a_config_made_in_code_is_checked_too(kwargs, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        LoraAdapterConfig(**kwargs)


def test_the_configs_peft_writes_still_load(adapters):
    """Nulls for optional settings, integer alphas, an empty modules_to_save, bias "none", lowercase peft_type, a
    regex for target_modules, a dropout, alphas at the limit, settings unknown to this peft left unset; and one
    layer index for layers_to_transform (beside a list of targets: peft refuses it beside a regex)."""
    raw = {
        **good_config(adapters), "peft_type": "lora", "r": 4, "lora_alpha": 6, "use_rslora": None,
        "rank_pattern": None, "alpha_pattern": {r"layers\.1\..*q_proj": 3.0, "k_proj": -1e6}, "modules_to_save": [],
        "use_dora": False, "bias": "none", "layer_replication": None, "base_model_name_or_path": None,
        "target_modules": r".*\.(q|v)_proj", "exclude_modules": None, "layers_to_transform": None,
        "layers_pattern": None, "lora_dropout": 0.05, "fan_in_fan_out": None, "lora_future_trick": None,
        "merge_weights": False, "enable_lora": None,  # keys of peft <= 0.2, unset
    }
    config = LoraAdapterConfig.from_dict(raw)
    assert config.scaling_for("model.layers.0.self_attn.q_proj") == 6 / 4
    assert config.scaling_for("model.layers.1.self_attn.q_proj") == 3.0 / 4
    assert not config.use_rslora and config.rank_pattern == {}
    assert config.peft_config.target_modules == r".*\.(q|v)_proj"
    one_layer = LoraAdapterConfig.from_dict({**raw, "target_modules": ["q_proj"], "layers_to_transform": 1})
    assert one_layer.peft_config.layers_to_transform == 1


# ------------------------------------------------------------------------------------------ malformed files
def test_a_config_that_is_not_utf8_is_refused_naming_it(served, adapters, tmp_path):
    bad = broken_copy(adapters, tmp_path / "latin")
    (bad / "adapter_config.json").write_bytes(b"\xff\xfe{}")
    assert_refused_and_nothing_changed(served, adapters, bad, f"adapter config {bad / 'adapter_config.json'} is "
                                                              "not valid JSON text (UTF-8)")


def _pickled_copy(adapters, folder: Path, change) -> Path:
    """The template adapter with its weights saved as a pickle (adapter_model.bin), after ``change(tensors)``."""
    shutil.copytree(adapters["template"], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    (folder / "adapter_model.safetensors").unlink()
    torch.save(change(tensors), folder / "adapter_model.bin")
    return folder


WEIGHT_FILE_CASES = {  # id: (what is done to the tensors, the error's text)
    "a key that is not a name": (lambda t: {**t, 1: torch.zeros(2)}, "are not a flat dict of tensors by name"),
    "a sparse tensor": (lambda t: {k: v.to_sparse() if k.endswith(f"{V_PROJ}.lora_A.weight") else v
                                   for k, v in t.items()}, "is torch.sparse_coo, not a dense tensor"),
    "a factor with and without the prefix": (
        lambda t: {**t, f"{V_PROJ}.lora_A.weight": t[f"base_model.model.{V_PROJ}.lora_A.weight"] * 100},
        f"holds the same tensor twice: 'base_model.model.{V_PROJ}.lora_A.weight' and '{V_PROJ}.lora_A.weight'",
    ),
}


@pytest.mark.parametrize("case", WEIGHT_FILE_CASES)
def test_a_malformed_weights_file_is_refused_by_name(served, adapters, tmp_path, case):
    """Each used to escape as another exception with no file named (TypeError, RuntimeError), or (the same factor
    under two keys) to load whichever came last, where PEFT may take the other."""
    change, problem = WEIGHT_FILE_CASES[case]
    assert_refused_and_nothing_changed(served, adapters, _pickled_copy(adapters, tmp_path / "bad", change), problem)


# --------------------------------------------------------------------------------------- non-finite factors
NON_FINITE_FACTORS = {  # id: (PEFT key, value, the factor the error names)
    "nan-in-lora-A": (f"base_model.model.{V_PROJ}.lora_A.weight", NAN, "lora_a"),
    "inf-in-lora-A": (f"base_model.model.{V_PROJ}.lora_A.weight", INF, "lora_a"),
    "minus-inf-in-lora-B": (f"base_model.model.{V_PROJ}.lora_B.weight", -INF, "lora_b"),
}


@pytest.mark.parametrize("case", NON_FINITE_FACTORS)
def test_non_finite_factors_in_a_peft_file_are_refused(served, adapters, tmp_path, case):
    key, value, factor = NON_FINITE_FACTORS[case]
    bad = broken_copy(adapters, tmp_path / case, tensor_changes={key: value})
    assert_refused_and_nothing_changed(served, adapters, bad, f"module {V_PROJ} has NaN or Inf values in its {factor}")


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("factor", ["lora_a", "lora_b"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_finite_factors_in_a_converted_file_are_refused(served, adapters, tmp_path, value, factor, dtype):
    file = convert_adapter(adapters["template"], tmp_path / "good.safetensors", dtype=DTYPES[dtype])
    with safe_open(file, framework="pt") as reader:
        metadata, tensors = reader.metadata(), {key: reader.get_tensor(key) for key in reader.keys()}
    stored = {"lora_a": "lora_a", "lora_b": "lora_b_t"}[factor]  # B is stored transposed
    tensors[f"{V_PROJ}.{stored}"].view(-1)[-1] = value
    save_file(tensors, tmp_path / "bad.safetensors", metadata=metadata)
    problem = f"module {V_PROJ} has NaN or Inf values in its {factor}"
    assert_refused_and_nothing_changed(served, adapters, str(tmp_path / "bad.safetensors"), problem)


@pytest.mark.parametrize(
    "changes, module",
    [
        pytest.param({"lora_alpha": 1e6}, "model.layers.0.self_attn.q_proj", id="lora_alpha"),
        pytest.param({"alpha_pattern": {"v_proj": 1e6}}, "model.layers.0.self_attn.v_proj", id="alpha_pattern"),
    ],
)
def test_a_scaling_beyond_float32_is_refused(served, adapters, tmp_path, changes, module):
    """An alpha within the limit whose scaling overflows the (large) float32 factor it is folded into."""
    bad = broken_copy(
        adapters, tmp_path / "huge", config_changes=changes,
        tensor_changes={f"base_model.model.{module}.lora_B.weight": 1e38},
    )
    assert math.isfinite(LoraAdapterConfig.from_file(bad / "adapter_config.json").scaling_for(module))
    assert_refused_and_nothing_changed(served, adapters, bad, f"module {module} has NaN or Inf values in its lora_b")


def test_factors_beyond_the_model_dtype_are_refused(base, adapters, tmp_path):
    """Finite float32 factors that a float16 model cannot hold (65504 at most): they would turn into inf."""
    model = MultiLoraModel(copy.deepcopy(base).half(), max_adapters=3, max_rank=8)
    model.load_adapters({"loaded": adapters["loaded"]})
    key = f"base_model.model.{V_PROJ}.lora_B.weight"
    bad = broken_copy(adapters, tmp_path / "big", tensor_changes={key: 4e4})  # scaling 8 / 4: 8e4 in the adapter
    problem = f"module {V_PROJ} has values of magnitude up to 8e+04 in its lora_b, beyond the range of torch.float16"
    assert_refused_and_nothing_changed(model, adapters, bad, problem)
    just_fits = broken_copy(adapters, tmp_path / "fits", tensor_changes={key: 3e4})  # 6e4 in the adapter
    assert model.load_adapters({"fits": just_fits}) == {"fits": 1}


def test_non_finite_factors_made_in_code_are_refused():
    lora_b = torch.ones(32, 2)
    lora_b[3, 1] = NAN
    problem = "adapter mine: module model.layers.0.mlp.up_proj has NaN or Inf values in its lora_b"
    with pytest.raises(ValueError, match=re.escape(problem)):
        AdapterWeights(
            modules={"model.layers.0.mlp.up_proj": ModuleLora(torch.ones(2, 32), lora_b)},
            config=LoraAdapterConfig(r=2, lora_alpha=2),
            source="mine",
        )


def test_large_finite_factors_are_accepted():
    """Their sum overflows float32; the values themselves are finite and must load."""
    lora_a = torch.full((2, 32), 3e38)
    weights = AdapterWeights(
        modules={"model.layers.0.mlp.up_proj": ModuleLora(lora_a, torch.zeros(32, 2))},
        config=LoraAdapterConfig(r=2, lora_alpha=2),
        source="mine",
    )
    assert not torch.isfinite(lora_a.sum()) and weights.max_rank == 2


# ----------------------------------------------------------------------------- fine-tuning the demo model
FINETUNE_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "finetune" / "finetune.py"


@pytest.mark.skipif(not (demo.base_model_path() / "config.json").is_file(), reason="the demo model is not built")
def test_finetuning_the_demo_model_refuses_data_longer_than_it_reads(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("finetune_for_validation", FINETUNE_SCRIPT)
    finetune = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = finetune
    spec.loader.exec_module(finetune)
    question = "Solve the math problem step by step, then give the final answer after '####'.\n\nQuestion: 2+3?\n"
    records = [{"prompt": "lora", "response": "arol"}, {"prompt": question, "response": "#### 5"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))

    code = finetune.main(["--model", "demo", "--data", str(data), "--output", str(tmp_path / "out")])

    assert code == 1 and not (tmp_path / "out").exists()
    longest = 1 + len(question.encode()) + 1 + len("#### 5") + 1  # BOS, prompt, "=", response, EOS
    assert (
        f"1 of 2 examples do not fit the demo model's 64 positions (the longest needs {longest} tokens"
        in capsys.readouterr().err
    )
