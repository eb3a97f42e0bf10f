"""Model surgery: which base modules get a LoRA hook, installing and removing hooks, projection groups.

The adapter store (``punica_hf.store``) manages memory only; it learns about the base model through the plain data
this module gives it (``linear_modules``: names, sizes, devices, dtypes) and asks for hooks by module name
(``attach`` / ``detach``), handing over the device tables the hooks read. ``MultiLoraModel`` makes one
``LoraInjection`` and passes it to its store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .base_layers import LinearModule, check_servable, linear_features, lora_device, lora_dtype
from .formats import AdapterWeights, ModelModules, weights_for_model
from .layers import DeviceTables, LoraContext, LoraHook, ProjectionGroup, find_projection_groups


class LoraInjection:
    """The LoRA hooks of one model, by module name, and the projection groups they share.

    ``layout_version`` is bumped whenever a hook is installed or removed: CUDA graphs captured before then run
    another set of hooks and must be captured again. (A device pool is only ever made for modules that get their
    first hook in the same call, so this also counts new pools.)
    """

    def __init__(self, model: nn.Module, context: LoraContext, max_rank: int) -> None:
        self.model = model
        self.context = context
        self.max_rank = max_rank
        self.hooks: dict[str, LoraHook] = {}
        self.groups: dict[str, ProjectionGroup] | None = None  # module name -> its group, made with the first hook
        self.layout_version = 0

    def linear_modules(self) -> dict[str, LinearModule]:
        """Every linear module of the model, in model order (the order of the device tables' rows)."""
        model_dtype = getattr(self.model, "dtype", torch.get_default_dtype())
        found = {}
        for name, module in self.model.named_modules():
            features = linear_features(module)
            if features is None:
                continue
            servable = _servable(module, name)
            found[name] = LinearModule(
                in_features=features[0], out_features=features[1],
                device=lora_device(module) if servable else None,
                dtype=lora_dtype(module, model_dtype) if servable else None,
            )
        return found

    def select(self, adapter: str, weights: AdapterWeights) -> AdapterWeights:
        """The part of ``weights`` that PEFT would load into the model: its own module matching decides (see
        ``formats.weights_for_model``); ValueError naming the adapter where PEFT refuses it."""
        try:
            return weights_for_model(weights, ModelModules.of(self.model))
        except ValueError as error:
            raise ValueError(f"adapter {adapter!r}: {error}") from None

    def check_targets(self, adapter: str, module_names: Iterable[str]) -> None:
        """Raise ValueError naming the first of ``module_names`` that cannot get a LoRA hook, and why."""
        modules = dict(self.model.named_modules())
        output_layer = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        for module_name in module_names:
            module = modules.get(module_name)
            if module is None:
                raise ValueError(f"adapter {adapter!r} does not fit the base model: it has no module {module_name}")
            if module is output_layer:
                raise ValueError(f"adapter {adapter!r}: LoRA on the output layer ({module_name}) is not supported yet")
            if isinstance(module, nn.Embedding):
                raise ValueError(f"adapter {adapter!r}: LoRA on embedding layers ({module_name}) is not supported yet")
            check_servable(module, module_name)

    def attach(
        self, module_names: Iterable[str], tables: Mapping[torch.device, DeviceTables], rows: Mapping[str, int]
    ) -> list[str]:
        """Hook each of ``module_names`` that has no hook yet, reading the tables of its device at its row; all or
        none. Returns the names hooked by this call."""
        modules = dict(self.model.named_modules())
        if self.groups is None:  # once, with the first hook: every module's group, hooked or not
            linear = {
                name: (m.in_features, m.out_features, m.device)
                for name, m in self.linear_modules().items() if m.device is not None
            }
            self.groups = find_projection_groups(linear, rows)
        hooked = []
        try:
            for module_name in module_names:
                if module_name in self.hooks:
                    continue
                module = modules[module_name]
                in_features, out_features = linear_features(module)
                self.hooks[module_name] = LoraHook(
                    module, in_features, out_features, tables[lora_device(module)], rows[module_name], self.context,
                    self.max_rank, self.groups.get(module_name),
                )
                hooked.append(module_name)
        except BaseException:
            self.detach(hooked)
            raise
        if hooked:
            self.layout_version += 1
        return hooked

    def detach(self, module_names: Iterable[str]) -> None:
        """Remove the hooks of ``module_names`` (names without one are skipped)."""
        removed = False
        for module_name in module_names:
            hook = self.hooks.pop(module_name, None)
            if hook is not None:
                hook.remove()
                removed = True
        if removed:
            self.layout_version += 1

    def detach_all(self) -> None:
        self.detach(list(self.hooks))


def _servable(module: nn.Module, name: str) -> bool:
    try:
        check_servable(module, name)
    except ValueError:
        return False
    return True
