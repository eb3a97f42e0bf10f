"""Tensor parallelism: which linear layers of a model transformers split over ranks, how, and this rank's share.

A model loaded with transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or a
``DistributedConfig``, in every process of a ``torchrun`` group) has DTensor weights on its split layers, and each
such layer's ``forward`` is replaced by its parallel style's wrapper: inputs made local, the layer's own forward on
the local weight shard, outputs made whole again. LoRA is placed so that it needs no collective of its own:

- column-split (style ``"colwise"``: q, k, v, gate, up): the layer gets the whole input and gives this rank's
  slice of the output features. LoRA keeps A whole and B's rows of that slice.
- row-split (style ``"rowwise"``: o, down): the layer gets this rank's slice of the input features and gives a
  partial sum that the wrapper all-reduces (then adds the bias). LoRA keeps A's columns of that slice and B whole,
  and adds its update to the partial sum *before* the all-reduce, which then sums the ranks' LoRA parts too.

So a LoRA hook must run inside the wrapper: ``take_wrapper_off`` leaves the layer its own forward, the hook installs
itself over it, then ``wrap`` has the layer's style (transformers' public ``ALL_PARALLEL_STYLES``) install a wrapper
around the hook. The wrapper taken off is kept and put back when the hook goes, so ``unwrap()`` returns the layers
exactly as they were.

Other styles (packed projections, outputs gathered across ranks as on ``lm_head``, embeddings, MoE experts) are
refused with the reason (``LinearSplit.problem``). Split layers run their local path only without gradients, so a
forward with adapters under tensor parallelism is inference only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .formats import ModuleLora

COLUMN = "colwise"
ROW = "rowwise"

# Why LoRA is refused on a layer of each other kind of style, by the style name's prefix.
_REFUSED_STYLES = (
    ("packed_", "a packed layer (one weight holding several projections, each split on its own)"),
    ("colwise_", "its output is gathered across ranks (as on lm_head)"),
    ("embedding", "an embedding"),
    ("moe", "MoE experts"),
    ("grouped_gemm", "MoE experts"),
    ("ep_", "MoE experts"),
    ("megamoe", "MoE experts"),
)


@dataclass(frozen=True)
class LinearSplit:
    """How one layer with a DTensor weight is split over the ranks, and this rank's share of it.

    ``style``: its style in the model's TP plan (None when no plan entry names it); ``problem``: why LoRA cannot be
    served on it, None when it can. ``in_slice`` / ``out_slice``: this rank's input / output features (the whole
    range on the side that is not split); ``mesh``: the device mesh its weight is split over.
    """

    style: str | None
    problem: str | None
    in_slice: slice
    out_slice: slice
    mesh: Any

    @property
    def in_features(self) -> int:
        return self.in_slice.stop - self.in_slice.start

    @property
    def out_features(self) -> int:
        return self.out_slice.stop - self.out_slice.start

    def widest_features(self, global_in: int, global_out: int) -> tuple[int, int]:
        """``(in, out)`` of the widest rank's share (the first rank's: ``_share`` gives the first parts the most)."""
        parts = self.mesh.size()
        if self.style == COLUMN:
            return global_in, _length(_share(global_out, parts, 0))
        return _length(_share(global_in, parts, 0)), global_out

    def shard(self, module_name: str, factors: ModuleLora, global_in: int, global_out: int) -> ModuleLora:
        """This rank's share of one module's LoRA factors (see the module docstring); ValueError naming the module
        when the factors do not fit the unsplit layer."""
        if factors.lora_a.shape[1] != global_in or factors.lora_b.shape[0] != global_out:
            raise ValueError(
                f"it does not fit the base model: module {module_name} takes lora_A [r, {global_in}] and lora_B "
                f"[{global_out}, r], the adapter has {list(factors.lora_a.shape)} and {list(factors.lora_b.shape)}"
            )
        if self.style == COLUMN:
            return ModuleLora(factors.lora_a, factors.lora_b[self.out_slice].contiguous())
        return ModuleLora(factors.lora_a[:, self.in_slice].contiguous(), factors.lora_b)


def find_splits(model: nn.Module) -> dict[str, LinearSplit]:
    """Every module of ``model`` whose weight is a DTensor, by name: empty for a model without tensor parallelism."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch built without distributed support has no split layers
        return {}
    plan = getattr(model, "tp_plan", None) or {}
    splits = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, DTensor):
            continue
        style = _plan_style(plan, name)
        out_features, in_features = weight.shape[0], weight.shape[-1]
        in_slice, out_slice = slice(0, in_features), slice(0, out_features)
        problem = _style_problem(style)
        if problem is None and not isinstance(module, nn.Linear):
            problem = f"a {type(module).__name__}, not an nn.Linear"
        if problem is None and "forward" not in module.__dict__:
            problem = "its weight is split but no tensor-parallel forward is installed on it"
        if problem is None:
            mesh = weight.device_mesh
            split_dim = 0 if style == COLUMN else 1
            if weight.placements != (Shard(split_dim),):
                problem = f"its weight is placed {weight.placements}, not split on dimension {split_dim}"
            else:
                share = _share(weight.shape[split_dim], mesh.size(), mesh.get_local_rank())
                if share.stop - share.start != weight.to_local().shape[split_dim]:
                    problem = "its weight is split unevenly in a way this rank's shard does not show"
                elif style == COLUMN:
                    out_slice = share
                else:
                    in_slice = share
        splits[name] = LinearSplit(style, problem, in_slice, out_slice, weight.device_mesh)
    return splits


def take_wrapper_off(module: nn.Module) -> Callable:
    """Leave a split layer its own forward; returns the tensor-parallel wrapper taken off (``module.forward = it``
    puts it back)."""
    tp_forward = module.__dict__["forward"]
    del module.forward
    return tp_forward


def wrap(module: nn.Module, split: LinearSplit) -> None:
    """Install a wrapper of the layer's style around its forward as it is now (a LoRA hook)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    ALL_PARALLEL_STYLES[split.style].install_forward(module, split.mesh)


def _plan_style(plan: dict[str, str], module_name: str) -> str | None:
    """The style the TP plan gives ``module_name``; plan keys stand for every layer number with ``*``."""
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module_name):
            return style
    return None


def _style_problem(style: str | None) -> str | None:
    if style in (COLUMN, ROW):
        return None
    if style is None:
        return "its weight is split but the model's tensor-parallel plan names no style for it"
    for prefix, problem in _REFUSED_STYLES:
        if style.startswith(prefix):
            return f"{problem} (tensor-parallel style {style!r})"
    return f"its tensor-parallel style {style!r} is not one LoRA is served on ({COLUMN!r} and {ROW!r} are)"


def _share(size: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``size`` features split in ``parts`` as torch's ``Shard`` placement splits them (as
    ``torch.chunk`` does: ``ceil(size / parts)`` each, the last parts shorter or empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return slice(start, min(start + step, size))


def _length(part: slice) -> int:
    return part.stop - part.start


def refuse_gradients() -> None:
    """Raise ValueError when gradients are on: split layers run their local path, where LoRA sits, only without."""
    if torch.is_grad_enabled():
        raise ValueError(
            "a forward with adapters on a tensor-parallel model is inference only: run it under torch.no_grad() or "
            "torch.inference_mode() (with gradients on, transformers runs its split layers on DTensors)"
        )
