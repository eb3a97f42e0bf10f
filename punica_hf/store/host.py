"""The host tier: registered adapters' chunks in pinned host memory, least recently used dropped past a budget.

A host copy holds, per device the adapter has modules on, the chunk exactly as the device pool stores it (dtype
and layout), so bringing it onto the GPU is one asynchronous copy. Copies are carved from pinned segments of
``SEGMENT_BYTES`` with the same first-fit allocator as the device pools: page-locking memory is slow (it grows with
the bytes locked) and CUDA's pinned allocator rounds each block up to a power of two, so one call per segment,
reused for every adapter after, keeps loads fast and the budget exact. Plain memory without CUDA. Past the
budget the least recently used copies are dropped; their adapters are read again from their source when needed.

A copy of the tier (``copy.deepcopy``, pickle) carries the kept copies' bytes only, not the segments' free space, and
carves them into segments of its own.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .pool import ExtentAllocator

SEGMENT_BYTES = 1 << 30
# Default budget: a share of the memory available when the model is wrapped, so the tier leaves the process and its
# neighbours room on a small machine and holds many adapters on a large one; at least one segment's worth (a tier
# smaller than an adapter serves nothing), and capped where re-reading a file is cheap next to pinning more.
HOST_BUDGET_SHARE = 0.25
HOST_BUDGET_MIN = 1 << 30
HOST_BUDGET_MAX = 64 << 30
_ALIGN_BYTES = 256


@dataclass(eq=False)
class HostCopy:
    """One adapter's chunks on the host: ``chunks[device]`` ``[size]`` in that device pool's dtype and layout.

    ``extents`` are its places in the tier's segments (empty for a copy made outside the tier, freed with it);
    ``in_flight`` the events of copies to a device that may still read it.
    """

    chunks: dict[torch.device, torch.Tensor]
    extents: list[tuple[int, int, int]] = field(default_factory=list)  # (segment, start byte, bytes)
    in_flight: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self.chunks.values())

    @property
    def tier_bytes(self) -> int:
        """What its extents take in the tier's segments (aligned sizes; 0 for a copy outside the tier)."""
        return sum(size for _, _, size in self.extents)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "in_flight": []}


