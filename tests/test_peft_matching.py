"""Which modules an adapter changes is PEFT's decision: its config's module selection, applied to the base model.

Every case is an adapter saved by PEFT whose ``adapter_config.json`` is then edited. Where PEFT ignores some of
the checkpoint's weights (they belong to modules its config does not select), each row of a mixed batch equals
``PeftModel.from_pretrained`` on a copy of the base model (or the base model for a base row). Where PEFT refuses
to load the adapter, ``load_adapters`` raises a ``ValueError`` saying why and registers nothing.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_state_unchanged, capture_state, save_peft_adapter
from peft import PeftModel

from punica_hf import MultiLoraModel
from punica_hf.formats import LoraAdapterConfig, ModelModules, convert_adapter, select_modules

INPUT_IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6]])
ATOL = 2e-5
ZERO_INIT = {"init_lora_weights": True}  # PEFT starts a selected module without weights at zero (B = 0)

# id: (template, changes to its adapter_config.json). Each drops some of the template's weights.
IGNORED_WEIGHTS = {
    "list-of-names": ("attn_mlp", {"target_modules": ["q_proj"]}),
    "full-module-name": ("attn_mlp", {"target_modules": ["model.layers.0.self_attn.v_proj"]}),
    "regex": ("attn_mlp", {"target_modules": r".*\.layers\.1\..*(q|down)_proj"}),
    "all-linear": ("with_head", {"target_modules": "all-linear", **ZERO_INIT}),  # all linear layers but lm_head
    "lm_head-only": ("attn_mlp", {"target_modules": "lm_head", **ZERO_INIT}),  # the base model's output
    "null-targets": ("attn_mlp", {"target_modules": None}),  # PEFT's defaults for llama: q_proj, v_proj
    "layers-to-transform": ("attn_mlp", {"layers_to_transform": [1]}),
    "one-layer-index": ("attn_mlp", {"layers_to_transform": 0}),
    "layers-pattern": ("attn_mlp", {"layers_pattern": "layers", "layers_to_transform": [0]}),
    "exclude-list": ("attn_mlp", {"exclude_modules": ["v_proj", "down_proj"]}),
    "exclude-regex": ("attn_mlp", {"exclude_modules": r".*\.layers\.0\..*"}),
}
# id: (template, changes, the error's text)
REFUSED_BY_PEFT = {
    "layer-99": ("attn_mlp", {"layers_to_transform": [99]}, "no module matches target_modules=['down_proj', 'q_proj'"),
    "empty-targets": ("attn_mlp", {"target_modules": []}, "its target_modules are empty"),
    "no-such-module": ("attn_mlp", {"target_modules": ["qkv"]}, "no module matches target_modules=['qkv']"),
    "layers-pattern-elsewhere": (
        "attn_mlp", {"layers_pattern": "blocks", "layers_to_transform": [0]},
        "(with layers_to_transform=[0] and layers_pattern='blocks')",
    ),
    "all-excluded": (
        "attn_mlp", {"exclude_modules": ["q_proj", "v_proj", "down_proj"]}, "once exclude_modules=['down_proj', 'q_proj',"
    ),
    "excluded-and-unmatched": (
        "attn_mlp", {"target_modules": ["q_proj", "qkv"], "exclude_modules": r".*q_proj"}, "once exclude_modules"
    ),
    "no-lora-layer": ("attn_mlp", {"target_modules": ["mlp"], **ZERO_INIT}, "modules PEFT has no LoRA layer for"),
    "layers-with-regex": (
        "attn_mlp", {"target_modules": ".*q_proj", "layers_to_transform": [0]}, "cannot be used when `target_modules`"
    ),
}


@pytest.fixture(scope="module")
def templates(base, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters of ``base`` (random A and B, init_lora_weights false): on q, v and down projections, and the
    same with the output layer."""
    root = tmp_path_factory.mktemp("templates")
    targets = ["q_proj", "v_proj", "down_proj"]
    return {
        "attn_mlp": save_peft_adapter(base, root / "attn_mlp", seed=1, r=4, lora_alpha=8, target_modules=targets),
        "with_head": save_peft_adapter(
            base, root / "with_head", seed=2, r=4, lora_alpha=8, target_modules=[*targets, "lm_head"]
        ),
    }


def edited(templates, template: str, changes: dict, folder: Path) -> Path:
    """A copy of a template adapter with ``changes`` in its config."""
    shutil.copytree(templates[template], folder)
    config_file = folder / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return folder


def peft_logits(base, adapter: Path) -> torch.Tensor:
    with torch.no_grad():
        return PeftModel.from_pretrained(copy.deepcopy(base), adapter).eval()(INPUT_IDS).logits


