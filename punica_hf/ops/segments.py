"""Per-forward grouping of tokens by adapter slot.

Built once per forward pass from the per-token slot mapping and shared by every LoRA layer, so no layer
repeats the sort. Everything is computed on the device with fixed output sizes: no host-device
synchronisation, so building it inside a CUDA graph or a ``torch.compile``d forward is fine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Slots with at most this many tokens in a forward are served by the per-token kernels even where the tiled ones
# run (T above their threshold): a tiled block makes one pass per slot among its 64 positions, so a tile of a mixed
# prefill + decode step's decode tokens (one or a few per adapter) would cost a pass per token.
SHORT_RUN_TOKENS = 16
# Most tokens one per-token kernel block serves: kChunk of csrc/chunks.cuh (a test reads it there). A chunk starts
# where the slot changes and at every multiple of it.
CHUNK_TOKENS = 4
# Up to this many tokens a call never takes the tiled path, so its short runs' chunk list is never read:
# kPerTokenMaxTokens of csrc/lora_add.cu (a test reads it there).
PER_TOKEN_MAX_TOKENS = 256


@dataclass(frozen=True)
class LoraSegments:
    """Tokens of one forward grouped by adapter slot (``T`` = tokens in the forward, ``S`` = adapter slots).

    Attributes:
        token_slots: ``[T]`` int32, the slot of each token; -1 = no adapter (base model only).
        sorted_token_ids: ``[T]`` int32, token indices ordered by slot (stable); tokens without adapter come last.
        sorted_slots: ``[T]`` int32, the slot of each sorted position (``token_slots[sorted_token_ids]``, -1 =
            none): the CUDA kernels find a position's adapter with one load instead of a chain of two.
        long_run_slots, short_run_slots: ``[T]`` int32, ``sorted_slots`` split by the size of each position's
            slot run: above ``SHORT_RUN_TOKENS`` tokens in the first, the others in the second, -1 elsewhere.
        short_run_chunk_starts: ``[T]`` int32, the positions where the per-token kernels' chunks of
            ``short_run_slots`` start, in increasing order, then ``T`` to the end: the per-token half of a tiled call
            walks it instead of launching a block for every position. All ``T`` (an empty list) up to
            ``PER_TOKEN_MAX_TOKENS`` tokens, where no call is tiled: one fill instead of the list's dozen ops.
        num_slots: ``S``.
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    sorted_slots: torch.Tensor
    long_run_slots: torch.Tensor
    short_run_slots: torch.Tensor
    short_run_chunk_starts: torch.Tensor
    num_slots: int

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def to(self, device: torch.device) -> LoraSegments:
        """The same grouping with every tensor on ``device`` (for a model split over devices)."""
        return LoraSegments(
            token_slots=self.token_slots.to(device),
            sorted_token_ids=self.sorted_token_ids.to(device),
            sorted_slots=self.sorted_slots.to(device),
            long_run_slots=self.long_run_slots.to(device),
            short_run_slots=self.short_run_slots.to(device),
            short_run_chunk_starts=self.short_run_chunk_starts.to(device),
            num_slots=self.num_slots,
        )


def build_segments(token_slots: torch.Tensor, num_slots: int) -> LoraSegments:
    """Group tokens by slot. ``token_slots``: ``[T]`` integer, values in ``[-1, num_slots)``; not checked here."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D, got shape {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.int64)
    # Tokens without an adapter get the key num_slots, so a stable sort puts them last.
    sort_key = torch.where(slots < 0, num_slots, slots)
    sorted_keys, sorted_token_ids = torch.sort(sort_key, stable=True)
    tokens_per_key = torch.zeros(num_slots + 1, dtype=torch.int64, device=token_slots.device)
    tokens_per_key.scatter_add_(0, sort_key, torch.ones_like(sort_key))
    sorted_slots = torch.where(sorted_keys < num_slots, sorted_keys, -1).to(torch.int32)
    long_run = tokens_per_key[sorted_keys] > SHORT_RUN_TOKENS
    short_run_slots = torch.where(long_run, -1, sorted_slots)
    return LoraSegments(
        token_slots=slots.to(torch.int32),
        sorted_token_ids=sorted_token_ids.to(torch.int32),
        sorted_slots=sorted_slots,
        long_run_slots=torch.where(long_run, sorted_slots, -1),
        short_run_slots=short_run_slots,
        short_run_chunk_starts=_chunk_starts(short_run_slots) if slots.shape[0] > PER_TOKEN_MAX_TOKENS
        else torch.full_like(short_run_slots, slots.shape[0]),
        num_slots=num_slots,
    )


def _chunk_starts(sorted_slots: torch.Tensor) -> torch.Tensor:
    """The positions where chunks start (slot >= 0, and a slot change or a multiple of ``CHUNK_TOKENS``), in
    increasing order, then ``T``: a fixed-size list (no sync), the other positions sorted last with key ``T``."""
    count = sorted_slots.shape[0]
    positions = torch.arange(count, dtype=torch.int32, device=sorted_slots.device)
    previous = torch.where(positions == 0, -2, sorted_slots.roll(1))
    starts = (sorted_slots >= 0) & ((positions % CHUNK_TOKENS == 0) | (sorted_slots != previous))
    return torch.where(starts, positions, count).sort().values
