"""LoRA on the experts of a mixture-of-experts block: each token's routed experts get its adapter's update.

transformers stores the experts of Qwen3-MoE, Mixtral, OLMoE and others fused: one experts module holds
``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` and is called with the block's tokens ``[T, H]``,
each token's ``top_k_index`` / ``top_k_weights`` ``[T, k]`` (the router's choice). PEFT adapts these weights with
``target_parameters``: for the whole forward, expert ``e``'s weight is ``W_e + s B_e A_e``.

Here each expert of each fused parameter is one row of the adapter tables, as a linear module is
(``formats.expert_entry`` names it), and ``ExpertsLoraHook`` becomes the experts module's forward. While no token
of the forward has an adapter with LoRA on the module, it runs the module's own forward; otherwise it runs the
experts itself: the (token, routed expert) pairs sorted by expert, each expert's base matmuls on its run of pairs
(as transformers' eager implementation loops over experts), and each projection's LoRA update for all pairs in one
call of the LoRA backend, a pair's slot being its (expert, adapter) couple. The routing is the model's own: the
router is not adapted, and it reads hidden states that the adapter's other LoRA layers already changed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import ops
from .formats import expert_entry
from .layers import DeviceTables, LoraContext, LoraHook
from .ops import build_segments

# The fused parameters of a gated experts module, in the order the forward uses them.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ExpertEntry(NamedTuple):
    """One expert of one fused parameter: the experts module's name, the parameter's name, the expert's index."""

    module: str
    parameter: str
    expert: int


def expert_entries(model: nn.Module) -> dict[str, ExpertEntry]:
    """``expert_entry`` name -> ``ExpertEntry`` for every expert of every 3-D parameter of ``model``, in model
    order (the order of their table rows)."""
    entries = {}
    for module_name, module in model.named_modules():
        for parameter, tensor in module.named_parameters(recurse=False):
            if tensor.dim() == 3:
                key = f"{module_name}.{parameter}"
                for expert in range(tensor.shape[0]):
                    entries[expert_entry(key, expert)] = ExpertEntry(module_name, parameter, expert)
    return entries


def experts_problem(module: nn.Module) -> str | None:
    """Why punica_hf cannot serve LoRA on ``module``'s experts, or None when it can."""
    weights = [getattr(module, name, None) for name in EXPERT_PARAMETERS]
    if not all(isinstance(weight, nn.Parameter) and weight.dim() == 3 for weight in weights):
        return "not a fused experts module with 3-D gate_up_proj and down_proj (transformers' Qwen3-MoE layout)"
    # The layouts transformers' use_experts_implementation declares; only its default one is served.
    unsupported = {
        "is_transposed": "stores its experts transposed ([E, in, out])",
        "has_bias": "has expert biases",
        "has_post_expert_norm": "normalises after each expert",
    }
    for flag, problem in unsupported.items():
        if getattr(module, flag, False):
            return problem
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return "does not keep gate and up concatenated in gate_up_proj"
    gate_up, down = weights
    if any(type(w) is not nn.Parameter or w.dtype not in _FLOAT_DTYPES for w in weights):
        return "its expert weights are quantized or sharded"
    if gate_up.device != down.device or gate_up.device.type == "meta":
        return "its expert weights are offloaded or on two devices"
    if gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not [E, 2I, H] and [E, H, I]"
    return None


