"""``MultiLoraModel``: a drop-in wrapper that gives every row of a batch its own LoRA adapter.

The wrapped model's ``forward`` gains an ``adapter_ids`` argument (installed on the instance, with the
original signature plus that keyword). ``generate()`` accepts it as a model kwarg and so expands it for beams
and ``num_return_sequences`` and hands it to every step; each forward turns it into the per-token slot
mapping, groups it once (``LoraSegments``) and shares it with all LoRA layers through a ``LoraContext``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import ops
from .adapters import AdapterStore
from .layers import LoraContext
from .formats import AdapterWeights, load_adapter_weights

AdapterIds = torch.Tensor | Sequence[str | int | None]


class MultiLoraModel(nn.Module):
    """Wraps a causal LM in place so that each row (or token) of a batch can use a different LoRA adapter.

    Args:
        model: a transformers model (``AutoModelForCausalLM.from_pretrained(...)``); its weights are never copied.
        max_adapters: adapter slots, i.e. how many adapters can be loaded at once.
        max_rank: the largest LoRA rank a loaded adapter may have in any module.
    """

    def __init__(self, model: nn.Module, max_adapters: int = 8, max_rank: int = 64) -> None:
        super().__init__()
        for arg, value in (("max_adapters", max_adapters), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive integer, got {value!r}")
        if isinstance(model, MultiLoraModel) or getattr(model, "_punica_hf_context", None) is not None:
            raise ValueError("this model is already wrapped by a MultiLoraModel")
        self.model = model
        context = LoraContext()
        model._punica_hf_context = context
        self._store = AdapterStore(model, max_adapters, max_rank, context)
        _install_adapter_forward(model, context, max_adapters)

    # ----------------------------------------------------------------- adapters
    @property
    def adapters(self) -> dict[str, int]:
        """Loaded adapters, ``{name: index}``; the index is what ``adapter_ids`` tensors hold."""
        return dict(self._store.slots)

    @property
    def max_adapters(self) -> int:
        return self._store.max_adapters

    @property
    def max_rank(self) -> int:
        return self._store.max_rank

    def load_adapters(
        self,
        sources: Mapping[str, str | Path | AdapterWeights],
        *,
        revision: str | None = None,
        subfolder: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
    ) -> dict[str, int]:
        """Load adapters by name from local PEFT folders or Hub repo ids; all or none.

        Returns ``{name: index}`` for the adapters of this call. ``revision``, ``subfolder``, ``token`` and
        ``cache_dir`` apply to every source (``subfolder`` to local folders too).
        """
        if not isinstance(sources, Mapping):
            raise ValueError("load_adapters takes a mapping {name: path or Hub repo id}")
        loaded = {
            name: source
            if isinstance(source, AdapterWeights)
            else load_adapter_weights(source, revision=revision, subfolder=subfolder, token=token, cache_dir=cache_dir)
            for name, source in sources.items()
        }
        return self._store.add(loaded)

    def unload_adapter(self, name: str) -> None:
        """Free an adapter's slot; its index may be reused by a later load."""
        self._store.remove(name)

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any, adapter_ids: AdapterIds | None = None, **kwargs: Any):
        """The wrapped model's forward; ``adapter_ids`` per row ``[B]`` or per token ``[B, T]`` (-1/None = base)."""
        slots = self._slot_tensor(adapter_ids, _batch_shape(args, kwargs))
        return self.model(*args, adapter_ids=slots, **kwargs)

    @torch.no_grad()
    def generate(self, *args: Any, adapter_ids: AdapterIds | None = None, **kwargs: Any):
        """The wrapped model's ``generate``; ``adapter_ids`` has one entry per input row (-1/None = base)."""
        slots = self._slot_tensor(adapter_ids, _batch_shape(args, kwargs))
        if slots is not None and slots.dim() != 1:
            raise ValueError(f"generate() takes one adapter per row, got adapter_ids of shape {tuple(slots.shape)}")
        return self.model.generate(*args, adapter_ids=slots, **kwargs)

    def _slot_tensor(self, adapter_ids: AdapterIds | None, batch_shape: tuple[int, ...] | None) -> torch.Tensor | None:
        """Validate ``adapter_ids`` on the host and return slot indices on the model's device."""
        if adapter_ids is None:
            return None
        if isinstance(adapter_ids, torch.Tensor):
            if adapter_ids.is_floating_point() or adapter_ids.is_complex() or adapter_ids.dtype == torch.bool:
                raise ValueError(f"adapter_ids must be an integer tensor, got {adapter_ids.dtype}")
            if adapter_ids.dim() not in (1, 2):
                raise ValueError(f"adapter_ids must be [batch] or [batch, seq], got shape {tuple(adapter_ids.shape)}")
            shape = tuple(adapter_ids.shape)
            entries = adapter_ids.reshape(-1).tolist()
        elif isinstance(adapter_ids, Sequence) and not isinstance(adapter_ids, str):
            entries = list(adapter_ids)
            shape = (len(entries),)
        else:
            raise ValueError(f"adapter_ids must be a tensor or a list of names/indices, got {type(adapter_ids).__name__}")
        if batch_shape is not None and shape != batch_shape[: len(shape)]:
            raise ValueError(
                f"adapter_ids has shape {list(shape)} but the batch has {batch_shape[0]} rows"
                + (f" of {batch_shape[1]} tokens" if len(shape) == 2 else "")
            )
        slots = [self._store.slot_of(entry) for entry in entries]
        return torch.tensor(slots, dtype=torch.int32, device=self.model.device).reshape(shape)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)


def _batch_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """``(batch, seq)`` of the call's token input, None when it has none we recognise."""
    for value in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return tuple(value.shape[:2])
    return None


def _install_adapter_forward(model: nn.Module, context: LoraContext, num_slots: int) -> None:
    """Give ``model.forward`` an ``adapter_ids`` keyword that sets the LoRA context for that forward only."""
    original_forward = model.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, adapter_ids: torch.Tensor | None = None, **kwargs: Any):
        if adapter_ids is None:
            return original_forward(*args, **kwargs)
        batch_shape = _batch_shape(args, kwargs)
        if batch_shape is None:
            raise ValueError("adapter_ids needs input_ids or inputs_embeds of shape [batch, seq, ...]")
        if adapter_ids.dim() == 1:
            token_slots = adapter_ids[:, None].expand(batch_shape).reshape(-1)
        else:
            token_slots = adapter_ids.reshape(-1)
        context.segments = ops.build_segments(token_slots, num_slots)
        try:
            return original_forward(*args, **kwargs)
        finally:
            context.segments = None

    parameters = list(inspect.signature(original_forward).parameters.values())
    adapter_parameter = inspect.Parameter("adapter_ids", inspect.Parameter.KEYWORD_ONLY, default=None)
    position = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    parameters.insert(position, adapter_parameter)
    forward.__signature__ = inspect.signature(original_forward).replace(parameters=parameters)
    model.forward = forward
