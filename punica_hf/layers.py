"""The LoRA add-on of one targeted module, and the per-forward state all of them share.

A targeted ``nn.Linear`` / ``Conv1D`` (or bitsandbytes layer) is not replaced: a ``LoraHook`` becomes its
``forward`` (an instance attribute), calls the forward it replaced and adds ``B_s(A_s x)`` for each token's adapter
slot ``s`` to the output. The module tree, ``state_dict()`` and ``save_pretrained()`` stay exactly the base
model's, accelerate's device hooks keep working, and ``LoraHook.remove()`` gives the module back untouched.

The factors live in the adapter store's pool on the module's device (``DeviceTables``): one flat tensor in which
every resident adapter occupies exactly its own factors, plus per-layer tables of offsets and ranks indexed by
slot. The per-token slot mapping does not come through the module's arguments (transformers hands a projection
its hidden states only): the model wrapper puts each forward's ``LoraSegments`` into the ``LoraContext`` shared by
all hooks, built once per forward and per device.

Projections that share their input (q/k/v, gate/up: a ``ProjectionGroup``) compute their updates together at
decode sizes in compiled code: the first member's hook to run makes one ``lora_delta`` call of the backend for the
whole group, and every member adds its own columns of it (an add that Inductor fuses into the next kernel). Eager calls
on the kernels do not group: there each member's add would be one more launch, and host time is what an eager
step spends, so each projection makes one call that adds into its output in place. An eager forward captured in a
CUDA graph (the serving engine's steps) groups as compiled code does: a replay spends no host time per launch, and
in the engine's decode steps one call for q/k/v plus three adds took less device time than three calls
(benchmarks/README.md).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .ops import KernelConfig, LoraBackend, LoraSegments, build_segments
from .torch_compat import mark_static_address

# Most tokens of a forward whose grouped projections share one lora_delta call (the per-token kernels' range);
# above it (prefill) each projection's own call runs the tiled tensor-core path.
GROUP_MAX_TOKENS = 256


class LoraContext:
    """The LoRA state of a model: its backend per device, and the forward in progress' token grouping (None
    outside such a forward).

    ``kernels``: the kernel paths of the CUDA backend (default ``KernelConfig()``); ``backend``: ``"auto"``,
    ``"torch"`` or ``"cuda"``, default the user's ``PUNICA_HF_BACKEND``, read here once. Both are fixed for the
    context's life, so compiled steps and captured graphs keep what they were made with. ``segments`` is built on
    the device of the input ids; a hook on another device (a model split by ``device_map``) gets a copy made once
    for its device on first use.
    """

    def __init__(self, kernels: KernelConfig | None = None, backend: str | None = None) -> None:
        if kernels is not None and not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels must be a punica_hf.ops.KernelConfig or None, got {type(kernels).__name__}")
        self.kernels = KernelConfig() if kernels is None else kernels
        self.requested_backend = ops.requested_backend(backend)
        self.segments: LoraSegments | None = None
        self.capturing = False  # whether this forward is being captured in a CUDA graph (asked once per forward)
        # Group key -> (the input, its [T, sum of widths] updates, the member that computed them), this forward.
        self.group_deltas: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # The forward's [batch, seq] and transformers' logits_to_keep (the positions that reach the output layer),
        # and the output layer's grouping of those positions by device, made on first use (vocab_layers).
        self.batch_shape: tuple[int, int] | None = None
        self.logits_to_keep: int | torch.Tensor = 0
        self.kept_segments: dict[torch.device, LoraSegments] = {}
        self._on_device: dict[torch.device, LoraSegments] = {}
        self._backends: dict[torch.device, LoraBackend] = {}

    def __getstate__(self) -> dict:
        # A copy decides its backends again where it runs: the kernels may have to be built or loaded there.
        return {**self.__dict__, "_backends": {}}

    def backend(self, device: torch.device) -> LoraBackend:
        """The LoRA backend for ``device``, decided once (eagerly, before any compiled step reads it)."""
        if device not in self._backends:
            self._backends[device] = ops.backend_for(device, self.requested_backend, self.kernels)
        return self._backends[device]

    def build(
        self, token_slots: torch.Tensor, num_slots: int, batch_shape: tuple[int, int] | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> LoraSegments:
        """Group ``token_slots`` ``[T]`` by slot on their device and make it this forward's grouping; ``batch_shape``
        and ``logits_to_keep``: see ``begin``."""
        segments = build_segments(token_slots, num_slots)
        self.begin(segments, batch_shape, logits_to_keep)
        return segments

    def begin(
        self, segments: LoraSegments, batch_shape: tuple[int, int] | None = None, logits_to_keep: int | torch.Tensor = 0
    ) -> None:
        """Start a forward of ``segments``; ``batch_shape`` ``(B, T)`` and the model's ``logits_to_keep`` tell the
        output layer's hook which tokens it gets (None: all of them)."""
        self.segments = segments
        self.batch_shape = batch_shape
        self.logits_to_keep = logits_to_keep
        self.kept_segments = {}
        self.capturing = (
            segments.token_slots.is_cuda and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing()
        )
        self.group_deltas = {}
        self._on_device = {segments.token_slots.device: segments}

    def end(self) -> None:
        self.segments = None
        self.batch_shape = None
        self.logits_to_keep = 0
        self.kept_segments = {}
        self.capturing = False
        self.group_deltas = {}
        self._on_device = {}

    def segments_on(self, device: torch.device) -> LoraSegments | None:
        segments = self.segments
        if segments is None or segments.token_slots.device == device:
            return segments
        if device not in self._on_device:
            self._on_device[device] = segments.to(device)
        return self._on_device[device]


