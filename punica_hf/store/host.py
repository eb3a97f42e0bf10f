"""The host tier: registered adapters' chunks in (pinned) host memory, least recently used dropped past a budget.

A host copy holds, per device the adapter has modules on, the chunk exactly as the device pool stores it (dtype
and layout), so bringing it onto the GPU is one asynchronous copy. Pinned when CUDA is present (an asynchronous
host-to-device copy needs page-locked memory); plain memory otherwise. Past the budget the least recently used
copies are dropped; their adapters are read again from their source when next needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


class HostTier:
    """Host copies by adapter index, within ``budget`` bytes, in least-recently-used order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._copies: OrderedDict[int, dict[torch.device, torch.Tensor]] = OrderedDict()

    @staticmethod
    def allocate(size: int, dtype: torch.dtype) -> torch.Tensor:
        """An empty host buffer of ``size`` elements for a chunk, pinned where CUDA can use that."""
        return torch.empty(size, dtype=dtype, pin_memory=torch.cuda.is_available())

    def get(self, index: int) -> dict[torch.device, torch.Tensor] | None:
        copy = self._copies.get(index)
        if copy is not None:
            self._copies.move_to_end(index)
        return copy

    def put(self, index: int, chunks: dict[torch.device, torch.Tensor], keep: Iterable[int] = ()) -> None:
        """Keep ``chunks`` for ``index``, dropping least recently used copies (except ``keep``) to stay in budget.

        A copy that does not fit even after dropping every other one is not kept (the caller still uses it once).
        """
        size = sum(chunk.numel() * chunk.element_size() for chunk in chunks.values())
        self.drop(index)
        keep = set(keep)
        for victim in [i for i in self._copies if i not in keep]:
            if self.used + size <= self.budget:
                break
            self.drop(victim)
        if self.used + size <= self.budget:
            self._copies[index] = chunks
            self.used += size

    def drop(self, index: int) -> None:
        chunks = self._copies.pop(index, None)
        if chunks is not None:
            self.used -= sum(chunk.numel() * chunk.element_size() for chunk in chunks.values())

    def rekey(self, moved: dict[torch.device, torch.device]) -> None:
        """Copies follow their pools to new devices (the chunks stay on the host)."""
        for index, chunks in self._copies.items():
            self._copies[index] = {moved[device]: chunk for device, chunk in chunks.items()}

    def __contains__(self, index: int) -> bool:
        return index in self._copies
