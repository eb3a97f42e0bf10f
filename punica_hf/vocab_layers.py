"""LoRA on the vocabulary-sized layers: the input embeddings (``embed_tokens``) and the output layer (``lm_head``).

An embedding's LoRA is a linear layer's LoRA on one-hot token ids: PEFT adds ``B (A[:, id])`` (``lora_embedding_A``
``[r, vocab]``, ``lora_embedding_B`` ``[dim, r]``, scaling folded into B as for linear layers) to each token's
embedding. So the adapter store keeps an embedding's factors exactly as a linear module's of ``in = vocab``:
``A`` ``[r, vocab]`` and ``B^T`` ``[r, dim]`` in the pool, one row of the device tables per module.
``EmbeddingLoraHook`` reads them with a gather of ``A``'s columns by token id and one matmul (``embedding_delta``).

The output layer is a plain linear layer for the LoRA ops, but transformers often runs it on a few positions only
(``logits_to_keep``: the last one in ``generate()``, each sequence's last one in the engine's packed batch), so its
tokens are not the forward's. ``OutputLoraHook`` takes the slots of the kept positions, sliced from the forward's
slots the way the model slices its hidden states.

Tied weights (``lm_head.weight is embed_tokens.weight``) change nothing here: the two modules' hooks carry each its
own LoRA, as PEFT's layers do (with ``ensure_weight_tying``, lm_head's LoRA is the embedding's transposed, which the
checkpoint holds under lm_head's name: ``injection`` selects it).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import LoraHook, scale_and_shift
from .ops import LoraSegments, build_segments


def embedding_delta(
    token_ids: torch.Tensor, token_slots: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor,
    b_offsets: torch.Tensor, ranks: torch.Tensor, vocab_size: int, out_features: int, max_rank: int,
) -> torch.Tensor:
    """``[T, out_features]``: ``Bt_s^T A_s[:, id]`` for each token (``token_ids`` ``[T]``) of slot ``s >= 0`` whose
    rank is not 0, zero for the others; the pool's dtype. Tables and pool as ``ops.torch_ops.lora_add`` reads them.

    Fixed shapes and no host reads (capturable in a CUDA graph, traceable by ``torch.compile``), on any backend:
    each token's ``A`` column is gathered into ``[T, max_rank]``, then expanded by ``_expand``.
    """
    slot, in_rank = _slots_and_ranks(token_slots, ranks, max_rank)
    rank_index = torch.arange(max_rank, device=pool.device)
    # A_s[k, id] sits at a_offset + k * vocab + id; masked entries read element 0 and are zeroed (the free parts of
    # the pool hold anything, NaN included, so they are never multiplied in).
    a_index = a_offsets[slot][:, None] + rank_index[None, :] * vocab_size + token_ids.long()[:, None]
    after_a = torch.where(in_rank, pool[torch.where(in_rank, a_index, 0)], 0)
    return _expand(after_a, slot, pool, b_offsets, ranks, out_features, max_rank)


def linear_delta(
    x: torch.Tensor, token_slots: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor,
    ranks: torch.Tensor, out_features: int, max_rank: int,
) -> torch.Tensor:
    """``[T, out_features]``: ``Bt_s^T A_s x[t]`` per token of ``x`` ``[T, in]``, as ``ops.torch_ops.lora_add`` adds it,
    with ``embedding_delta``'s fixed shapes: ``x`` times every slot's ``A`` rows stacked ``[S * max_rank, in]``,
    each token's own slot's block kept, then ``_expand``. For sizes the CUDA kernels do not take."""
    slot, in_rank = _slots_and_ranks(token_slots, ranks, max_rank)
    num_tokens, num_slots = x.shape[0], ranks.shape[0]
    a_rows = _slot_rows(pool, a_offsets, ranks, x.shape[1], max_rank)
    every_slot = (x @ a_rows.view(num_slots * max_rank, x.shape[1]).T).view(num_tokens, num_slots, max_rank)
    after_a = every_slot[torch.arange(num_tokens, device=pool.device), slot]
    return _expand(torch.where(in_rank, after_a, 0), slot, pool, b_offsets, ranks, out_features, max_rank)


def _slots_and_ranks(
    token_slots: torch.Tensor, ranks: torch.Tensor, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's slot (0 for tokens without one) and ``[T, max_rank]``: which of its rank rows count (none for
    tokens without an adapter or whose adapter has rank 0 here)."""
    slots = token_slots.long()
    slot = slots.clamp(min=0)
    token_ranks = torch.where(slots >= 0, ranks.long()[slot], 0)
    return slot, torch.arange(max_rank, device=ranks.device)[None, :] < token_ranks[:, None]