def assert_rows_match_peft(base, model: MultiLoraModel, name: str, adapter: Path) -> None:
    """Row 0 with the adapter equals PEFT's output, row 1 (base) the base model's."""
    with torch.no_grad():
        logits = model(INPUT_IDS, adapter_ids=[name, None]).logits
        expected_base = base(INPUT_IDS).logits
    torch.testing.assert_close(logits[0], peft_logits(base, adapter)[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], expected_base[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", IGNORED_WEIGHTS)
def test_weights_peft_ignores_are_ignored(base, templates, tmp_path, case):
    template, changes = IGNORED_WEIGHTS[case]
    adapter = edited(templates, template, changes, tmp_path / case)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({case: adapter})
    assert_rows_match_peft(base, model, case, adapter)


def test_a_converted_file_keeps_peft_s_selection(base, templates, tmp_path):
    adapter = edited(templates, "attn_mlp", {"target_modules": ["q_proj"]}, tmp_path / "q_only")
    converted = convert_adapter(adapter, tmp_path / "q_only.safetensors")
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"converted": str(converted)})
    assert_rows_match_peft(base, model, "converted", adapter)


def test_reads_from_disk_keep_peft_s_selection(base, templates, tmp_path):
    """With one device slot and host room for one adapter, using three in turn reads them again from disk."""
    adapters = {
        "q": edited(templates, "attn_mlp", {"target_modules": ["q_proj"]}, tmp_path / "q"),
        "not_down": edited(templates, "attn_mlp", {"exclude_modules": ["down_proj"]}, tmp_path / "not_down"),
        "down": edited(templates, "attn_mlp", {"target_modules": ["down_proj"]}, tmp_path / "down"),
    }
    scratch = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
    scratch.load_adapters({"not_down": adapters["not_down"]})  # the largest
    one_adapter = scratch.adapter_stats["host_bytes_used"]
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8, host_pool_bytes=one_adapter)
    model.load_adapters(adapters)
    for name in ["q", "not_down", "down"] * 2:
        assert_rows_match_peft(base, model, name, adapters[name])
    assert model.adapter_stats["disk_loads"] >= 2


@pytest.mark.parametrize("case", REFUSED_BY_PEFT)
def test_adapters_peft_refuses_are_refused_and_change_nothing(base, templates, tmp_path, case):
    template, changes, problem = REFUSED_BY_PEFT[case]
    bad = edited(templates, template, changes, tmp_path / case)
    with pytest.raises(Exception):  # noqa: B017 (PEFT raises ValueError or its own NoMatchingPeftModuleError)
        peft_logits(base, bad)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=3, max_rank=8)
    model.load_adapters({"loaded": templates["attn_mlp"]})
    before = capture_state(model, INPUT_IDS, ["loaded", None])
    with pytest.raises(ValueError, match=re.escape(problem)):
        model.load_adapters({"good": templates["attn_mlp"], "bad": bad})
    assert_state_unchanged(model, before)


def test_selected_modules_without_weights_under_a_random_init_are_refused(base, templates, tmp_path):
    """PEFT starts them from random factors (init_lora_weights false): an output serving cannot reproduce."""
    bad = edited(templates, "attn_mlp", {"target_modules": ["q_proj", "k_proj"]}, tmp_path / "random_k")
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    problem = "adapter 'bad': its config selects modules it has no weights for (['model.layers.0.self_attn.k_proj'"
    with pytest.raises(ValueError, match=re.escape(problem)):
        model.load_adapters({"bad": bad})
    assert model.adapters == {}


def test_selection_is_peft_s_on_module_names(base, templates):
    """The pure function: names in, names out, for a model described by its module names."""
    config = LoraAdapterConfig.from_file(templates["attn_mlp"] / "adapter_config.json")
    model = ModelModules.of(base)
    assert select_modules(config, model) == {
        f"model.layers.{layer}.{module}"
        for layer in (0, 1) for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    assert model.output == "lm_head" and "lm_head" in model.linear and model.model_type == "llama"


def test_no_targets_on_a_model_type_without_peft_defaults_is_refused(templates):
    """PEFT fills absent target_modules from its table of model types, and refuses a type the table lacks."""
    raw = {**json.loads((templates["attn_mlp"] / "adapter_config.json").read_text()), "target_modules": None}
    names = ("", "blocks.0.proj", "blocks.1.proj")
    unknown_type = ModelModules(names=names, linear=frozenset(names[1:]), adaptable=frozenset(names[1:]))
    with pytest.raises(ValueError, match="names no target_modules and PEFT has no default targets for model type None"):
        select_modules(LoraAdapterConfig.from_dict(raw), unknown_type)