class DeviceTables:
    """One device's adapter pool and the slot tables of the hooks on that device.

    Tensors:
        pool: ``[P]`` the device's adapter pool (the LoRA dtype), every resident adapter's factors in it.
        a_offsets, b_offsets: ``[L, S]`` int64, element offsets of ``A`` ``[r, in]`` and ``B^T`` ``[r, out]`` of
            slot ``s`` in hook-row ``l``'s module.
        ranks: ``[L, S]`` int32, rank of slot ``s`` in row ``l``'s module, 0 when that adapter does not target it.
        vectors: row ``l`` -> ``[scale, shift]``, each ``[S + 1, out]`` or None: the per-output-row vectors of
            DoRA and LoRA biases (``punica_hf.adapter_vectors``), the layer's output becoming ``output * scale[s] +
            shift[s]``. The last row is the base model's (a token without adapter has slot -1): scale 1, shift 0.
            Made for a row only when an adapter that needs it is loaded: plain LoRA runs no op for them.
    ``L`` = rows (one per hooked module on this device, allocated up front for every module that could be hooked),
    ``S`` = slots. An eager forward reads each hook's row through views made once (``row(l)``): no indexing per
    call. A compiled forward indexes the whole tables inside the graph instead, so the graph takes four inputs per
    device rather than three per hook (each input costs host time at every replay).
    """

    def __init__(self, pool: torch.Tensor, num_rows: int, num_slots: int) -> None:
        device = pool.device
        self.pool = pool
        self.a_offsets = torch.zeros(num_rows, num_slots, dtype=torch.int64, device=device)
        self.b_offsets = torch.zeros(num_rows, num_slots, dtype=torch.int64, device=device)
        self.ranks = torch.zeros(num_rows, num_slots, dtype=torch.int32, device=device)
        self.vectors: dict[int, list[torch.Tensor | None]] = {}
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._make_row_views()

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_slots(self) -> int:
        return self.ranks.shape[1]

    @property
    def vector_table_count(self) -> int:
        return sum(table is not None for row_tables in self.vectors.values() for table in row_tables)

    def add_vectors(self, row: int, out_features: int, scale: bool, shift: bool) -> None:
        """Make row ``row``'s scale and / or shift tables if it has none yet (every slot the identity). Hooks apply
        them once pointed at them (``LoraInjection.use_vectors``)."""
        row_tables = self.vectors.setdefault(row, [None, None])
        for index, (wanted, identity) in enumerate(((scale, 1), (shift, 0))):
            if wanted and row_tables[index] is None:
                shape = (self.num_slots + 1, out_features)
                table = torch.full(shape, identity, dtype=self.pool.dtype, device=self.device)
                if table.is_cuda:
                    mark_static_address(table)
                row_tables[index] = table

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(a_offsets [S], b_offsets [S], ranks [S])`` of hook-row ``index``: views, updated in place."""
        return self._rows[index]

    def rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(a_offsets, b_offsets, ranks)`` of rows ``first .. first + count - 1``, each ``[count, S]``: views made
        on first use."""
        key = (first, count)
        if key not in self._blocks:
            end = first + count
            self._blocks[key] = (self.a_offsets[first:end], self.b_offsets[first:end], self.ranks[first:end])
        return self._blocks[key]

    def __getstate__(self) -> dict:
        # The pool is mostly free space (up to gigabytes): its contents travel with the DevicePool that owns it,
        # which knows the parts in use and writes them into the empty pool made here. The row views are made again.
        state = {key: value for key, value in self.__dict__.items() if key not in ("pool", "_rows", "_blocks")}
        return {**state, "empty_pool": (self.pool.numel(), self.pool.dtype, self.pool.device)}

    def __setstate__(self, state: dict) -> None:
        numel, dtype, device = state.pop("empty_pool")
        self.__dict__.update(state)
        self.pool = torch.empty(numel, dtype=dtype, device=device)
        self._make_row_views()

    def apply(self, fn) -> None:
        """Apply an ``nn.Module._apply`` function (``.to()``, ``.cuda()``, ...) to the tensors and remake views."""
        self.pool = fn(self.pool)
        self.a_offsets, self.b_offsets, self.ranks = fn(self.a_offsets), fn(self.b_offsets), fn(self.ranks)
        for row_tables in self.vectors.values():  # in place: hooks hold these lists
            row_tables[:] = [None if table is None else fn(table) for table in row_tables]
        self._make_row_views()

    def _make_row_views(self) -> None:
        self._rows = [(self.a_offsets[i], self.b_offsets[i], self.ranks[i]) for i in range(self.ranks.shape[0])]
        self._blocks = {}
        # CUDA graphs (torch.compile's reduce-overhead, static-cache decode) must read these tensors in place,
        # not copy them into the graph's own inputs at every replay: the pool alone can be gigabytes.
        if self.pool.is_cuda:
            vector_tables = [table for tables in self.vectors.values() for table in tables if table is not None]
            for tensor in (self.pool, self.a_offsets, self.b_offsets, self.ranks, *vector_tables):
                mark_static_address(tensor)