def _slot_rows(
    pool: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, width: int, max_rank: int
) -> torch.Tensor:
    """``[S, max_rank, width]``: rows ``k`` of every slot's ``[rank, width]`` factor at ``offsets``, zero past its
    rank. Row ``k`` starts at ``offset + k * width``: rows of a strided view of the pool, which is not copied."""
    rank_index = torch.arange(max_rank, device=pool.device)
    row_starts = offsets[:, None] + rank_index[None, :] * width
    in_rank = rank_index[None, :] < ranks.long()[:, None]
    rows = pool.unfold(0, width, 1)[torch.where(in_rank, row_starts, 0)]
    return torch.where(in_rank[:, :, None], rows, 0)


def _expand(
    after_a: torch.Tensor, slot: torch.Tensor, pool: torch.Tensor, b_offsets: torch.Tensor, ranks: torch.Tensor,
    out_features: int, max_rank: int,
) -> torch.Tensor:
    """``[T, out]``: each token's ``after_a`` ``[T, max_rank]`` (zero past its rank) times its slot's ``B^T``: written
    into its slot's block of a ``[T, S * max_rank]`` matrix, times every slot's ``B^T`` rows stacked."""
    num_tokens, num_slots = after_a.shape[0], ranks.shape[0]
    wide = after_a.new_zeros(num_tokens, num_slots, max_rank)
    wide[torch.arange(num_tokens, device=pool.device), slot] = after_a
    b_rows = _slot_rows(pool, b_offsets, ranks, out_features, max_rank)
    return wide.view(num_tokens, num_slots * max_rank) @ b_rows.view(num_slots * max_rank, out_features)