class HostTier:
    """Host copies by adapter index, within ``budget`` bytes, in least-recently-used order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._segments: list[tuple[torch.Tensor, ExtentAllocator]] = []  # uint8 [SEGMENT_BYTES] each
        self._copies: OrderedDict[int, HostCopy] = OrderedDict()

    def __getstate__(self) -> dict:
        copies = [
            (index, {device: chunk.clone() for device, chunk in copy.chunks.items()})  # clones: not whole segments
            for index, copy in self._copies.items()
        ]
        return {"budget": self.budget, "copies": copies}

    def __setstate__(self, state: dict) -> None:
        self.budget = state["budget"]
        self._segments = []
        self._copies = OrderedDict()
        for index, chunks in state["copies"]:  # least recently used first, as they were kept
            copy = self.allocate({device: (chunk.numel(), chunk.dtype) for device, chunk in chunks.items()})
            for device, chunk in chunks.items():
                copy.chunks[device].copy_(chunk)
            self.put(index, copy)  # (a copy that no longer fits the budget is dropped, as past it anyway)

    @property
    def used(self) -> int:
        """Bytes of the segments given to copies (kept or in use)."""
        return sum(allocator.used for _, allocator in self._segments)

    def allocate(self, sizes: dict[torch.device, tuple[int, torch.dtype]], keep: Iterable[int] = ()) -> HostCopy:
        """Room for one adapter's chunks (``{device: (elements, dtype)}``), dropping least recently used copies
        outside ``keep`` to stay in budget. Past the budget, a copy outside the tier (used once, then freed)."""
        needs = {device: _round_up(count * torch.empty(0, dtype=dtype).element_size()) for device, (count, dtype) in
                 sizes.items()}
        keep = set(keep)
        for index in self._drops_for(list(needs.values()), [index for index in self._copies if index not in keep]):
            self.drop(index)
        extents = self._carve(list(needs.values()))
        if extents is None:  # no room in the budget: a plain pinned buffer, not counted, not kept
            pin = torch.cuda.is_available()
            return HostCopy({d: torch.empty(n, dtype=dt, pin_memory=pin) for d, (n, dt) in sizes.items()})
        chunks = {}
        for (device, (count, dtype)), (segment, start, _) in zip(sizes.items(), extents):
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            chunks[device] = self._segments[segment][0][start : start + nbytes].view(dtype)
        return HostCopy(chunks, extents)

    def _drops_for(self, sizes: list[int], victims: list[int]) -> list[int]:
        """The fewest of ``victims`` (least recently used first) whose dropping lets ``sizes`` be carved, tried on
        copies of the segments' allocators; none where dropping them all would not do (free bytes may suffice
        while no free extent is long enough: dropping copies then only loses them)."""
        def freed(allocators: list[ExtentAllocator], dropped: list[int]) -> list[ExtentAllocator]:
            for index in dropped:
                for segment, start, size in self._copies[index].extents:
                    allocators[segment].free(start, size)
            return allocators

        if not self._carvable(sizes, freed([allocator.copy() for _, allocator in self._segments], victims)):
            return []  # one trial where it can never fit (a copy kept outside the tier at every read)
        allocators = [allocator.copy() for _, allocator in self._segments]
        for count in range(len(victims) + 1):
            if self._carvable(sizes, [allocator.copy() for allocator in freed(allocators, victims[count - 1:count])]):
                return victims[:count]
        return victims

    def _carvable(self, sizes: list[int], allocators: list[ExtentAllocator]) -> bool:
        """Whether ``sizes`` could be carved with the segments' allocators in the state of ``allocators`` (which
        the trial changes)."""
        return self._place(sizes, allocators) is not None

    def _place(self, sizes: list[int], allocators: list[ExtentAllocator]) -> list[tuple[int, int, int]] | None:
        """Extents ``(allocator number, start, size)`` for ``sizes``, first fit over ``allocators`` in order, then
        in new ones appended to the list while the budget allows; None (what was taken freed) where they do not
        fit. Shared by the trials on copies and the carve itself, so the two cannot disagree."""
        extents, capacity = [], sum(allocator.capacity for allocator in allocators)
        for size in sizes:
            place = next(((number, start) for number, allocator in enumerate(allocators)
                          if (start := allocator.allocate(size)) is not None), None)
            if place is None and self.budget - capacity >= size:  # a new segment, within the budget
                allocators.append(ExtentAllocator(max(size, min(SEGMENT_BYTES, self.budget - capacity))))
                capacity += allocators[-1].capacity
                place = (len(allocators) - 1, allocators[-1].allocate(size))
            if place is None:
                for number, start, taken in extents:
                    allocators[number].free(start, taken)
                return None
            extents.append((*place, size))
        return extents

    def _carve(self, sizes: list[int]) -> list[tuple[int, int, int]] | None:
        """Places for ``sizes`` bytes in the segments (new segments while the budget allows), or None."""
        allocators = [allocator for _, allocator in self._segments]
        extents = self._place(sizes, allocators)
        if extents is not None:
            for allocator in allocators[len(self._segments):]:  # the new segments the places lie in
                buffer = torch.empty(allocator.capacity, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                self._segments.append((buffer, allocator))
        return extents

    def get(self, index: int) -> HostCopy | None:
        """The copy kept for ``index``, marked used now."""
        self.touch(index)
        return self._copies.get(index)

    def touch(self, index: int) -> None:
        """Mark the copy of ``index`` (if one is kept) used now: the least recently used copies are dropped first."""
        if index in self._copies:
            self._copies.move_to_end(index)

    def peek(self, index: int) -> HostCopy | None:
        """The copy kept for ``index``, its place in the eviction order unchanged."""
        return self._copies.get(index)

    def put(self, index: int, copy: HostCopy) -> bool:
        """Keep ``copy`` for ``index`` if it sits in the tier; False (not kept) for one made outside it."""
        if not copy.extents:
            return False
        if self._copies.get(index) is not copy:
            self.drop(index)
            self._copies[index] = copy
        return True

    def release(self, copy: HostCopy) -> None:
        """Give a copy's room back, once the device copies reading it are done."""
        for done in copy.in_flight:
            done.synchronize()
        self._free(copy.extents)
        copy.extents = []

    def drop(self, index: int) -> None:
        copy = self._copies.pop(index, None)
        if copy is not None:
            self.release(copy)

    def _free(self, extents: list[tuple[int, int, int]]) -> None:
        for segment, start, size in extents:
            self._segments[segment][1].free(start, size)

    def rekey(self, moved: dict[torch.device, torch.device]) -> None:
        """Copies follow their pools to new devices (the chunks stay on the host)."""
        for copy in self._copies.values():
            copy.chunks = {moved[device]: chunk for device, chunk in copy.chunks.items()}

    def __contains__(self, index: int) -> bool:
        return index in self._copies


def available_memory_bytes() -> int | None:
    """Memory the system can give without swapping: ``MemAvailable`` of /proc/meminfo (Linux), else its free pages
    (``os.sysconf``); None when neither is known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # given in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def default_host_budget() -> int:
    """The host tier's budget when none is given: ``HOST_BUDGET_SHARE`` of the available memory, within
    ``HOST_BUDGET_MIN`` and ``HOST_BUDGET_MAX`` (the minimum when the available memory is unknown)."""
    available = available_memory_bytes()
    if available is None:
        return HOST_BUDGET_MIN
    return int(min(max(available * HOST_BUDGET_SHARE, HOST_BUDGET_MIN), HOST_BUDGET_MAX))


def _round_up(size: int, unit: int = _ALIGN_BYTES) -> int:
    return -(-size // unit) * unit
