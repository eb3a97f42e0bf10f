"""Model surgery: which base modules get a LoRA hook, installing and removing hooks, projection groups.

The adapter store (``punica_hf.store``) manages memory only; it learns about the base model through the plain data
this module gives it (``linear_modules``: names, sizes, devices, dtypes) and asks for hooks by module name
(``attach`` / ``detach``), handing over the device tables the hooks read. ``MultiLoraModel`` makes one
``LoraInjection`` and passes it to its store.

Under tensor parallelism (``punica_hf.tensor_parallel``) every size given to the store is this rank's (local
widths), ``select`` gives this rank's share of each adapter, and hooks on split layers sit inside the layers'
tensor-parallel wrappers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from .base_layers import LinearModule, check_servable, linear_features, lora_device, lora_dtype
from .adapter_vectors import check_other_biases, output_vectors
from .formats import AdapterWeights, ModelModules, ModuleLora, weights_for_model
from .formats.weights import VECTOR_NAMES
from .layers import DeviceTables, LoraContext, LoraHook, ProjectionGroup, find_projection_groups
from .tensor_parallel import COLUMN, LinearSplit, find_splits, take_wrapper_off, wrap


class LoraInjection:
    """The LoRA hooks of one model, by module name, and the projection groups they share.

    ``layout_version`` is bumped whenever a hook is installed or removed, or ``attach`` finds new tables of output
    vectors (DoRA, LoRA biases) that hooks apply: CUDA graphs captured before then run other ops and must be
    captured again. (A device pool is only ever made for modules that get their
    first hook in the same call, so this also counts new pools.)
    """

    def __init__(self, model: nn.Module, context: LoraContext, max_rank: int) -> None:
        self.model = model
        self.context = context
        self.max_rank = max_rank
        self.hooks: dict[str, LoraHook] = {}
        self.groups: dict[str, ProjectionGroup] | None = None  # module name -> its group, made with the first hook
        self.layout_version = 0
        self._vector_tables = 0  # output-vector tables seen by attach (they are never removed)
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
        return found

    def select(self, adapter: str, weights: AdapterWeights) -> AdapterWeights:
        """The part of ``weights`` that PEFT would load into the model: its own module matching decides (see
        ``formats.weights_for_model``); ValueError naming the adapter where PEFT refuses it. Under tensor
        parallelism, this rank's share of each split layer's factors."""
        try:
            selected = weights_for_model(weights, ModelModules.of(self.model))
            column_splits = {name: split.out_slice for name, split in self.splits.items() if split.style == COLUMN}
            check_other_biases(selected, self.model, column_splits)
            if not self.splits and not any(factors.has_vectors for factors in selected.modules.values()):
                return selected
            modules = dict(self.model.named_modules())
            shares = {}
            for name, factors in selected.modules.items():
                split = self.splits.get(name)
                if split is not None and split.problem is None:  # else refused by check_targets, with the reason
                    factors = _shard(name, split, factors, modules[name])
                if name in modules and (split is None or split.problem is None):  # else a stray check_targets refuses
                    factors = output_vectors(name, modules[name], factors)
                shares[name] = factors
            return replace(selected, modules=shares)
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
            split = self.splits.get(module_name)
            if split is None:
                check_servable(module, module_name)
            elif split.problem is not None:
                raise ValueError(
                    f"adapter {adapter!r}: module {module_name} is split by tensor parallelism and LoRA on it is not "
                    f"supported: {split.problem}"
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
        vector_tables = sum(device_tables.vector_table_count for device_tables in tables.values())
        if hooked or vector_tables != self._vector_tables:
            for hook in self.hooks.values():  # hooks installed before their layer's vector tables were made
                hook.vectors = hook.tables.vectors.get(hook.row)
            self.layout_version += 1
            self._vector_tables = vector_tables
        return hooked

    def detach(self, module_names: Iterable[str]) -> None:
        """Remove the hooks of ``module_names`` (names without one are skipped); a split layer gets its
        tensor-parallel wrapper back."""
        removed = False
        for module_name in module_names:
            hook = self.hooks.pop(module_name, None)
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


def _shard(name: str, split: LinearSplit, factors: ModuleLora, module: nn.Module) -> ModuleLora:
    """This rank's share of a split layer's factors and of their per-output-row vectors (column splits only: on a
    row-split layer the vectors would apply to each rank's partial sum, before the all-reduce)."""
    share = split.shard(name, factors, *linear_features(module))
    if not factors.has_vectors:
        return share
    if split.style != COLUMN:
        raise ValueError(
            f"module {name} is split by its input features (tensor parallelism): DoRA and LoRA biases need its whole "
            "output, which only the all-reduce after it has; they are served on column-split layers only"
        )
    rows = {key: getattr(factors, key)[split.out_slice] for key in VECTOR_NAMES if getattr(factors, key) is not None}
    return replace(share, **rows)


def _servable(module: nn.Module, name: str) -> bool:
    try:
        check_servable(module, name)
    except ValueError:
        return False
    return True