def _row_tables(hook: LoraHook) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_offsets, b_offsets, ranks)`` ``[S]`` of the hook's row: indexed inside compiled code (see DeviceTables),
    else the views made once."""
    tables = hook.tables
    if torch.compiler.is_compiling():
        row = hook.row
        return tables.a_offsets[row], tables.b_offsets[row], tables.ranks[row]
    return tables.row(hook.row)


class EmbeddingLoraHook(LoraHook):
    """The LoRA add-on of an ``nn.Embedding``: ``output += Bt_s^T A_s[:, id]`` per token, times the module's
    ``embed_scale`` where it has one (Gemma's scaled embeddings), as PEFT applies it. ``in_features`` is the
    vocabulary size, ``out_features`` the embedding width."""

    __slots__ = ()

    def add_update(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        tables = self.tables
        segments = self.context.segments_on(tables.device)
        if segments is None:
            return output
        token_ids = args[0] if args else None
        if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point():
            raise ValueError(f"a LoRA-targeted {type(module).__name__} got no tensor of token ids")
        rows = segments.num_tokens // max(token_ids.numel(), 1)
        if token_ids.dim() == 2 and token_ids.shape[0] == 1 and rows > 1 and rows * token_ids.numel() == \
                segments.num_tokens:  # ids shared by every row (GPT-2's positions): each row gets its own update
            token_ids = token_ids.expand(rows, -1)
            output = output.expand(rows, *output.shape[1:])
        if token_ids.numel() != segments.num_tokens:
            raise ValueError(
                f"a LoRA embedding got {token_ids.numel()} tokens but the batch's adapter mapping has "
                f"{segments.num_tokens}; adapter_ids must cover every token of input_ids"
            )
        delta = embedding_delta(
            token_ids.reshape(-1).to(tables.device), segments.token_slots, tables.pool, *_row_tables(self),
            self.in_features, self.out_features, self.max_rank,
        )
        embed_scale = _embed_scale(module)
        if embed_scale is not None:
            delta = delta * embed_scale.to(device=delta.device, dtype=delta.dtype)
        return output + delta.to(device=output.device, dtype=output.dtype).view(output.shape)


def _embed_scale(module: nn.Module) -> torch.Tensor | None:
    """The scalar an embedding module multiplies its output by (``embed_scale``), which PEFT applies to the LoRA
    update too; None without one."""
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, (int, float)):
        return torch.tensor(scale)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    return None  # PEFT, too, leaves a non-scalar one out (with a warning)


class OutputLoraHook(LoraHook):
    """The LoRA add-on of the output layer: the tokens it sees are the forward's positions that
    ``logits_to_keep`` keeps (``LoraContext.logits_to_keep``), each with its own slot."""

    __slots__ = ()

    def add_update(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        pool = self.tables.pool
        backend = self.context.backend(pool.device)
        if backend.name == "torch" or backend.takes_unchecked(pool.dtype, self.in_features, self.out_features,
                                                              self.max_rank):
            return super().add_update(module, args, output)
        # Sizes the CUDA kernels do not take (a vocabulary that is no multiple of 8, as GPT-2's 50257): PyTorch ops
        # that read nothing on the host either, so captured graphs and compiled steps keep working.
        segments = self.token_segments(pool.device)
        if segments is None:
            return output
        x = args[0]
        if x.numel() != segments.num_tokens * self.in_features:
            raise ValueError(
                f"the output layer got {x.numel() // self.in_features} tokens but logits_to_keep keeps "
                f"{segments.num_tokens} positions of the batch's adapter mapping"
            )
        x_tokens = x.reshape(-1, self.in_features).to(device=pool.device, dtype=pool.dtype)
        delta = linear_delta(x_tokens, segments.token_slots, pool, *_row_tables(self), self.out_features, self.max_rank)
        output = output + delta.to(device=output.device, dtype=output.dtype).view(output.shape)
        if self.vectors is None:  # no adapter with output vectors (DoRA, LoRA biases) on this layer
            return output
        return scale_and_shift(output, *self.vectors, segments.token_slots)

    def token_segments(self, device: torch.device) -> LoraSegments | None:
        context = self.context
        segments = context.segments_on(device)
        if segments is None or context.batch_shape is None:
            return segments
        if _keeps_all(context.logits_to_keep, context.batch_shape[1]):
            return segments
        kept = context.kept_segments.get(device)
        if kept is None:  # once per forward and device
            slots = _kept_positions(segments.token_slots.view(context.batch_shape), context.logits_to_keep)
            kept = context.kept_segments[device] = build_segments(slots.reshape(-1), segments.num_slots)
        return kept


def _keeps_all(logits_to_keep: int | torch.Tensor, seq_len: int) -> bool:
    """Whether ``logits_to_keep`` keeps every position of ``seq_len`` (a decode step's one token in ``generate()``),
    so the forward's own grouping serves."""
    return isinstance(logits_to_keep, int) and (logits_to_keep == 0 or logits_to_keep >= seq_len)


def _kept_positions(token_slots: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """``token_slots`` ``[B, T]`` at the positions the model keeps for its output layer, as transformers slices the
    hidden states: an int keeps the last ``n``; a 1-D tensor holds positions for every row; a 2-D integer tensor
    positions per row; a 2-D boolean one is a mask (flattened)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return token_slots[logits_to_keep.to(token_slots.device)]
        return torch.take_along_dim(token_slots, logits_to_keep.to(token_slots.device), dim=1)
    if isinstance(logits_to_keep, torch.Tensor):
        return token_slots[:, logits_to_keep.to(token_slots.device)]
    return token_slots[:, -logits_to_keep:]
