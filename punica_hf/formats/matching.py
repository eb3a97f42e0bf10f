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
from .weights import AdapterWeights

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
    embedding, convolution, attention); and its ``config.model_type`` (default targets when a config names none)."""

    names: tuple[str, ...]
    linear: frozenset[str] = frozenset()
    adaptable: frozenset[str] = frozenset()
    output: str | None = None
    model_type: str | None = None

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
        )


def select_modules(config: LoraAdapterConfig, model: ModelModules) -> set[str]:
    """The names of ``model``'s modules that PEFT puts this adapter on.

    Raises ``ValueError`` where PEFT refuses to load the adapter onto such a model: no module selected, or no
    targets and no default targets for its type.
    """
    from peft.tuners.tuners_utils import check_target_module_exists  # imported late: see config._read_with_peft

    if config.peft_config is None:
        raise ValueError("a LoRA config made in code has no module selection: its weights say which modules it changes")
    selection = copy.copy(config.peft_config)  # resolved targets go into a copy: the config stays as it was read
    selection.target_modules = _resolved_targets(selection.target_modules, model)
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
    if not selected:
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
        return weights
    selected = select_modules(config, model)
    strays = {name for name in weights.modules if name not in model.adaptable}
    without_weights = sorted(selected - weights.modules.keys())
    init = config.peft_config.init_lora_weights
    if without_weights and init not in _ZERO_DELTA_INITS and not strays:  # strays: the store's error comes first
        raise ValueError(
            f"its config selects modules it has no weights for ({without_weights[:3]}), "
            f"which PEFT would start from init_lora_weights={init!r}, not from zero"
        )
    kept = {name: factors for name, factors in weights.modules.items() if name in selected or name in strays}
    if len(kept) == len(weights.modules):
        return weights
    return dataclasses.replace(weights, modules=kept)


def _resolved_targets(targets, model: ModelModules):
    """``target_modules`` as PEFT resolves it for a model before matching: ``"all-linear"`` and null replaced."""
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return set(model.linear) - {model.output}
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.model_type)
        if default is None:
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
