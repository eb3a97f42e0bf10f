"""``MultiLoraModel``: a drop-in wrapper that gives every row (or token) of a batch its own LoRA adapter.

The wrapped model's ``forward`` gains an ``adapter_ids`` keyword (an ``AdapterForward`` installed on the instance,
with the original signature plus that keyword), so ``generate()`` accepts it as a model kwarg, expands it for beams
and ``num_return_sequences`` and hands it to every step. That keyword takes device *slots*; the wrapper's own
``forward`` / ``generate`` take names or adapter indices, hold the adapters with a lease for the whole call (resident,
and not unloaded under it) and pass their slots in. Each forward groups the tokens by slot once (``LoraSegments``)
and shares the grouping with every LoRA hook through the ``LoraContext``.

The wrapper composes two parts that do not know each other: the adapter store (``punica_hf.store``: registration,
device pools, host tier, leases) and the model surgery (``punica_hf.injection``: which modules get a hook, installing
and removing hooks, projection groups). The store reaches the hooks only through the ``ModuleHooks`` it is given.

Threads: every eager forward runs under the store's lock, so concurrent calls interleave whole forward steps, each
with its own mapping; generate() calls that keep a cache on the model (static caches) run one at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .formats import AdapterWeights, load_adapter_weights
from .injection import LoraInjection
from .layers import LoraContext
from .norm_layers import NormHook, fuse_norms
from .ops import KernelConfig
from .store import CAPACITY_WAIT_S, AdapterLease, AdapterStore, check_wait
from .tensor_parallel import refuse_gradients
from .torch_compat import FollowsModuleMoves

AdapterIds = torch.Tensor | Sequence[str | int | None]


class MultiLoraModel(FollowsModuleMoves):
    """Wraps a causal LM in place so that each row (or token) of a batch can use a different LoRA adapter.

    Args:
        model: a transformers model (``AutoModelForCausalLM.from_pretrained(...)``); its weights are never copied.
        max_adapters: device slots: how many adapters can be resident on a device at once, so the most distinct
            adapters one batch may use. Any number can be registered.
        max_rank: the largest LoRA rank a loaded adapter may have in any module.
        gpu_pool_bytes: bytes of each device's adapter pool (factors of resident adapters, proportional to rank).
            Default: room for ``max_adapters`` adapters of ``max_rank`` on every linear layer, at most 20% of the
            device memory free when the first adapter is loaded (at most 1 GiB on the CPU).
        host_pool_bytes: budget of the host tier (pinned memory) holding adapters off the device; past it, adapters
            are read again from their files when needed. Default: a quarter of the memory available when the model
            is wrapped (``MemAvailable``), at least 1 GiB and at most 64 GiB; ``adapter_stats["host_bytes_budget"]``
            says what it is.
        capacity_wait_s: how long a call (``forward``, ``generate``, ``acquire``) waits for device room that other
            calls hold (slots or pool bytes) before it raises ``AdapterCapacityError``. Default 60 s. A call whose
            adapters could not fit even alone fails at once.
        kernels: the CUDA kernels' paths (``punica_hf.ops.KernelConfig``), fixed for the model's life.
        backend: the LoRA ops, ``"auto"``, ``"cuda"`` or ``"torch"``; default ``$PUNICA_HF_BACKEND``, else ``"auto"``.

    ``state_dict()`` and ``load_state_dict()`` are the wrapped model's: its keys, no LoRA state. ``named_parameters()``,
    ``named_buffers()``, ``named_modules()`` and ``get_submodule()`` use the same names (``model.layers.0...`` for a
    Llama, not ``model.model.layers.0...``); the attribute ``model`` is still the wrapped model, so code that walks
    attributes by those names (``torch.func.functional_call``) takes ``wrapper.model``. Copies
    (``copy.deepcopy``, pickle, ``torch.save``) carry the registered adapters, not the memory set aside for more.
    """

    def __init__(
        self,
        model: nn.Module,
        max_adapters: int = 64,
        max_rank: int = 64,
        *,
        gpu_pool_bytes: int | None = None,
        host_pool_bytes: int | None = None,
        capacity_wait_s: float = CAPACITY_WAIT_S,
        kernels: KernelConfig | None = None, backend: str | None = None,
    ) -> None:
        super().__init__()
        for arg, value in (("max_adapters", max_adapters), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive integer, got {value!r}")
        for arg, value in (("gpu_pool_bytes", gpu_pool_bytes), ("host_pool_bytes", host_pool_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{arg} must be a number of bytes (int >= 0) or None, got {value!r}")
        capacity_wait_s = check_wait("capacity_wait_s", capacity_wait_s)
        if isinstance(model, MultiLoraModel) or isinstance(getattr(model, "forward", None), AdapterForward):
            raise ValueError("this model is already wrapped by a MultiLoraModel")
        self.model = model
        context = LoraContext(kernels, backend)
        self._injection = LoraInjection(model, context, max_rank)
        self._store = AdapterStore(
            self._injection, max_adapters, max_rank, gpu_pool_bytes, host_pool_bytes, capacity_wait_s
        )
        model.forward = AdapterForward(model, context, self._store, self._injection.tensor_parallel)
        # Within a parent module's load_state_dict, this one's keys are the wrapped model's (see state_dict).
        self.register_load_state_dict_pre_hook(_keys_of_the_wrapped_model)

    # ----------------------------------------------------------------------------------------------- adapters
    @property
    def adapters(self) -> dict[str, int]:
        """Registered adapters, ``{name: index}``; the index is what ``adapter_ids`` tensors hold."""
        return self._store.indices

    def adapter_registration(self, name: str) -> int:
        """Which load of the adapter ``name`` is registered now: a number no other load in this process gets (a
        lease's ``registrations`` say the same of what it holds), so a caller that waited can tell that the adapter
        was unloaded and another loaded under its name meanwhile. ``KeyError`` for a name not registered."""
        return self._store.registration(name)

    @property
    def max_adapters(self) -> int:
        return self._store.max_adapters

    @property
    def max_rank(self) -> int:
        return self._store.max_rank

    @property
    def tensor_parallel(self) -> bool:
        """Whether the wrapped model has layers split over ranks by transformers' tensor parallelism."""
        return self._injection.tensor_parallel

    @property
    def graphable(self) -> bool:
        """Whether a forward can be captured in a CUDA graph: not while an adapter on MoE experts is loaded (its
        update reads each token's routing on the host)."""
        return not self._injection.experts_hooks

    def decide_backends(self) -> None:
        """Decide the LoRA ops (the CUDA kernels found or built, else the PyTorch ops) of every device with LoRA
        layers, where not decided yet. Loading adapters does it, but a copy of the model decides again where it runs:
        call this before a ``torch.compile`` of a copy that no eager forward with adapters precedes, since finding
        the kernels cannot be traced (a graph break at every layer). The serving engine calls it at its start."""
        self._injection.decide_backends(self._store.pools)

    def fuse_norms(self) -> list[NormHook]:
        """Run the base model's RMSNorm modules as one kernel each (``punica_hf.norm_layers``), unless the model's
        ``KernelConfig.fused_norms`` is off or its backend is ``"torch"``; only on CUDA devices where the kernels
        build. Returns the hooks made: ``remove()`` each to give the modules their forward back. The serving engine
        calls it at its start, before any step is captured or compiled, and removes them when it shuts down."""
        context = self._injection.context
        if not context.kernels.fused_norms or context.requested_backend == "torch":
            return []
        return fuse_norms(self.model)

    @property
    def layout_version(self) -> int:
        """Bumped whenever a LoRA hook or a device pool is added (or a hook removed): CUDA graphs captured before
        then run another set of hooks and must be captured again."""
        return self._injection.layout_version

    @property
    def adapter_stats(self) -> dict[str, int]:
        """Counters and memory: registered, resident, hits, host_loads, disk_loads, evictions, bytes_to_gpu,
        gpu_bytes_used/total, host_bytes_used/budget, and factor_bytes: the registered adapters' LoRA factors
        ``r * (in + out)`` as this process holds them, beside factor_bytes_unsplit: the same on the whole layers.

        They differ only under tensor parallelism over ``tp`` ranks, where a rank holds of each module's factors
        ``r * (in + out / tp)`` on a column-split layer (q, k, v, gate, up: B's rows of its output slice) and
        ``r * (in / tp + out)`` on a row-split one (o, down: A's columns of its input slice)."""
        return self._store.stats()

    def load_adapters(
        self,
        sources: Mapping[str, str | Path | AdapterWeights],
        *,
        revision: str | None = None,
        subfolder: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
    ) -> dict[str, int]:
        """Register adapters by name from local PEFT folders, converted files or Hub repo ids; all or none.

        Returns ``{name: index}`` for the adapters of this call. ``revision``, ``subfolder``, ``token`` and
        ``cache_dir`` apply to every source (``subfolder`` to local folders too). A source is read again when its
        adapter's host copy was dropped (past ``host_pool_bytes``): ``AdapterWeights`` are kept by reference, not
        copied, so leave their tensors unchanged while the adapter is loaded (a re-read that finds other shapes, or
        NaN or Inf values, is refused by name).
        """
        if not isinstance(sources, Mapping):
            raise ValueError("load_adapters takes a mapping {name: path or Hub repo id}")
        self._store.check_wrapped()  # before reading any file (the store checks again under its lock)
        hub = dict(revision=revision, subfolder=subfolder, token=token, cache_dir=cache_dir)
        hub = {key: value for key, value in hub.items() if value is not None}
        loaded = {}
        for name, source in sources.items():
            if isinstance(source, AdapterWeights):
                loaded[name] = (source, source, {})
            else:
                loaded[name] = (load_adapter_weights(source, **hub), source, hub)
            _check_alora(name, loaded[name][0], self.model)
        return self._store.add(loaded)

    def unload_adapter(self, name: str) -> None:
        """Unregister an adapter. Calls already using it finish with it; its memory is freed after them."""
        self._store.remove(name)

    def prefetch(self, adapters: Iterable[str | int] | str) -> None:
        """Start bringing registered adapters (a name, or a list of names or indices) onto the device in the
        background, ahead of a batch that needs them."""
        self._store.prefetch(adapters)

    def acquire(
        self, adapters: Sequence[str | int | None] | str, *, block: bool = True, timeout: float | None = None,
        registrations: Sequence[int | None] | None = None,
    ) -> AdapterLease:
        """Hold adapters (a name, or a list of names, indices or None) resident and registered until
        ``lease.release()``, the end of a ``with lease:`` block, or the lease's garbage collection; ``lease.slots``
        are their device slots for the inner model's ``adapter_ids`` (for schedulers that call ``model.model``
        themselves).

        Waits up to ``timeout`` seconds (default ``capacity_wait_s``) for device room that other leases hold;
        ``block=False`` never waits: it raises ``AdapterCapacityError`` at once, ``AdapterNotReady`` while an
        adapter is still being read (its read has started), and ``AdapterReadError`` once when that read failed.
        ``registrations`` (one per entry, None for any; see ``adapter_registration``): ``KeyError`` for an entry that
        another load holds the name of now, before anything is placed.
        """
        return self._store.acquire(adapters, block=block, timeout=timeout, registrations=registrations)

    def unwrap(self) -> nn.Module:
        """Remove every LoRA hook and the ``adapter_ids`` forward; returns the base model, exactly as it was.

        From then on this wrapper only passes calls without ``adapter_ids`` through: every call that would use
        adapters (``adapter_ids``, ``load_adapters``, ``acquire``, ...) raises ``RuntimeError``. Refused with a
        ``RuntimeError`` (nothing changes) while a running call holds adapters (a lease: a ``generate()`` in
        another thread, an engine's requests)."""
        with self._store.lock:
            self._store.unwrap()
            self._injection.detach_all()
            installed = self.model.__dict__.get("forward")
            if isinstance(installed, AdapterForward):
                if installed.original is None:
                    del self.model.forward
                else:
                    self.model.forward = installed.original
            return self.model

    # ----------------------------------------------------------------------------------------------- running
    def forward(self, *args: Any, adapter_ids: AdapterIds | None = None, **kwargs: Any):
        """The wrapped model's forward; ``adapter_ids`` per row ``[B]`` or per token ``[B, T]`` (-1/None = base).

        An aLoRA adapter given per row applies, as in PEFT, from the start of the last occurrence of its invocation
        tokens in the row's ``input_ids`` on (the row runs as the base model where they are absent); given per
        token, each token's entry is taken as it is. Waits for device room that other calls hold (see
        ``capacity_wait_s``)."""
        entries, shape = self._adapter_entries(adapter_ids, _batch_shape(args, kwargs))
        if entries is None:
            return self.model(*args, **kwargs)
        if self._injection.tensor_parallel:
            refuse_gradients()  # before any adapter is placed (the inner model's forward checks too, for direct calls)
        with self._store.acquire(entries) as lease:
            slots = self._slot_tensor(lease, shape)
            return self.model(*args, adapter_ids=slots, **self._with_alora_offsets(lease, shape, args, kwargs))

    @torch.no_grad()
    def generate(self, *args: Any, adapter_ids: AdapterIds | None = None, **kwargs: Any):
        """The wrapped model's ``generate``; ``adapter_ids`` has one entry per input row (-1/None = base).

        An aLoRA adapter applies, as in PEFT, from the start of the last occurrence of its invocation tokens in the
        row's prompt on, and to every generated token; where the prompt lacks them, the row runs as the base
        model throughout."""
        entries, shape = self._adapter_entries(adapter_ids, _batch_shape(args, kwargs))
        if entries is not None and len(shape) != 1:
            raise ValueError(f"generate() takes one adapter per row, got adapter_ids of shape {tuple(shape)}")
        if entries is not None and kwargs.get("assistant_model") is not None:
            raise ValueError(
                "generate(assistant_model=...) with adapter_ids is not supported: the draft model would propose "
                "tokens without the adapters. Use prompt_lookup_num_tokens= for speculative decoding instead."
            )
        # A static cache lives on the model between calls: two such calls at once would share it.
        keeps_cache = _keeps_cache_on_model(self.model, kwargs)
        cache_lock = self._store.cache_generate_lock if keeps_cache else nullcontext()
        # The adapters first, then the cache: a call holding the cache lock never waits for device room that a
        # call queued behind that lock holds.
        lease = nullcontext() if entries is None else self._store.acquire(entries)
        with lease, cache_lock:
            if entries is None:
                return self.model.generate(*args, **kwargs)
            kwargs = self._with_alora_offsets(lease, shape, args, kwargs)
            if "alora_offsets" in kwargs and _generation_setting(self.model, kwargs, "prompt_lookup_num_tokens"):
                # a step then checks several drafted tokens, whose positions past the prompt PEFT's offsets miss
                raise ValueError("generate(prompt_lookup_num_tokens=...) is not supported with aLoRA adapters")
            return self.model.generate(*args, adapter_ids=self._slot_tensor(lease, shape), **kwargs)

    def _adapter_entries(
        self, adapter_ids: AdapterIds | None, batch_shape: tuple[int, ...] | None
    ) -> tuple[list | None, tuple[int, ...]]:
        """Validate ``adapter_ids`` on the host: ``(flat entries: names / indices / None, shape)``."""
        if adapter_ids is None:
            return None, ()
        self._store.check_wrapped()
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
        for entry in entries:
            self._store.lookup(entry)  # KeyError / ValueError before anything runs
        return entries, shape

    def _with_alora_offsets(self, lease: AdapterLease, shape: tuple[int, ...], args: tuple, kwargs: dict) -> dict:
        """``kwargs`` plus ``alora_offsets`` (see ``AdapterForward``) when a row of per-row ``adapter_ids`` holds an
        aLoRA adapter: PEFT's offsets, each row's length from its adapter's first position (``alora_start``) on."""
        if len(shape) != 1 or all(tokens is None for tokens in lease.invocation_tokens):
            return kwargs
        input_ids = _token_ids(args, kwargs)
        if input_ids is None:
            raise ValueError("aLoRA adapters need input_ids: their invocation tokens are looked for in each row")
        offsets = []
        for invocation_tokens, row in zip(lease.invocation_tokens, input_ids.tolist()):
            start = alora_start(invocation_tokens, row)
            offsets.append(0 if start is None else len(row) - start)
        return {**kwargs, "alora_offsets": torch.tensor(offsets, device=input_ids.device)}

    def _slot_tensor(self, lease: AdapterLease, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(lease.slots, dtype=torch.int32).reshape(shape).to(self.model.device)

    def before_module_moves(self, fn) -> None:
        """A ``.half()`` (or ``.to(dtype)``) into a dtype that cannot hold a loaded adapter's values is refused
        before anything moves."""
        self._store.check_cast(fn)

    def after_module_moved(self, fn) -> None:
        """``.to()`` / ``.cuda()`` / ``.half()`` moved the model: the adapter pools follow it."""
        self._store.apply(fn)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict: its keys (no ``model.`` prefix), no LoRA state."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load a state dict of the wrapped model (as ``state_dict()`` gives it) into it; adapters stay as they are.

        Refused, with nothing loaded, where it would change the weight or bias of a layer on which a loaded adapter
        has output vectors (DoRA, LoRA biases): those were computed from the layer's weight and bias at load, and
        would no longer be PEFT's. Unload such adapters first and load them again after. (The same holds for a
        parent module's ``load_state_dict``.)"""
        self._refuse_changes_under_vectors(state_dict, prefix="")
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _refuse_changes_under_vectors(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """ValueError where ``state_dict`` (the wrapped model's keys after ``prefix``) changes a weight or bias that
        a loaded adapter's output vectors were computed from."""
        changed = {}
        for module_name, adapters in self._store.output_vector_users().items():
            module = self.model.get_submodule(module_name)
            for kind in ("weight", "bias"):
                current, given = getattr(module, kind, None), state_dict.get(f"{prefix}{module_name}.{kind}")
                if _differs(current, given):
                    changed[f"{module_name}.{kind}"] = adapters
        if changed:
            raise ValueError(
                "this state dict changes base weights that loaded adapters' output vectors (DoRA, LoRA biases) were "
                f"computed from: {', '.join(f'{key} (adapters {sorted(set(names))})' for key, names in changed.items())}"
                "; unload those adapters, load the state dict, then load them again"
            )

    # Names: the wrapped model's, as in state_dict(), so that whatever pairs names with tensors (optimizers' param
    # groups by name, checkpoint and sharding tools, accelerate) sees one set of keys. The wrapper holds no
    # parameter or buffer of its own; its module tree (children(), .to(), train()) is unchanged.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's parameters under its names (the keys of ``state_dict()``)."""
        return self.model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's buffers under its names (the keys of ``state_dict()``)."""
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        """This wrapper, then the wrapped model's modules under its names (the wrapped model itself under the same
        prefix as the wrapper), so a parent module's ``named_parameters()`` agrees with its ``state_dict()`` too."""
        if memo is None:
            memo = set()
        if not remove_duplicate or self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        yield from self.model.named_modules(memo, prefix, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The module a name of ``named_modules()`` names (so ``get_parameter`` / ``get_buffer`` take the names of
        ``named_parameters()`` / ``named_buffers()``); "" is this wrapper."""
        return self if target == "" else self.model.get_submodule(target)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)


class AdapterForward:
    """The wrapped model's ``forward`` with an ``adapter_ids`` keyword of device slots (``[B]`` or ``[B, T]``).

    With per-row slots, an ``alora_offsets`` keyword ``[B]`` (PEFT's aLoRA offsets) limits each row's adapter to
    the row's last ``alora_offsets[i]`` positions of every forward: the prompt from the invocation on at the
    prefill, the one new token at each decoding step; 0 runs the row as the base model.

    A plain object rather than a closure, so ``copy.deepcopy`` and pickle copy the model it calls; its
    ``__signature__`` is the original forward's plus ``adapter_ids``, which is what ``generate()`` checks kwargs
    against. Eager calls take the store's lock for the whole forward; under ``torch.compile`` the lock is left out
    of the traced code (a compiled call runs as a unit).
    """

    def __init__(
        self, model: nn.Module, context: LoraContext, store: AdapterStore, tensor_parallel: bool = False
    ) -> None:
        self.model = model
        self.context = context
        self.store = store
        self.tensor_parallel = tensor_parallel  # adapters on split layers: inference only
        self.num_slots = store.max_adapters
        # A forward already patched on the instance (accelerate's device hooks) is kept and called.
        self.original = model.__dict__.get("forward")
        original = inspect.signature(self.original or type(model).forward)
        parameters = [p for p in original.parameters.values() if p.name != "self"]
        position = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
        for name in ("adapter_ids", "alora_offsets"):
            parameters.insert(position, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None))
            position += 1
        self.__signature__ = original.replace(parameters=parameters)

    def __call__(self, *args: Any, adapter_ids: torch.Tensor | None = None,
                 alora_offsets: torch.Tensor | None = None, **kwargs: Any):
        if alora_offsets is not None and (adapter_ids is None or adapter_ids.dim() != 1):
            raise ValueError("alora_offsets needs adapter_ids with one slot per row")
        if torch.compiler.is_compiling():
            return self._run(args, adapter_ids, alora_offsets, kwargs)
        if adapter_ids is not None:
            self.context.backend(adapter_ids.device)  # decided here, outside any traced region
        with self.store.lock:
            return self._run(args, adapter_ids, alora_offsets, kwargs)

    def _forward(self, *args: Any, **kwargs: Any):
        if self.original is not None:
            return self.original(*args, **kwargs)
        # The class's function called with the model, not a bound method made here: Dynamo may not trace
        # ``function.__get__``, and a graph break at the top of every compiled call costs host time.
        return type(self.model).forward(self.model, *args, **kwargs)

    def _run(self, args: tuple, adapter_ids: torch.Tensor | None, alora_offsets: torch.Tensor | None, kwargs: dict):
        if adapter_ids is None:
            return self._forward(*args, **kwargs)
        batch_shape = _batch_shape(args, kwargs)
        if batch_shape is None:
            raise ValueError("adapter_ids needs input_ids or inputs_embeds of shape [batch, seq, ...]")
        if self.tensor_parallel:
            refuse_gradients()
        if alora_offsets is not None:  # PEFT's rule: a row's last min(offset, T) positions get its adapter
            length = batch_shape[1]
            positions = torch.arange(length, device=adapter_ids.device)
            active = positions[None, :] >= length - alora_offsets.to(adapter_ids.device).clamp(max=length)[:, None]
            token_slots = torch.where(active, adapter_ids[:, None], -1).reshape(-1)
        elif adapter_ids.dim() == 1:
            token_slots = adapter_ids[:, None].expand(batch_shape).reshape(-1)
        else:
            token_slots = adapter_ids.reshape(-1)
        self.context.build(token_slots, self.num_slots, batch_shape, kwargs.get("logits_to_keep", 0))
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.context.end()


def _keys_of_the_wrapped_model(wrapper: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook for a wrapper inside another module: the parent's state dict holds the wrapper's
    entries under the wrapped model's keys, as ``state_dict()`` gives them; the wrapper's submodule ``model`` looks
    for them under ``model.``, so they are renamed so. Weights under loaded adapters' output vectors are refused
    first, as the wrapper's own ``load_state_dict`` refuses them (nothing of the wrapped model loaded)."""
    wrapper._refuse_changes_under_vectors(state_dict, prefix)
    for key in [key for key in state_dict if key.startswith(prefix)]:
        state_dict[f"{prefix}model.{key[len(prefix):]}"] = state_dict.pop(key)


def _differs(current: Any, given: Any) -> bool:
    """Whether loading tensor ``given`` into ``current`` would change it (as ``copy_`` does: cast to its dtype)."""
    if not isinstance(current, torch.Tensor) or not isinstance(given, torch.Tensor):
        return False  # nothing loaded there, or nothing to compare
    if given.shape != current.shape:
        return True
    return not torch.equal(given.detach().to(current.device, current.dtype), current.detach())


def _keeps_cache_on_model(model: nn.Module, kwargs: dict) -> bool:
    """Whether generate() with ``kwargs`` keeps its cache on the model (static-style caches)."""
    return _generation_setting(model, kwargs, "cache_implementation") not in (None, "dynamic")


def _generation_setting(model: nn.Module, kwargs: dict, name: str) -> Any:
    """A setting of generate() with ``kwargs``: the keyword, else the generation config given or the model's."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return kwargs.get(name, getattr(config, name, None))


def _batch_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """``(batch, seq)`` of the call's token input, None when it has none we recognise."""
    for value in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return tuple(value.shape[:2])
    return None


def alora_start(invocation_tokens: Sequence[int] | None, token_ids: Sequence[int]) -> int | None:
    """The first position of a row of ``token_ids`` its adapter applies to: 0 for plain LoRA (``invocation_tokens``
    None); for aLoRA, PEFT's rule: where the last occurrence of the invocation tokens starts, None where they do not
    occur (the row then runs as the base model, its generated tokens too)."""
    if invocation_tokens is None:
        return 0
    wanted = list(invocation_tokens)
    for start in range(len(token_ids) - len(wanted), -1, -1):
        if list(token_ids[start : start + len(wanted)]) == wanted:
            return start
    return None


def _token_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The call's ``input_ids`` ``[batch, seq]``, None when it has none (``inputs_embeds`` only)."""
    for value in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs")):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            return value
    return None


def _check_alora(name: str, weights: AdapterWeights, model: nn.Module) -> None:
    """ValueError for an aLoRA adapter whose invocation holds a token id the model's vocabulary lacks (no input
    could ever hold it: the adapter would silently never apply); with DoRA, which PEFT refuses (it has no such
    variant); with biases of its own for the base layers (``bias="lora_only"`` / ``"all"``), which PEFT loads into
    the base model, so they change the positions before the invocation too, which serving runs as the base model;
    or with LoRA on an embedding layer, which PEFT refuses (its aLoRA masks the positions of linear layers only)."""
    invocation_tokens = weights.config.alora_invocation_tokens
    if invocation_tokens is None:
        return
    refused = {
        "magnitude": "DoRA is not supported (PEFT refuses it)",
        "base_bias": "biases of its own for the base layers (bias='lora_only' or 'all') are not supported (PEFT "
                     "loads them into the base layers: they would change the positions before the invocation too)",
    }
    for vector, problem in refused.items():
        modules = sorted(module for module, factors in weights.modules.items() if getattr(factors, vector) is not None)
        if modules:
            raise ValueError(f"adapter {name!r}: aLoRA with {problem}: {modules[:3]}")
    vocab_size = getattr(getattr(model, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
    if vocab_size is not None and max(invocation_tokens) >= vocab_size:
        raise ValueError(
            f"adapter {name!r}: its alora_invocation_tokens {list(invocation_tokens)} hold token ids beyond the "
            f"model's vocabulary of {vocab_size} tokens (another tokenizer's ids?)"
        )
    modules = dict(model.named_modules())
    embeddings = sorted(m for m in weights.modules if isinstance(modules.get(m), nn.Embedding))
    if embeddings:
        raise ValueError(
            f"adapter {name!r}: aLoRA on embedding layers is not supported (PEFT refuses it): {embeddings}"
        )
