"""LoRA on the experts of a mixture-of-experts block: each token's routed experts get its adapter's update.

transformers stores the experts of Qwen3-MoE, Mixtral, OLMoE and others fused: one experts module holds
``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` and is called with the block's tokens ``[T, H]``,
each token's ``top_k_index`` / ``top_k_weights`` ``[T, k]`` (the router's choice). PEFT adapts these weights with
``target_parameters``: for the whole forward, expert ``e``'s weight is ``W_e + s B_e A_e``.

Here each expert of each fused parameter is one row of the adapter tables, as a linear module is
(``formats.expert_entry`` names it), and ``ExpertsLoraHook`` becomes the experts module's forward. While no token
of the forward has an adapter with LoRA on the module, it runs the module's own forward; otherwise it runs the
experts itself, one expert at a time as transformers' eager implementation does, and adds to both projections of
every (token, routed expert) pair the update of that token's adapter for that expert (PyTorch ops, grouped by
adapter slot). The routing is the model's own: the router is not adapted, and it reads hidden states that the
adapter's other LoRA layers already changed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .formats import expert_entry
from .layers import DeviceTables, LoraContext, LoraHook
from .ops import build_segments
from .ops.torch_ops import lora_add

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

    __slots__ = ("module", "replaced_forward", "installed", "tables", "rows", "all_rows", "context", "max_rank",
                 "entries")

    def __init__(
        self, module: nn.Module, rows: dict[str, list[int]], tables: DeviceTables, context: LoraContext, max_rank: int
    ) -> None:
        self.tables = tables
        self.rows = rows
        # On the host: it indexes the tables wherever they are moved to.
        self.all_rows = torch.tensor([row for name in EXPERT_PARAMETERS for row in rows[name]])
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
        module = self.module
        segments = self.context.segments_on(self.tables.device) if self.installed else None
        if segments is None or not self._has_lora_tokens(segments.token_slots):
            forward = self.replaced_forward
            if forward is None:
                return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
            return forward(hidden_states, top_k_index, top_k_weights)
        if hidden_states.shape[0] != segments.num_tokens:
            raise ValueError(
                f"an experts module with LoRA got {hidden_states.shape[0]} tokens but the batch's adapter mapping has "
                f"{segments.num_tokens}; adapter_ids must cover every token of input_ids"
            )
        return self._experts_with_lora(hidden_states, top_k_index, top_k_weights, segments.token_slots)

    def _has_lora_tokens(self, token_slots: torch.Tensor) -> bool:
        """Whether some token's adapter has LoRA on some expert of this module (read on the host)."""
        if self.context.capturing:
            raise ValueError(
                "LoRA on MoE experts reads the routing on the host and cannot run inside a CUDA graph: serve MoE "
                "adapters with EngineConfig(cuda_graphs=False)"
            )
        slot_has_lora = (self.tables.ranks[self.all_rows] > 0).any(dim=0)  # [S]
        in_slot = token_slots >= 0
        return bool((slot_has_lora[token_slots.clamp(min=0).long()] & in_slot).any())

    def _experts_with_lora(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        token_slots: torch.Tensor,
    ) -> torch.Tensor:
        module = self.module
        gate_up_proj, down_proj = module.gate_up_proj, module.down_proj
        num_experts = gate_up_proj.shape[0]
        output = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < num_experts:  # transformers' marker of a token routed to no local expert
                continue
            token_ids, k_positions = torch.where(top_k_index == expert)
            segments = build_segments(token_slots[token_ids], self.tables.num_slots)
            x = hidden_states[token_ids]
            gate_up = nn.functional.linear(x, gate_up_proj[expert])
            self._add_lora(gate_up, x, "gate_up_proj", expert, segments)
            gate, up = gate_up.chunk(2, dim=-1)  # transformers' default gating of concatenated experts
            intermediate = module.act_fn(gate) * up
            expert_out = nn.functional.linear(intermediate, down_proj[expert])
            self._add_lora(expert_out, intermediate, "down_proj", expert, segments)
            expert_out = expert_out * top_k_weights[token_ids, k_positions, None]
            output.index_add_(0, token_ids, expert_out.to(output.dtype))
        return output

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor, parameter: str, expert: int, segments) -> None:
        """``y += B_s,e A_s,e x`` for each token of slot ``s`` (in place; tokens of slots without it unchanged)."""
        tables = self.tables
        a_offsets, b_offsets, ranks = tables.row(self.rows[parameter][expert])
        pool = tables.pool
        if y.dtype == pool.dtype:
            lora_add(y, x.to(pool.dtype), pool, a_offsets, b_offsets, ranks, segments, self.max_rank)
            return
        delta = torch.zeros(y.shape, dtype=pool.dtype, device=y.device)
        lora_add(delta, x.to(pool.dtype), pool, a_offsets, b_offsets, ranks, segments, self.max_rank)
        y += delta.to(y.dtype)
