"""The adapter table: which adapter sits in which slot, and writing adapters into the model's LoRA layers.

Loading is all-or-nothing: every adapter of a call is read and checked against the base model first (names,
free slots, module names, module kinds, shapes, ranks); only then are layers wrapped and slots written. A
failed call leaves the model and the table exactly as they were.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from torch import nn

from .layers import LoraContext, MultiLoraLinear, linear_features
from .formats import AdapterWeights


class AdapterStore:
    """Slots ``0..max_adapters-1`` of one model; a module is wrapped the first time an adapter targets it."""

    def __init__(self, model: nn.Module, max_adapters: int, max_rank: int, context: LoraContext) -> None:
        self.model = model
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.context = context
        self.slots: dict[str, int] = {}
        self.layers: dict[str, MultiLoraLinear] = {}
        self._targets_of: dict[str, frozenset[str]] = {}  # adapter name -> module names it writes

    def add(self, adapters: Mapping[str, AdapterWeights]) -> dict[str, int]:
        """Validate every adapter, then write them all. Returns ``{name: slot}`` of the new adapters."""
        for name in adapters:
            self._check_new_name(name)
        free_slots = [slot for slot in range(self.max_adapters) if slot not in self.slots.values()]
        if len(adapters) > len(free_slots):
            raise ValueError(
                f"no free adapter slot: {len(adapters)} adapter(s) to load, {len(free_slots)} of "
                f"max_adapters={self.max_adapters} slots free (unload_adapter() one first)"
            )
        modules = self._base_modules()
        for name, weights in adapters.items():
            self._check_fits(name, weights, modules)

        assigned = dict(zip(adapters, free_slots))
        for name, weights in adapters.items():
            for module_name, factors in weights.modules.items():
                self._layer(module_name, modules).set_slot(assigned[name], factors)
            self._targets_of[name] = frozenset(weights.modules)
        self.slots.update(assigned)
        return assigned

    def remove(self, name: str) -> None:
        if name not in self.slots:
            raise KeyError(f"unknown adapter {name!r}; loaded adapters: {sorted(self.slots)}")
        slot = self.slots.pop(name)
        for module_name in self._targets_of.pop(name):
            self.layers[module_name].set_slot(slot, None)

    def slot_of(self, adapter: str | int | None) -> int:
        """The slot of an adapter given by name or index; -1 for None or -1 (the base model)."""
        if adapter is None:
            return -1
        if isinstance(adapter, str):
            if adapter not in self.slots:
                raise KeyError(f"unknown adapter {adapter!r}; loaded adapters: {sorted(self.slots)}")
            return self.slots[adapter]
        if isinstance(adapter, bool) or not isinstance(adapter, numbers.Integral):
            raise ValueError(f"adapter_ids entries must be names, None or integer indices, got {adapter!r}")
        index = int(adapter)
        if index != -1 and index not in self.slots.values():
            raise KeyError(f"no adapter is loaded at index {index}; loaded adapters: {self.slots}")
        return index

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        if name in self.slots:
            raise ValueError(f"an adapter named {name!r} is already loaded; unload_adapter({name!r}) first")

    def _check_fits(self, name: str, weights: AdapterWeights, modules: dict[str, nn.Module]) -> None:
        output_layer = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        for module_name, factors in weights.modules.items():
            module = modules.get(module_name)
            if module is None:
                raise ValueError(f"adapter {name!r} does not fit the base model: it has no module {module_name}")
            if module is output_layer:
                raise ValueError(f"adapter {name!r}: LoRA on the output layer ({module_name}) is not supported yet")
            if isinstance(module, nn.Embedding):
                raise ValueError(f"adapter {name!r}: LoRA on embedding layers ({module_name}) is not supported yet")
            features = linear_features(module)
            if features is None:
                raise ValueError(
                    f"adapter {name!r}: module {module_name} is a {type(module).__name__}; "
                    "only nn.Linear and Conv1D modules are supported"
                )
            in_features, out_features = features
            if factors.lora_a.shape[1] != in_features or factors.lora_b.shape[0] != out_features:
                raise ValueError(
                    f"adapter {name!r} does not fit the base model: module {module_name} takes lora_A "
                    f"[r, {in_features}] and lora_B [{out_features}, r], the adapter has "
                    f"{list(factors.lora_a.shape)} and {list(factors.lora_b.shape)}"
                )
            if factors.rank > self.max_rank:
                raise ValueError(
                    f"adapter {name!r}: module {module_name} has rank {factors.rank} > max_rank={self.max_rank}"
                )

    def _base_modules(self) -> dict[str, nn.Module]:
        """The model's modules by name as if nothing were wrapped: a LoRA layer's name maps to its base layer
        and the wrapper's insides have no names, so checkpoints are checked against the base model alone."""
        modules = {}
        for name, module in self.model.named_modules():
            if name.rpartition(".")[0] in self.layers:
                continue
            modules[name] = module.base_layer if isinstance(module, MultiLoraLinear) else module
        return modules

    def _layer(self, module_name: str, modules: dict[str, nn.Module]) -> MultiLoraLinear:
        """The LoRA layer at ``module_name``, wrapping the base module in place on first use."""
        if module_name not in self.layers:
            parent_name, _, child_name = module_name.rpartition(".")
            parent = modules[parent_name] if parent_name else self.model
            layer = MultiLoraLinear(modules[module_name], self.max_adapters, self.max_rank, self.context)
            setattr(parent, child_name, layer)
            self.layers[module_name] = layer
        return self.layers[module_name]