class ProjectionGroup:
    """Sibling projections that take the same input (q/k/v, gate/up), with consecutive rows in ``DeviceTables``.

    ``first_row``: the first member's row; ``out_features``: each member's width, in row order (member ``m`` has
    row ``first_row + m`` and columns ``column_starts[m]:column_starts[m + 1]`` of the group's updates).
    ``shares_input`` turns False for good once two members are seen with different inputs in one forward
    (cross-attention, say): from then on each member computes its own update.
    """

    # No instance __dict__: a compiled forward then guards each object's attributes, not also its dict (host time
    # at every compiled call, for every hook).
    __slots__ = ("key", "first_row", "out_features", "column_starts", "shares_input")

    def __init__(self, key: int, first_row: int, out_features: list[int]) -> None:
        self.key = key
        self.first_row = first_row
        self.out_features = list(out_features)
        self.column_starts = [0]
        for width in out_features:
            self.column_starts.append(self.column_starts[-1] + width)
        self.shares_input = True

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + len(self.out_features))


# Leaf names of sibling projections that read the same input in the architectures transformers ships (Llama,
# Mistral, Qwen, OPT, Gemma, ...: q/k/v and gate/up; BERT-style: query/key/value). A family is only a hint: the
# hooks check at run time that the members do get the same tensor.
SHARED_INPUT_FAMILIES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))


def find_projection_groups(
    linear_modules: dict[str, tuple[int, int, torch.device]], rows: dict[str, int]
) -> dict[str, ProjectionGroup]:
    """Module name -> its group, for siblings of one family with the same input size, device and consecutive rows.

    ``linear_modules``: ``{name: (in_features, out_features, LoRA device)}`` of the hookable modules; ``rows``:
    their table rows. Sizes the kernels cannot take (not multiples of 8) form no group.
    """
    groups: dict[str, ProjectionGroup] = {}
    num_groups = 0
    for parent in sorted({name.rpartition(".")[0] for name in linear_modules}):
        prefix = parent + "." if parent else ""
        for family in SHARED_INPUT_FAMILIES:
            members = sorted((prefix + leaf for leaf in family if prefix + leaf in linear_modules), key=rows.get)
            if len(members) < 2:
                continue
            sizes = [linear_modules[name] for name in members]
            first_row = rows[members[0]]
            if (
                len({(i, device) for i, _, device in sizes}) == 1
                and [rows[name] for name in members] == list(range(first_row, first_row + len(members)))
                and all(i % 8 == 0 and o % 8 == 0 for i, o, _ in sizes)
            ):
                group = ProjectionGroup(num_groups, first_row, [o for _, o, _ in sizes])
                groups.update({name: group for name in members})
                num_groups += 1
    return groups


