"""Which modules of a base model an adapter changes: PEFT's module selection, applied to the model's module names.

PEFT puts LoRA on the modules its config selects (``target_modules``, ``exclude_modules``, ``layers_to_transform``
/ ``layers_pattern``) and then loads the checkpoint's weights of those modules: weights of the model's other
modules are ignored, a selected module without weights keeps its initial LoRA (zero for the default
initialisations), and a config that selects nothing is refused. Serving does the same, each name decided by peft's own
``check_target_module_exists``, so that an adapter changes exactly what it changes under ``PeftModel``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import LoraAdapterConfig
from .weights import AdapterWeights, ModuleLora

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer
# init_lora_weights values under which PEFT starts lora_B at zero: a selected module without weights changes nothing
_ZERO_DELTA_INITS = (True, "gaussian")
# The layers PEFT's "all-linear" takes (quantized linears subclass nn.Linear), and those it has a LoRA layer for
_LINEAR = (nn.Linear, Conv1D)
_ADAPTABLE = (*_LINEAR, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


@dataclass(frozen=True)
class ModelModules:
    """What PEFT's selection reads of a base model: its ``named_modules()`` names; its linear layers and output
    layer (they resolve ``"all-linear"``); the modules PEFT has a LoRA layer for (``adaptable``: linear,
    embedding, convolution, attention); its ``config.model_type`` (default targets when a config names none); and
    for ``target_parameters``, each module's own parameters (``parameters``: name -> ``((parameter, shape), ...)``
    in registration order, the order PEFT nests its wrappers in) and the modules that store experts transposed
    (``[E, in, out]``)."""

    names: tuple[str, ...]
    linear: frozenset[str] = frozenset()
    adaptable: frozenset[str] = frozenset()
    output: str | None = None
    model_type: str | None = None
    parameters: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = dataclasses.field(default_factory=dict)
    transposed: frozenset[str] = frozenset()

    @classmethod
    def of(cls, model: nn.Module) -> "ModelModules":
        """Read off ``model`` (nothing in it changes)."""
        modules = dict(model.named_modules())
        get_output = getattr(model, "get_output_embeddings", None)
        output_layer = get_output() if callable(get_output) else None
        return cls(
            names=tuple(modules),
            linear=frozenset(name for name, module in modules.items() if isinstance(module, _LINEAR)),
            adaptable=frozenset(name for name, module in modules.items() if isinstance(module, _ADAPTABLE)),
            output=next((name for name, module in modules.items() if module is output_layer), None),
            model_type=getattr(getattr(model, "config", None), "model_type", None),
            parameters={
                name: own for name, module in modules.items()
                if (own := tuple((p, tuple(t.shape)) for p, t in module.named_parameters(recurse=False)))
            },
            transposed=frozenset(name for name, module in modules.items() if getattr(module, "is_transposed", False)),
        )


def select_modules(config: LoraAdapterConfig, model: ModelModules, parameters_selected: bool = False) -> set[str]:
    """The names of ``model``'s modules that PEFT puts this adapter on.

    Raises ``ValueError`` where PEFT refuses to load the adapter onto such a model: no module selected (unless
    ``parameters_selected``: its ``target_parameters`` select some), or no targets and no default targets for its
    type.
    """
    from peft.tuners.tuners_utils import check_target_module_exists  # imported late: see config._read_with_peft

    if config.peft_config is None:
        raise ValueError("a LoRA config made in code has no module selection: its weights say which modules it changes")
    selection = copy.copy(config.peft_config)  # resolved targets go into a copy: the config stays as it was read
    selection.target_modules = _resolved_targets(selection.target_modules, model, bool(selection.target_parameters))
    selected, excluded, unmatched = set(), [], []
    for name in model.names:
        if not name:  # the model itself
            continue
        verdict = check_target_module_exists(selection, name)
        if verdict:
            selected.add(name)
        elif isinstance(verdict, (bool, type(None))):
            unmatched.append(name)
        else:  # peft's falsy marker of a module that exclude_modules takes out
            excluded.append(name)
    if not selected and not parameters_selected:
        raise ValueError(_why_nothing_selected(selection, bool(excluded), bool(unmatched)))
    no_lora_layer = sorted(selected - model.adaptable)
    if no_lora_layer:
        raise ValueError(
            f"PEFT refuses this adapter on this base model: its target_modules select {no_lora_layer[:3]}, modules "
            "PEFT has no LoRA layer for"
        )
    return selected


def weights_for_model(weights: AdapterWeights, model: ModelModules) -> AdapterWeights:
    """``weights`` less those of ``model``'s modules that PEFT would not put this adapter on; the same object when
    nothing is dropped. Adapters whose config was made in code keep all their modules.

    Weights naming a module that ``model`` lacks or that PEFT has no LoRA layer for are kept: PEFT cannot have
    saved them for this model (a checkpoint of another model, or a broken one), and the adapter store refuses
    them by name. ``ValueError`` where PEFT refuses the adapter, or where a selected module has no weights and
    PEFT would start it from non-zero factors (random ones, which serving cannot reproduce).
    """
    config = weights.config
    if config.peft_config is None:
        if weights.parameters:
            raise ValueError("LoRA on expert parameters needs the adapter's PEFT config (its target_parameters)")
        return weights
    experts = expert_factors(weights, model)
    selected = select_modules(config, model, parameters_selected=bool(experts))
    strays = {name for name in weights.modules if name not in model.adaptable}
    without_weights = sorted(selected - weights.modules.keys())
    init = config.peft_config.init_lora_weights
    if without_weights and init not in _ZERO_DELTA_INITS and not strays:  # strays: the store's error comes first
        raise ValueError(
            f"its config selects modules it has no weights for ({without_weights[:3]}), "
            f"which PEFT would start from init_lora_weights={init!r}, not from zero"
        )
    kept = {name: factors for name, factors in weights.modules.items() if name in selected or name in strays}
    if len(kept) == len(weights.modules) and not weights.parameters:
        return weights
    return dataclasses.replace(weights, modules={**kept, **experts}, parameters={})


def expert_entry(parameter_key: str, expert: int) -> str:
    """The name under which expert ``expert`` of the fused parameter ``parameter_key`` (``...experts.down_proj``)
    gets its own LoRA factors, as if it were a linear module. No real module can have it: a module's attribute
    (the parameter) cannot also be a submodule."""
    return f"{parameter_key}.{expert}"


def expert_factors(weights: AdapterWeights, model: ModelModules) -> dict[str, ModuleLora]:
    """``weights.parameters`` split per expert (``expert_entry`` names, scaling folded into B), as PEFT's
    ``ParamWrapper`` reads them: ``lora_A`` ``[r * E, in]`` holds expert ``e``'s A in rows ``e*r .. e*r + r - 1``,
    ``lora_B`` ``[out, r * E]`` its B in columns ``e, e + E, e + 2E, ...``. The parameters of one module that the
    ``target_parameters`` select are wrapped in registration order, the last one outermost (PEFT's key for the
    module itself, each inner one with one more ``.base_layer``). ValueError where weights are missing or left
    over, or a selected parameter is not a stack of experts."""
    config = weights.config
    targets = set(config.peft_config.target_parameters or [])
    remaining = dict(weights.parameters)
    found = {}
    for module_name, own in model.parameters.items():
        targeted = [(name, shape) for name, shape in own if _selects(targets, f"{module_name}.{name}")]
        for depth, (name, shape) in enumerate(reversed(targeted)):
            key = f"{module_name}.{name}"
            if len(shape) != 3:
                raise ValueError(f"its target_parameters select {key} of shape {list(shape)}: punica_hf serves "
                                 "LoRA on stacked expert weights [experts, out, in] only")
            factors = remaining.pop(module_name + ".base_layer" * depth, None)
            if factors is None:
                if config.peft_config.init_lora_weights not in _ZERO_DELTA_INITS:
                    raise ValueError(f"it has no weights for {key}, which PEFT would start from "
                                     f"init_lora_weights={config.peft_config.init_lora_weights!r}, not from zero")
                continue
            experts, first, second = shape
            in_features, out_features = (first, second) if module_name in model.transposed else (second, first)
            rank = config.rank_for(key)
            expected_a, expected_b = (rank * experts, in_features), (out_features, rank * experts)
            if factors.lora_a.shape != expected_a or factors.lora_b.shape != expected_b:
                raise ValueError(
                    f"{key} ({experts} experts, rank {rank}) takes lora_A {list(expected_a)} and lora_B "
                    f"{list(expected_b)}, the adapter has {list(factors.lora_a.shape)} and "
                    f"{list(factors.lora_b.shape)}"
                )
            lora_a = factors.lora_a.view(experts, rank, in_features)
            lora_b = factors.lora_b.view(out_features, rank, experts) * config.scaling_for(key)
            for expert in range(experts):
                found[expert_entry(key, expert)] = ModuleLora(
                    lora_a=lora_a[expert].contiguous(), lora_b=lora_b[:, :, expert].contiguous()
                )
    if remaining:
        raise ValueError(f"it has LoRA weights for parameters of {sorted(remaining)[:3]}, which its "
                         f"target_parameters={sorted(targets)} do not select in this base model")
    return found


def _selects(targets: set[str], parameter_key: str) -> bool:
    # PEFT's rule for target_parameters: the whole name, or its end at a "." boundary
    return parameter_key in targets or any(parameter_key.endswith("." + target) for target in targets)


def _resolved_targets(targets, model: ModelModules, targets_parameters: bool):
    """``target_modules`` as PEFT resolves it for a model before matching: ``"all-linear"`` and null replaced
    (null stays null for a config that targets parameters and a model type without default targets)."""
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return set(model.linear) - {model.output}
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.model_type)
        if default is None:
            if targets_parameters:
                return None
            raise ValueError(
                f"the adapter config names no target_modules and PEFT has no default targets for model type "
                f"{model.model_type!r}"
            )
        return default if isinstance(default, str) else set(default)
    return targets


def _why_nothing_selected(selection, some_excluded: bool, some_unmatched: bool) -> str:
    """PEFT's reason for refusing a config that selects no module, in its order of cases."""
    refused = "PEFT refuses this adapter on this base model: "
    layers = ""
    if selection.layers_to_transform is not None:
        layers += f" (with layers_to_transform={selection.layers_to_transform!r}"
        if selection.layers_pattern is not None:
            layers += f" and layers_pattern={selection.layers_pattern!r}"
        layers += ")"
    if some_excluded and not some_unmatched:
        return refused + f"exclude_modules={_shown(selection.exclude_modules)} takes out every module it targets"
    if not some_excluded and not selection.target_modules:
        return refused + "its target_modules are empty"
    if not some_excluded:
        return refused + f"no module matches target_modules={_shown(selection.target_modules)}{layers}"
    return (
        refused + f"no module is left of target_modules={_shown(selection.target_modules)}{layers} once "
        f"exclude_modules={_shown(selection.exclude_modules)} takes its matches out"
    )


def _shown(targets) -> str:
    return repr(sorted(targets)) if isinstance(targets, set) else repr(targets)
