"""Model surgery: which base modules get a LoRA hook, installing and removing hooks, projection groups.

The adapter store (``punica_hf.store``) manages memory only; it learns about the base model through the plain data
this module gives it (``linear_modules``: names, sizes, devices, dtypes) and asks for hooks by module name
(``attach`` / ``detach``), handing over the device tables the hooks read. ``MultiLoraModel`` makes one
``LoraInjection`` and passes it to its store.

Under tensor parallelism (``punica_hf.tensor_parallel``) every size given to the store is this rank's (local
widths), ``select`` gives this rank's share of each adapter, and hooks on split layers sit inside the layers'
tensor-parallel wrappers.

LoRA on MoE experts (PEFT ``target_parameters``) takes the same road: each expert of a fused experts parameter is a
"linear module" of the store under its ``formats.expert_entry`` name, and all of one module's entries share one
``moe_layer.ExpertsLoraHook``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from .base_layers import LinearModule, check_servable, linear_features, lora_device, lora_dtype
from .formats import AdapterWeights, ModelModules, expert_entry, weights_for_model
from .layers import DeviceTables, LoraContext, LoraHook, ProjectionGroup, find_projection_groups
from .moe_layer import EXPERT_PARAMETERS, ExpertsLoraHook, expert_entries, experts_problem
from .tensor_parallel import LinearSplit, find_splits, take_wrapper_off, wrap


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
        self.hooks: dict[str, LoraHook | ExpertsLoraHook] = {}
        self.experts = expert_entries(model)  # expert entry name -> (experts module, parameter, expert)
        self.experts_hooks: dict[str, ExpertsLoraHook] = {}  # experts module name -> its hook
        self.groups: dict[str, ProjectionGroup] | None = None  # module name -> its group, made with the first hook
        self.layout_version = 0
        self.splits: dict[str, LinearSplit] = find_splits(model)  # layers split by tensor parallelism
        self.tp_wrappers: dict[str, object] = {}  # split layer -> the tensor-parallel forward its hook's wrapper replaced

    @property
    def tensor_parallel(self) -> bool:
        """Whether the model has layers split by tensor parallelism."""
        return bool(self.splits)

    def features(self, name: str, module: nn.Module) -> tuple[int, int] | None:
        """``(in_features, out_features)`` of a linear module as its forward sees them: this rank's share of a
        split layer."""
        split = self.splits.get(name)
        if split is not None:
            return split.in_features, split.out_features
        return linear_features(module)

    def linear_modules(self) -> dict[str, LinearModule]:
        """Every linear module of the model, in model order (the order of the device tables' rows)."""
        model_dtype = getattr(self.model, "dtype", torch.get_default_dtype())
        found = {}
        for name, module in self.model.named_modules():
            features = self.features(name, module)
            if features is None:
                continue
            servable = self.splits[name].problem is None if name in self.splits else _servable(module, name)
            found[name] = LinearModule(
                in_features=features[0], out_features=features[1],
                device=lora_device(module) if servable else None,
                dtype=lora_dtype(module, model_dtype) if servable else None,
                unsplit_features=linear_features(module) if name in self.splits else None,
            )
        modules = dict(self.model.named_modules())
        for name, (module_name, parameter, _) in self.experts.items():
            module = modules[module_name]
            weight = getattr(module, parameter)
            servable = not self.splits and experts_problem(module) is None
            _, first, second = weight.shape  # [E, out, in], the layout experts_problem lets through
            found[name] = LinearModule(
                in_features=second, out_features=first, device=weight.device if servable else None,
                dtype=weight.dtype if servable else None,
            )
        return found

    def select(self, adapter: str, weights: AdapterWeights) -> AdapterWeights:
        """The part of ``weights`` that PEFT would load into the model: its own module matching decides (see
        ``formats.weights_for_model``); ValueError naming the adapter where PEFT refuses it. Under tensor
        parallelism, this rank's share of each split layer's factors."""
        try:
            selected = weights_for_model(weights, ModelModules.of(self.model))
            if not self.splits:
                return selected
            modules = dict(self.model.named_modules())
            shares = {}
            for name, factors in selected.modules.items():
                split = self.splits.get(name)
                if split is None or split.problem is not None:  # refused by check_targets, with the reason
                    shares[name] = factors
                else:
                    shares[name] = split.shard(name, factors, *linear_features(modules[name]))
            return replace(selected, modules=shares)
        except ValueError as error:
            raise ValueError(f"adapter {adapter!r}: {error}") from None

    def check_targets(self, adapter: str, module_names: Iterable[str]) -> None:
        """Raise ValueError naming the first of ``module_names`` that cannot get a LoRA hook, and why."""
        modules = dict(self.model.named_modules())
        output_layer = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        for module_name in module_names:
            if module_name in self.experts:
                self._check_experts(adapter, module_name, modules[self.experts[module_name].module])
                continue
            module = modules.get(module_name)
            if module is None:
                raise ValueError(f"adapter {adapter!r} does not fit the base model: it has no module {module_name}")
            if module is output_layer:
                raise ValueError(f"adapter {adapter!r}: LoRA on the output layer ({module_name}) is not supported yet")
            if isinstance(module, nn.Embedding):
                raise ValueError(f"adapter {adapter!r}: LoRA on embedding layers ({module_name}) is not supported yet")
            split = self.splits.get(module_name)
            if split is None:
                check_servable(module, module_name)
            elif split.problem is not None:
                raise ValueError(
                    f"adapter {adapter!r}: module {module_name} is split by tensor parallelism and LoRA on it is not "
                    f"supported: {split.problem}"
                )

    def _check_experts(self, adapter: str, entry: str, module: nn.Module) -> None:
        experts_module = self.experts[entry].module
        if self.splits:
            raise ValueError(
                f"adapter {adapter!r}: LoRA on MoE experts ({experts_module}) is not supported under tensor "
                "parallelism: the experts' LoRA runs on unsplit weights"
            )
        problem = experts_problem(module)
        if problem is None and self.experts[entry].parameter not in EXPERT_PARAMETERS:
            problem = f"LoRA is served on its {' and '.join(EXPERT_PARAMETERS)} only"
        if problem is not None:
            raise ValueError(
                f"adapter {adapter!r}: LoRA on the experts of {experts_module} ({type(module).__name__}) is not "
                f"supported: {problem}"
            )

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
                if module_name in self.experts:
                    self.hooks[module_name] = self._experts_hook(module_name, modules, tables, rows)
                    hooked.append(module_name)
                    continue
                module = modules[module_name]
                in_features, out_features = self.features(module_name, module)
                split = self.splits.get(module_name)
                hooked.append(module_name)  # from here on a failure undoes this module too
                if split is not None:  # the hook goes inside the layer's tensor-parallel wrapper
                    self.tp_wrappers[module_name] = take_wrapper_off(module)
                self.hooks[module_name] = LoraHook(
                    module, in_features, out_features, tables[lora_device(module)], rows[module_name], self.context,
                    self.max_rank, self.groups.get(module_name),
                )
                if split is not None:
                    wrap(module, split)
        except BaseException:
            self.detach(hooked)
            raise
        if hooked:
            self.layout_version += 1
        return hooked

    def _experts_hook(self, entry: str, modules: dict[str, nn.Module], tables, rows) -> ExpertsLoraHook:
        """The hook of ``entry``'s experts module, installed by the first of its entries."""
        module_name = self.experts[entry].module
        hook = self.experts_hooks.get(module_name)
        if hook is None:
            module = modules[module_name]
            weight = module.gate_up_proj
            experts_rows = {
                parameter: [rows[expert_entry(f"{module_name}.{parameter}", e)] for e in range(weight.shape[0])]
                for parameter in EXPERT_PARAMETERS
            }
            hook = ExpertsLoraHook(module, experts_rows, tables[weight.device], self.context, self.max_rank)
            self.experts_hooks[module_name] = hook
        hook.entries.add(entry)
        return hook

    def detach(self, module_names: Iterable[str]) -> None:
        """Remove the hooks of ``module_names`` (names without one are skipped); a split layer gets its
        tensor-parallel wrapper back; an experts module's hook goes with its last entry."""
        removed = False
        for module_name in module_names:
            hook = self.hooks.pop(module_name, None)
            if isinstance(hook, ExpertsLoraHook):
                hook.entries.discard(module_name)
                if hook.entries:
                    continue
                del self.experts_hooks[self.experts[module_name].module]
            if hook is not None:
                hook.remove()
                removed = True
            tp_forward = self.tp_wrappers.pop(module_name, None)
            if tp_forward is not None:  # replaces the wrapper around the hook
                self.model.get_submodule(module_name).forward = tp_forward
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