class LoraHook:
    """The LoRA add-on of one targeted module: ``output += B_s (A_s x)`` with ``s`` the adapter slot of each token.

    Installed as the module's ``forward`` (an instance attribute over the class's method, as accelerate's device
    hooks are): it calls the forward it replaced, then adds the update. Not a forward hook: a module with forward
    hooks takes ``nn.Module.__call__``'s slow path, which cost more host time per call than the whole add-on, 224
    times per eager decode step of an 8B Llama. ``in_features``/``out_features`` are the module's; ``row`` is its
    row in ``tables``. Factors and ``x`` use the LoRA dtype (the module's compute dtype, never a quantized storage
    dtype). Each call runs on the context's backend for the tables' device. The eager path does the least work it
    can: where the backend takes this module's static properties unchecked (``takes_unchecked``), it calls the
    unchecked entries; otherwise the checked ones, which name what the kernels do not take.
    """

    # No instance __dict__ (see ProjectionGroup): fewer guards per hook in a compiled forward.
    __slots__ = ("module", "replaced_forward", "installed", "in_features", "out_features", "tables", "row",
                 "context", "max_rank", "group", "member", "column_start", "vectors")

    def __init__(
        self, module: nn.Module, in_features: int, out_features: int, tables: DeviceTables, row: int,
        context: LoraContext, max_rank: int, group: ProjectionGroup | None = None,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.tables = tables
        self.row = row
        self.context = context
        self.max_rank = max_rank
        self.group = group
        # [scale, shift] tables of this row (``DeviceTables.vectors``) while a registered adapter has output vectors
        # on this layer (``LoraInjection.use_vectors``); None (plain LoRA) costs a compiled forward one guard, not a
        # dict lookup
        self.vectors: list[torch.Tensor | None] | None = None
        if group is not None:
            self.member = row - group.first_row
            self.column_start = group.column_starts[self.member]  # this module's columns of the group's updates
        self.module = module
        self.replaced_forward = module.__dict__.get("forward")  # None: the class's
        self.installed = True
        # Compiled code guards the module's forward attribute: a hook added or removed after a compile recompiles.
        module.forward = self

    def remove(self) -> None:
        """Give the module its forward back; if another wrapper was installed over this one since (it calls this
        one), stay in its chain, passing the output through."""
        if self.module.__dict__.get("forward") is self:
            if self.replaced_forward is None:
                del self.module.forward
            else:
                self.module.forward = self.replaced_forward
        self.installed = False

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = self.replaced_forward
        # The class's function called with the module rather than a bound method kept here (see AdapterForward).
        output = type(module).forward(module, *args, **kwargs) if forward is None else forward(*args, **kwargs)
        if not self.installed:
            return output
        # The input passed by keyword (``q_proj(input=x)``) counts as positional: it is the module's only argument.
        return self.add_update(module, args or tuple(kwargs.values()), output)

    def add_update(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """``output`` of ``module`` for positional ``args``, plus each token's LoRA update, then (DoRA, LoRA biases)
        times each token's output scale plus its shift."""
        segments = self.token_segments(self.tables.device)
        if segments is None:
            return output
        output = self._add_lora(module, args, output, segments)
        if self.vectors is None:  # no adapter with output vectors on this layer: nothing more to do
            return output
        return scale_and_shift(output, *self.vectors, segments.token_slots)

    def _add_lora(
        self, module: nn.Module, args: tuple, output: torch.Tensor, segments: LoraSegments
    ) -> torch.Tensor:
        tables = self.tables
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"a LoRA-targeted {type(module).__name__} got no input tensor")
        if x.numel() != segments.num_tokens * self.in_features:
            raise ValueError(
                f"a LoRA layer got {x.numel() // self.in_features} tokens but the batch's adapter mapping has "
                f"{segments.num_tokens}; adapter_ids must cover every token of input_ids"
            )
        pool = tables.pool
        compiling = torch.compiler.is_compiling()
        backend = self.context.backend(pool.device)
        unchecked = backend.takes_unchecked(pool.dtype, self.in_features, self.out_features, self.max_rank)
        # In place in the module's output, where the dtypes and devices allow (else the module computes in another
        # dtype or on another device: quantized or offloaded bases, and the update is added there).
        in_place = output.dtype == pool.dtype and output.device == pool.device and output.is_contiguous()
        group = self.group
        grouped = group is not None and group.shares_input and segments.num_tokens <= GROUP_MAX_TOKENS
        if (unchecked and in_place and not compiling and not (grouped and self.context.capturing)
                and x.dtype == pool.dtype and x.device == pool.device and x.is_contiguous()):
            # Eager calls cost host time per op: one kernel call that adds into the output, tokens flattened by
            # the binding, and no grouping (whose members would each launch an add of their columns).
            backend.lora_add_unchecked(output, x, pool, *tables.row(self.row), segments, self.max_rank)
            return output
        x_tokens = x.reshape(-1, self.in_features)
        if x_tokens.dtype != pool.dtype or x_tokens.device != pool.device:
            x_tokens = x_tokens.to(device=pool.device, dtype=pool.dtype)
        x_tokens = x_tokens.contiguous()
        if grouped:
            # Compiled code, graph captures and the PyTorch ops: one call for the group, each member's add fused by
            # Inductor into the kernel that reads its output next (one more launch in a captured eager forward).
            delta = self._group_delta(x, x_tokens, segments, backend, unchecked)
            if delta is not None:
                return self._add(output, delta.narrow(1, self.column_start, self.out_features))
        if compiling:
            row = self.row
            a_offsets, b_offsets, ranks = tables.a_offsets[row], tables.b_offsets[row], tables.ranks[row]
        else:
            a_offsets, b_offsets, ranks = tables.row(self.row)
        y_tokens = (
            output.view(-1, self.out_features)  # a view: the kernels add into the output in place
            if in_place
            else torch.zeros(x_tokens.shape[0], self.out_features, dtype=pool.dtype, device=pool.device)
        )
        add = backend.lora_add_unchecked if unchecked else backend.lora_add
        add(y_tokens, x_tokens, pool, a_offsets, b_offsets, ranks, segments, self.max_rank)
        if in_place:
            return output
        return output + y_tokens.to(device=output.device, dtype=output.dtype).view(output.shape)

    def token_segments(self, device: torch.device) -> LoraSegments | None:
        """The grouping of the tokens this module gets, on ``device``: the forward's (None outside a forward)."""
        return self.context.segments_on(device)

    def _group_delta(self, x: torch.Tensor, x_tokens: torch.Tensor, segments: LoraSegments, backend: LoraBackend,
                     unchecked: bool) -> torch.Tensor | None:
        """The updates of this hook's whole group for input ``x`` (``[T, sum of widths]``): made by the first member
        to run and kept in the context for the others; None once the members turn out to take different inputs.
        ``unchecked``: the backend takes this module unchecked (a group's members share sizes and dtype)."""
        group = self.group
        deltas = self.context.group_deltas
        pending = deltas.get(group.key)
        if pending is not None:
            pending_x, delta, computed_by = pending
            if pending_x is x:
                return delta
            if computed_by != self.member:  # a sibling ran on another input in this forward: not a shared input
                group.shares_input = False
                return None
        tables = self.tables
        if torch.compiler.is_compiling():
            rows = group.rows
            a_offsets, b_offsets, ranks = tables.a_offsets[rows], tables.b_offsets[rows], tables.ranks[rows]
        else:
            a_offsets, b_offsets, ranks = tables.rows(group.first_row, len(group.out_features))
        compute = backend.lora_delta_unchecked if unchecked else backend.lora_delta
        delta = compute(x_tokens, tables.pool, a_offsets, b_offsets, ranks, segments, self.max_rank,
                        group.out_features)
        deltas[group.key] = (x, delta, self.member)
        return delta

    def _add(self, output: torch.Tensor, delta_tokens: torch.Tensor) -> torch.Tensor:
        """``output`` plus this module's ``[T, out]`` update (a column slice of its group's updates)."""
        if delta_tokens.dtype == output.dtype and delta_tokens.device == output.device and output.is_contiguous():
            # Added in the output's own shape ([B, T, out]), which Inductor fuses into the next kernel. Added to the
            # GEMM's 2-D result instead, it becomes addmm, which copies the update into the GEMM's output first: one
            # copy kernel per member (96 per Llama-3-8B decode step).
            output.add_(delta_tokens.view(output.shape))
            return output
        return output + delta_tokens.to(device=output.device, dtype=output.dtype).view(output.shape)


def scale_and_shift(
    output: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, token_slots: torch.Tensor
) -> torch.Tensor:
    """``output * scale[slot] + shift[slot]`` per token (tables ``[S + 1, out]``, slot -1 reading the last row)."""
    tokens = output.reshape(-1, output.shape[-1])
    slots = token_slots.long()
    if scale is not None:
        tokens = tokens * scale[slots].to(device=output.device, dtype=output.dtype)
    if shift is not None:
        tokens = tokens + shift[slots].to(device=output.device, dtype=output.dtype)
    return tokens.view(output.shape)
