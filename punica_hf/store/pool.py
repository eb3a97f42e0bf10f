"""The device tier: one flat pool per device in which a resident adapter occupies exactly its own factors.

An adapter's factors on one device form one contiguous chunk (``ChunkLayout``): per targeted module ``A``
``[r, in]`` then ``B^T`` ``[r, out]``, each aligned to ``ALIGN`` elements for the kernels' 16-byte loads. A chunk is
placed first-fit in the pool (``ExtentAllocator``), so GPU memory is proportional to rank: a rank-8 adapter takes a
quarter of a rank-32 one. A chunk is filled by one copy from its host copy, on a side stream on GPUs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..formats import ModuleLora
from ..layers import DeviceTables
from ..ops import POOL_ALIGNMENT

ALIGN = POOL_ALIGNMENT  # elements: every factor starts on a 16-byte (vector load) boundary


def aligned(elements: int) -> int:
    return -(-elements // ALIGN) * ALIGN


class ExtentAllocator:
    """First-fit placement of extents in ``[0, capacity)``; a freed extent merges with free neighbours."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (start, size), by start
        self.used = 0

    def allocate(self, size: int) -> int | None:
        """Start of a free extent of ``size``, or None when no free extent is large enough."""
        for i, (start, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free_size - size)
                self.used += size
                return start
        return None

    def copy(self) -> "ExtentAllocator":
        """An allocator in the same state, to try placements on without changing this one."""
        twin = ExtentAllocator(self.capacity)
        twin._free, twin.used = list(self._free), self.used
        return twin

    def used_extents(self) -> list[tuple[int, int]]:
        """``(start, size)`` of the extents in use, by start: what lies between the free ones."""
        used, position = [], 0
        for start, size in [*self._free, (self.capacity, 0)]:
            if start > position:
                used.append((position, start - position))
            position = start + size
        return used

    def free(self, start: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and sum(self._free[i - 1]) == start:  # merge with the free extent before
            i -= 1
            start, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        if i < len(self._free) and start + size == self._free[i][0]:  # and with the one after
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, size))


@dataclass(frozen=True)
class ModulePlacement:
    """Where one module's factors sit inside its adapter's chunk (element offsets from the chunk's start)."""

    row: int  # the module's row in its device's tables
    rank: int
    a_offset: int  # A [rank, in]
    b_offset: int  # B^T [rank, out]
    scale_offset: int = -1  # output_scale [out] (DoRA), -1 when the adapter has none here
    shift_offset: int = -1  # output_shift [out] (LoRA biases, DoRA with a base bias), -1 when none


@dataclass(frozen=True)
class ChunkLayout:
    """An adapter's factors on one device: module placements and the chunk's size in elements."""

    modules: dict[str, ModulePlacement]
    size: int

    @classmethod
    def plan(cls, factors: dict[str, ModuleLora], rows: dict[str, int]) -> "ChunkLayout":
        """Lay out ``factors`` (the modules of this device, in order) given each module's table row."""
        placements, offset = {}, 0
        for name, module in factors.items():
            offsets = []
            for piece in _pieces(module):
                offsets.append(offset if piece is not None else -1)
                offset += 0 if piece is None else aligned(piece.numel())
            placements[name] = ModulePlacement(rows[name], module.rank, *offsets)
        return cls(placements, offset)

    def fill(self, chunk: torch.Tensor, factors: dict[str, ModuleLora]) -> None:
        """Write ``factors`` into ``chunk`` ``[size]`` (casting to its dtype); alignment gaps are zeroed."""
        written = 0  # end of what is written so far: the gap up to the next piece is zeroed
        for name, place in self.modules.items():
            offsets = (place.a_offset, place.b_offset, place.scale_offset, place.shift_offset)
            for piece, start in zip(_pieces(factors[name]), offsets):
                if piece is None:
                    continue
                chunk[written:start].zero_()
                # B^T rows; lora_b read from a converted file is already a transposed view, so this copies rows
                chunk[start : start + piece.numel()].view_as(piece).copy_(piece)
                written = start + piece.numel()
        if written < chunk.numel():
            chunk[written:].zero_()

    def table_columns(self, num_rows: int, chunk_start: int) -> torch.Tensor:
        """``[3, num_rows]`` int64 on the CPU: a slot's column of a_offsets, b_offsets and ranks for this chunk
        placed at ``chunk_start``; rows of modules the adapter does not target get rank 0 (and offset 0)."""
        columns = torch.zeros(3, num_rows, dtype=torch.int64)
        for place in self.modules.values():
            columns[:, place.row] = torch.tensor(
                [chunk_start + place.a_offset, chunk_start + place.b_offset, place.rank]
            )
        return columns