class ExpertsLoraHook:
    """The LoRA add-on of one fused experts module, installed as its ``forward`` (as ``LoraHook`` is).

    ``rows``: for each of ``EXPERT_PARAMETERS``, the table row of each expert. ``entries``: the expert entries
    that asked for this hook (``LoraInjection`` removes it with the last).
    """

    __slots__ = ("module", "replaced_forward", "installed", "tables", "rows", "row_index", "all_rows", "context",
                 "max_rank", "entries")

    def __init__(
        self, module: nn.Module, rows: dict[str, list[int]], tables: DeviceTables, context: LoraContext, max_rank: int
    ) -> None:
        self.tables = tables
        self.rows = rows
        # Table rows as index tensors, kept where the tables are (``_indices``): a host index would be copied to
        # the device at every use, twice per projection and layer.
        self.row_index = {name: torch.tensor(rows[name]) for name in EXPERT_PARAMETERS}
        self.all_rows = torch.cat([self.row_index[name] for name in EXPERT_PARAMETERS])
        self.context = context
        self.max_rank = max_rank
        self.entries: set[str] = set()
        self.module = module
        self.replaced_forward = module.__dict__.get("forward")  # None: the class's
        self.installed = True
        module.forward = self

    # Installed and removed as a LoraHook is: the same three attributes
    remove = LoraHook.remove

    # Compiled forwards run the experts eagerly (a graph break): the routing is read on the host.
    @torch.compiler.disable
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        segments = self.context.segments_on(self.tables.device) if self.installed else None
        if segments is not None:
            if self.context.capturing:
                raise ValueError(
                    "LoRA on MoE experts reads the routing on the host and cannot run inside a CUDA graph: serve MoE "
                    "adapters with EngineConfig(cuda_graphs=False)"
                )
            output = self._experts_with_lora(hidden_states, top_k_index, top_k_weights, segments.token_slots)
            if output is not None:
                return output
        forward = self.replaced_forward
        if forward is None:
            return type(self.module).forward(self.module, hidden_states, top_k_index, top_k_weights)
        return forward(hidden_states, top_k_index, top_k_weights)

    def _indices(self) -> None:
        """Move the row indices to the tables' device, where they are used (the tables may have moved since)."""
        device = self.tables.ranks.device
        if self.all_rows.device != device:
            self.row_index = {name: rows.to(device) for name, rows in self.row_index.items()}
            self.all_rows = self.all_rows.to(device)

    def _experts_with_lora(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        token_slots: torch.Tensor,
    ) -> torch.Tensor | None:
        """The experts' output ``[T, H]`` with every (token, routed expert) pair's LoRA update on both projections;
        None when no token's adapter has LoRA on this module's experts (the module's own forward serves them).

        The pairs are sorted by expert, so each expert's base matmuls take one contiguous run. The run lengths and
        whether LoRA is needed at all come to the host in one read: the forward's one sync here. The LoRA updates
        of all pairs are one ``lora_add`` per projection: a pair's "slot" is (expert, adapter slot), numbered
        ``expert * S + slot``, and its factors' offsets are the tables' rows of that expert, so the kernels group
        the pairs by expert and adapter at once.
        """
        self._indices()
        slot_has_lora = (self.tables.ranks[self.all_rows] > 0).any(dim=0)  # [S]
        needs_lora = (slot_has_lora[token_slots.clamp(min=0).long()] & (token_slots >= 0)).any()
        module = self.module
        gate_up_proj, down_proj = module.gate_up_proj, module.down_proj
        num_experts, top_k = gate_up_proj.shape[0], top_k_index.shape[1]
        experts = top_k_index.reshape(-1).long()
        # transformers marks a token routed to no local expert with an index outside [0, E): those pairs sort last
        expert_key = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
        expert_key, order = torch.sort(expert_key, stable=True)
        counts = torch.bincount(expert_key, minlength=num_experts + 1)[:num_experts]
        needed, *run_lengths = torch.cat([needs_lora.view(1).long(), counts]).tolist()
        if not needed:
            return None
        if hidden_states.shape[0] != token_slots.shape[0]:
            raise ValueError(
                f"an experts module with LoRA got {hidden_states.shape[0]} tokens but the batch's adapter mapping has "
                f"{token_slots.shape[0]}; adapter_ids must cover every token of input_ids"
            )
        pairs = sum(run_lengths)
        output = torch.zeros_like(hidden_states)
        if not pairs:
            return output
        expert_key, order = expert_key[:pairs], order[:pairs]
        pair_tokens = order // top_k
        x = hidden_states[pair_tokens]
        pair_slots = token_slots[pair_tokens].long()
        num_slots = self.tables.num_slots
        segments = build_segments(torch.where(pair_slots >= 0, expert_key * num_slots + pair_slots, -1),
                                  num_experts * num_slots)
        gate_up = self._per_expert(x, gate_up_proj, run_lengths)
        self._add_lora(gate_up, x, "gate_up_proj", segments)
        gate, up = gate_up.chunk(2, dim=-1)  # transformers' default gating of concatenated experts
        intermediate = module.act_fn(gate) * up
        expert_out = self._per_expert(intermediate, down_proj, run_lengths)
        self._add_lora(expert_out, intermediate, "down_proj", segments)
        expert_out = expert_out * top_k_weights.reshape(-1)[order, None]
        output.index_add_(0, pair_tokens, expert_out.to(output.dtype))
        return output

    @staticmethod
    def _per_expert(x: torch.Tensor, weight: torch.Tensor, run_lengths: list[int]) -> torch.Tensor:
        """``x`` ``[P, in]`` (pairs sorted by expert, ``run_lengths[e]`` of expert ``e``) times each pair's expert
        of ``weight`` ``[E, out, in]``: ``[P, out]``. (No ``out=`` into one buffer: autograd refuses it, and a forward
        with gradients on runs here too.)"""
        runs = x.split(run_lengths)
        return torch.cat([nn.functional.linear(run, weight[expert]) for expert, run in enumerate(runs) if len(run)])

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor, parameter: str, segments) -> None:
        """``y += B_s,e A_s,e x`` for each pair of expert ``e`` and adapter slot ``s`` (``segments`` numbers them
        ``e * S + s``), in place; pairs without an adapter, or whose adapter leaves the expert, unchanged."""
        tables = self.tables
        rows = self.row_index[parameter]
        a_offsets, b_offsets, ranks = (table[rows].reshape(-1) for table in (tables.a_offsets, tables.b_offsets,
                                                                              tables.ranks))
        pool = tables.pool
        backend = self.context.backend(pool.device)
        if not backend.takes_unchecked(pool.dtype, x.shape[1], y.shape[1], self.max_rank):
            backend = ops.backend_for(pool.device, "torch")
        x = x.to(pool.dtype).contiguous()
        if y.dtype == pool.dtype:
            backend.lora_add(y, x, pool, a_offsets, b_offsets, ranks, segments, self.max_rank)
            return
        delta = torch.zeros(y.shape, dtype=pool.dtype, device=y.device)
        backend.lora_add(delta, x, pool, a_offsets, b_offsets, ranks, segments, self.max_rank)
        y += delta.to(y.dtype)
