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

import inspect
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from .base_layers import (
    LinearModule, activation_dtype, check_servable, is_plain_float, linear_features, lora_device, lora_dtype,
)
from .adapter_vectors import check_other_biases, output_vectors
from .formats import AdapterWeights, ModelModules, ModuleLora, expert_entry, weights_for_model
from .formats.weights import VECTOR_NAMES
from .layers import DeviceTables, LoraContext, LoraHook, ProjectionGroup, find_projection_groups
from .moe_layer import EXPERT_PARAMETERS, ExpertsLoraHook, expert_entries, experts_problem
from .tensor_parallel import COLUMN, LinearSplit, find_splits, take_wrapper_off, wrap
from .vocab_layers import EmbeddingLoraHook, OutputLoraHook


class LoraInjection:
    """The LoRA hooks of one model, by module name, and the projection groups they share.

    ``layout_version`` is bumped whenever a hook is installed or removed, or hooks start or stop applying tables of
    output vectors (DoRA, LoRA biases; ``use_vectors``): CUDA graphs captured before then run other ops and must be
    captured again. (A device pool is only ever made for modules that get their first hook in the same call, so
    this also counts new pools.)
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
        split layer. An embedding counts as a linear layer on one-hot token ids: ``(vocab size, width)``."""
        split = self.splits.get(name)
        if split is not None:
            return split.in_features, split.out_features
        if isinstance(module, nn.Embedding):
            return module.num_embeddings, module.embedding_dim
        return linear_features(module)

    def linear_modules(self) -> dict[str, LinearModule]:
        """Every linear module of the model and every embedding (see ``features``), in model order (the order of
        the device tables' rows)."""
        model_dtype = activation_dtype(self.model)
        found = {}
        for name, module in self.model.named_modules():
            features = self.features(name, module)
            if features is None:
                continue
            if name in self.splits:
                servable = self.splits[name].problem is None
            elif isinstance(module, nn.Embedding):
                servable = _embedding_problem(module) is None
            else:
                servable = _servable(module, name)
            split = self.splits.get(name)
            whole = linear_features(module) if split is not None else None  # None: not split, or no linear layer
            found[name] = LinearModule(
                in_features=features[0], out_features=features[1],
                device=lora_device(module) if servable else None,
                dtype=lora_dtype(module, model_dtype) if servable else None,
                unsplit_features=whole,
                widest_features=None if whole is None or split.problem else split.widest_features(*whole),
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
            selected = self._with_tied_output_lora(weights, weights_for_model(weights, ModelModules.of(self.model)))
            self._check_base_copies(selected)
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

    def _check_base_copies(self, weights: AdapterWeights) -> None:
        """ValueError unless each full copy of a base layer the adapter carries (PEFT saves one beside LoRA on
        embeddings and lm_head, and loads it over the base weight) equals the model's weight: a resized vocabulary
        or retrained rows would need a base weight per adapter."""
        modules = dict(self.model.named_modules())
        for name, saved in weights.base_weights.items():
            if name not in weights.modules:  # not put on this model (PEFT's selection): PEFT does not load it
                continue
            weight = getattr(modules.get(name), "weight", None)
            if not isinstance(weight, torch.Tensor) or self.splits:  # refused by check_targets, with the reason
                continue
            if tuple(saved.shape) != tuple(weight.shape):
                raise ValueError(
                    f"its copy of {name}.weight is {list(saved.shape)} but the base model's is {list(weight.shape)}: "
                    "the adapter was trained on a resized vocabulary, and extra vocabulary rows (a base weight per "
                    "adapter) are not supported"
                )
            if weight.device.type == "meta":
                raise ValueError(f"its copy of {name}.weight cannot be checked against the offloaded base weight")
            if not torch.equal(saved.to(device=weight.device, dtype=weight.dtype), weight):
                raise ValueError(
                    f"its copy of {name}.weight differs from the base model's, and PEFT loads that copy over the "
                    "base weight: a base weight per adapter (new or retrained vocabulary rows, another base model) "
                    "is not supported"
                )

    def _with_tied_output_lora(self, weights: AdapterWeights, selected: AdapterWeights) -> AdapterWeights:
        """``selected`` plus the output layer's LoRA where PEFT ties it to the embedding's: ``ensure_weight_tying``
        on a model whose lm_head shares the embedding's weight, the embedding targeted. PEFT then leaves lm_head out
        of the saved targets and gives it the embedding's factors transposed (``A = B_emb^T``, ``B = A_emb^T``) at
        lm_head's own scaling; the checkpoint holds them under lm_head's name (``weights``, before selection)."""
        input_layer = getattr(self.model, "get_input_embeddings", lambda: None)()
        output_layer = self._output_layer()
        names = {module: name for name, module in self.model.named_modules()}
        peft_config = weights.config.peft_config
        if not (
            getattr(peft_config, "ensure_weight_tying", False) and _names_a_peft_embedding(peft_config.target_modules)
            and input_layer is not None and getattr(output_layer, "weight", None) is input_layer.weight
            and names[input_layer] in selected.modules
        ):
            return selected
        output_name = names[output_layer]
        if output_name not in weights.modules:
            raise ValueError(
                f"its config ties {output_name}'s LoRA to {names[input_layer]}'s (ensure_weight_tying=True) but it "
                f"holds no {output_name} weights"
            )
        return replace(selected, modules={**selected.modules, output_name: weights.modules[output_name]})

    def check_targets(self, adapter: str, module_names: Iterable[str]) -> None:
        """Raise ValueError naming the first of ``module_names`` that cannot get a LoRA hook, and why."""
        modules = dict(self.model.named_modules())
        output_layer = self._output_layer()
        for module_name in module_names:
            if module_name in self.experts:
                self._check_experts(adapter, module_name, modules[self.experts[module_name].module])
                continue
            module = modules.get(module_name)
            if module is None:
                raise ValueError(f"adapter {adapter!r} does not fit the base model: it has no module {module_name}")
            vocab_layer = "the output layer" if module is output_layer else "embedding layers"
            if (module is output_layer or isinstance(module, nn.Embedding)) and self.splits:
                raise ValueError(
                    f"adapter {adapter!r}: LoRA on {vocab_layer} ({module_name}) of a model split by tensor "
                    "parallelism is not supported"
                )
            if isinstance(module, nn.Embedding):
                problem = _embedding_problem(module)
                if problem is not None:
                    raise ValueError(
                        f"adapter {adapter!r}: LoRA on embedding {module_name} is not supported: {problem}"
                    )
                continue
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

    def decide_backends(self, devices: Iterable[torch.device]) -> None:
        """Decide the LoRA ops of each of ``devices`` (eagerly, where not decided yet): a compiled forward cannot,
        since finding or building the kernels is not traceable."""
        for device in devices:
            self.context.backend(device)

    def attach(
        self, module_names: Iterable[str], tables: Mapping[torch.device, DeviceTables], rows: Mapping[str, int]
    ) -> list[str]:
        """Hook each of ``module_names`` that has no hook yet, reading the tables of its device at its row; all or
        none. Returns the names hooked by this call."""
        self.decide_backends(tables)
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
                hook_kind = (
                    EmbeddingLoraHook if isinstance(module, nn.Embedding)
                    else OutputLoraHook if module is self._output_layer() else LoraHook
                )
                self.hooks[module_name] = hook_kind(
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

    def use_vectors(self, module_names: Collection[str]) -> None:
        """Point the hooks of ``module_names`` (the layers a registered adapter has output vectors on) at their
        layer's tables of vectors, and every other hook at none: a layer whose last such adapter is gone runs no
        extra op. The tables themselves stay (a graph captured earlier may still read them) and serve the next
        adapter with vectors there."""
        changed = False
        for module_name, hook in self.hooks.items():
            if isinstance(hook, ExpertsLoraHook):  # no output vectors on experts
                continue
            vectors = hook.tables.vectors.get(hook.row) if module_name in module_names else None
            if vectors is not hook.vectors:
                hook.vectors = vectors
                changed = True
        if changed:
            self.layout_version += 1

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

    def _output_layer(self) -> nn.Module | None:
        get_output = getattr(self.model, "get_output_embeddings", None)
        return get_output() if callable(get_output) else None


def _names_a_peft_embedding(target_modules) -> bool:
    """Whether ``target_modules`` names a layer PEFT counts as an embedding (``EMBEDDING_LAYER_NAMES``): only then
    does ``ensure_weight_tying`` tie lm_head's LoRA to the embedding's (GPT-2's ``wte`` alone: PEFT warns, and ties
    nothing)."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES  # here: importing peft takes seconds (and bitsandbytes)

    if isinstance(target_modules, str):  # a regular expression, matched whole against the names
        return any(re.fullmatch(target_modules, name) for name in EMBEDDING_LAYER_NAMES)
    return any(str(target).split(".")[-1] in EMBEDDING_LAYER_NAMES for target in target_modules or ())


def _embedding_problem(module: nn.Embedding) -> str | None:
    """Why LoRA on embedding ``module`` cannot be served, or None when it can."""
    forward = type(module).forward
    if forward is not nn.Embedding.forward:
        inputs = [name for name in inspect.signature(forward).parameters if name != "self"]
        if len(inputs) != 1:  # OPT's learned positions take the attention mask: its LoRA needs the ids it makes
            return (f"{type(module).__name__} is called with ({', '.join(inputs)}), not with the ids it looks up "
                    "alone")
    weight = module.weight
    if type(weight) not in (torch.Tensor, nn.Parameter) or not is_plain_float(weight.dtype):
        return f"its weight is a {type(weight).__qualname__} of {weight.dtype} (a quantized or sharded tensor)"
    if module.max_norm is not None:  # PEFT's lookup would renormalise its LoRA factors in place
        return "it has max_norm set"
    try:
        lora_device(module)
    except ValueError as error:
        return str(error)
    return None


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