def _pieces(module: ModuleLora) -> tuple[torch.Tensor | None, ...]:
    """What a module puts in its chunk, in order: A, B^T and its output vectors (None where it has none)."""
    return module.lora_a, module.lora_b.T, module.output_scale, module.output_shift


class DevicePool:
    """One device's pool of adapter chunks, its slot tables and the stream its copies run on.

    ``capacity`` is in elements of ``dtype``; ``rows``: the table row of every module that may be hooked (fixed,
    in model order, so projections that share an input have consecutive rows); slots = the most adapters resident
    at once.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, capacity: int, rows: dict[str, int], num_slots: int):
        pool = torch.empty(capacity, dtype=dtype, device=device)
        self.tables = DeviceTables(pool, len(rows), num_slots)
        self.allocator = ExtentAllocator(capacity)
        self.rows = rows  # module name -> its row in the tables
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def device(self) -> torch.device:
        return self.tables.device

    def __getstate__(self) -> dict:
        # Only the extents that hold adapters travel (the tables leave the pool out); the rest is free space.
        pool = self.tables.pool
        used = [(start, pool[start : start + size].clone()) for start, size in self.allocator.used_extents()]
        return {**self.__dict__, "copy_stream": None, "used_extents": used}

    def __setstate__(self, state: dict) -> None:
        used = state.pop("used_extents")
        self.__dict__.update(state)
        for start, contents in used:  # into the empty pool the tables made when they were unpickled
            self.tables.pool[start : start + contents.numel()].copy_(contents)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.tables.pool.dtype

    @property
    def element_size(self) -> int:
        return self.tables.pool.element_size()

    def apply(self, fn) -> None:
        """``nn.Module._apply`` semantics for the tables; the copy stream follows a device change."""
        before = self.device
        self.tables.apply(fn)
        if self.device != before:
            self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def place(self, slot: int, layout: ChunkLayout, chunk_start: int, host_chunk: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``host_chunk`` into the pool at ``chunk_start`` and point ``slot``'s table column at it.

        On a GPU both copies run on the side stream after everything already queued on the current stream (a
        forward still reading what was evicted from this place), and the returned event marks their end: a
        forward using the slot must wait for it. On the CPU they run at once and None is returned.
        """
        tables = self.tables
        columns = layout.table_columns(tables.ranks.shape[0], chunk_start)
        if self.copy_stream is None:
            self._copy(slot, layout, chunk_start, host_chunk, columns)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self._copy(slot, layout, chunk_start, host_chunk, columns.pin_memory())
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return done

    def _copy(self, slot, layout, chunk_start, host_chunk, columns) -> None:
        tables = self.tables
        tables.pool[chunk_start : chunk_start + layout.size].copy_(host_chunk, non_blocking=True)
        device_columns = columns.to(self.device, non_blocking=True)
        tables.a_offsets[:, slot].copy_(device_columns[0])
        tables.b_offsets[:, slot].copy_(device_columns[1])
        tables.ranks[:, slot].copy_(device_columns[2])
        self._copy_vectors(slot, layout, chunk_start)

    def _copy_vectors(self, slot: int, layout: ChunkLayout, chunk_start: int) -> None:
        """Write the slot's row of every output-vector table: the adapter's vector (from its chunk, just placed) where
        it has one, else the identity (scale 1, shift 0)."""
        tables = self.tables
        by_row = {place.row: place for place in layout.modules.values()}
        for row, row_tables in tables.vectors.items():
            place = by_row.get(row)
            offsets = (-1, -1) if place is None else (place.scale_offset, place.shift_offset)
            for table, offset, identity in zip(row_tables, offsets, (1, 0)):
                if table is None:
                    continue
                if offset < 0:
                    table[slot].fill_(identity)
                else:
                    table[slot].copy_(tables.pool[chunk_start + offset : chunk_start + offset + table.shape[1]])
