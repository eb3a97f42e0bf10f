"""The adapter store: registration apart from residency, an LRU device tier and a host tier behind it.

- Registration (``add``): any number of adapters. Each gets an index, stable while it is registered, and is
  checked against the base model first, all adapters of a call before any change (all or nothing).
- Residency (``acquire``): a batch's adapters are brought into their devices' pools on demand, evicting the least
  recently used adapters that nothing holds. A lease holds its adapters: held adapters are neither evicted nor
  unloaded (an unload waits for the last holder), so a running call keeps its adapters as they were. A call whose
  adapters do not fit beside what other leases hold waits for them to end (``capacity_wait_s``), unless it asked
  not to block; one whose adapters could not fit even alone fails at once.
- Host tier: chunks in pinned host memory within a budget; past it, re-read from the source when needed.
- Off the critical path: reading a source runs on a background thread; the host-to-device copy runs on a side
  stream that the forward waits for on the device, never on the host.

Every public method takes the store's lock, the one the model's forwards take, so threads see whole states.

Copies (``copy.deepcopy``, pickle, ``torch.save``) carry what is in use: the bytes of the pools and of the host tier
that hold adapters, not the memory set aside for more; the copy makes its own buffers. Leases stay with the
original.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import numbers
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..base_layers import LinearModule
from ..formats import AdapterWeights, ModuleLora, load_adapter_weights
from ..layers import DeviceTables
from .host import HostCopy, HostTier, default_host_budget
from .pool import ChunkLayout, DevicePool, aligned

# Default pool: room for max_adapters adapters of max_rank on every linear layer, at most this share of the device
# memory free when the pool is made (on the CPU, at most this many bytes of address space).
GPU_POOL_FRACTION = 0.2
CPU_POOL_BYTES = 1 << 30
CAPACITY_WAIT_S = 60.0  # default time a call waits for the device room that other calls hold
# A waiting call looks again this often for leases the garbage collector ended: a finalizer cannot wake it (it may
# run inside a store method of the waiter's own lock-holding thread, where it must not touch the store).
_COLLECTED_LEASE_POLL_S = 0.05
# A failed background read is told to the non-blocking acquires of this long after it (whoever asked for the read
# asks again soon: the engine, at every step); a later one reads the source again (nobody waited for the failure).
READ_FAILURE_TOLD_S = 5.0
logger = logging.getLogger(__name__)
_REGISTRATIONS = itertools.count()  # never reused: an adapter loaded again under its name is a new registration


class AdapterCapacityError(ValueError):
    """The adapters a call needs cannot all be resident at once (slots or pool bytes, given what others hold)."""


class AdapterNotReady(RuntimeError):
    """``acquire(block=False)``: an adapter is still being read; its load has started, ask again later."""


class AdapterReadError(RuntimeError):
    """``acquire(block=False)``: the background read of an adapter's source failed (said once: the next
    ``acquire`` reads it again)."""


@dataclass(eq=False)
class Adapter:
    """One registered adapter and where it is."""

    name: str
    index: int
    source: Any  # what to read again when its host copy was dropped: a path or Hub id, or the AdapterWeights
    source_kwargs: dict
    dims: dict[str, tuple]  # module -> what its chunk holds (``_chunk_dims``), to check a re-read against
    layouts: dict[torch.device, ChunkLayout]
    device_bytes: int
    factor_bytes: int  # its factors' bytes on this process's devices (this rank's share under tensor parallelism)
    unsplit_bytes: int  # the same adapter's factor bytes on the whole (unsplit) layers
    users: int = 0  # leases holding it
    unloaded: bool = False  # unload_adapter() was called while held: dropped when the last lease ends
    slot: int | None = None  # set while resident
    chunk_starts: dict[torch.device, int] = field(default_factory=dict)
    copies_done: dict[torch.device, torch.cuda.Event] = field(default_factory=dict)
    reading: Future | None = None  # a background read of the source in flight
    read_failure: tuple[BaseException, float] | None = None  # why the last background read failed, and when
    prefetched: HostCopy | None = None  # a read's result the host tier could not keep, for its next use
    registration: int = field(default_factory=_REGISTRATIONS.__next__)  # this load of these weights, in the process
    invocation_tokens: tuple[int, ...] | None = None  # aLoRA: the tokens whose last occurrence starts the adapter

    def __getstate__(self) -> dict:
        return {**self.__dict__, "reading": None, "read_failure": None, "copies_done": {}}


class ModuleHooks(Protocol):
    """What the store asks of the model surgery (``punica_hf.injection.LoraInjection``): the base model's linear
    modules as plain data, and hooks on them by name."""

    def linear_modules(self) -> dict[str, LinearModule]:
        """Every linear module, in model order."""

    def select(self, adapter: str, weights: AdapterWeights) -> AdapterWeights:
        """The part of ``weights`` that PEFT would load into the model; ValueError where PEFT refuses the adapter."""

    def check_targets(self, adapter: str, module_names: Iterable[str]) -> None:
        """Raise ValueError for a module name that cannot get a LoRA hook."""

    def attach(
        self, module_names: Iterable[str], tables: Mapping[torch.device, DeviceTables], rows: Mapping[str, int]
    ) -> list[str]:
        """Hook the modules without a hook yet (all or none); return the names hooked."""

    def detach(self, module_names: Iterable[str]) -> None:
        """Remove the hooks of these modules."""

    def use_vectors(self, module_names: Collection[str]) -> None:
        """Apply output vectors (DoRA, LoRA biases) on exactly these modules' hooks."""


@dataclass
class AdapterPlan:
    """One adapter of a registration call, planned: its factors and chunk layout per device."""

    weights: AdapterWeights
    source: Any
    source_kwargs: dict
    factors_by_device: dict[torch.device, dict[str, ModuleLora]]
    layouts: dict[torch.device, ChunkLayout]
    device_bytes: int
    factor_bytes: int
    unsplit_bytes: int


@dataclass(eq=False)
class _Undo:
    """What one registration call made and must take away again if it fails, and what it uses while it runs:
    another call's failure leaves those in place (``AdapterStore._loads_in_flight``)."""

    hooks: list[str] = field(default_factory=list)  # hooks it made
    pools: list[torch.device] = field(default_factory=list)  # pools it made
    registered: list[Adapter] = field(default_factory=list)  # adapters it registered so far
    modules: set[str] = field(default_factory=set)  # modules its adapters' hooks are on
    devices: set[torch.device] = field(default_factory=set)  # devices of the pools its adapters go to


class AdapterLease:
    """Holds adapters resident and registered until ``release()`` (or the end of its ``with`` block); ``slots`` =
    their device slots (-1 = base); ``registrations`` = which load of each adapter it holds (None = base): a
    number never given to another load in this process, so state computed with one adapter's weights (a KV cache)
    is never taken for another's, even under the same name or slot.

    A lease dropped without ``release()`` is released once it is garbage collected. Releasing twice, from several
    threads, or by hand and by the collector, counts once.
    """

    def __init__(self, store: "AdapterStore", adapters: list[Adapter], entries: list[Adapter | None]) -> None:
        self._store = store
        self._adapters = adapters
        self.slots = [-1 if a is None else a.slot for a in entries]
        self.registrations = [None if a is None else a.registration for a in entries]
        self.invocation_tokens = [None if a is None else a.invocation_tokens for a in entries]  # None: not aLoRA
        # The finalizer is the lease's one release: whoever detaches or runs it first (release(), on any thread, or
        # the garbage collector) releases the adapters, and nobody after.
        self._release_once = weakref.finalize(self, store._release_collected, adapters)
        self._release_once.atexit = False  # the process is ending: nothing to give back

    def release(self) -> None:
        if self._release_once.detach() is not None:
            self._store._release(self._adapters)

    def __enter__(self) -> "AdapterLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AdapterStore:
    """All adapters of one model: registration, device pools, host tier, leases. See the module docstring."""

    def __init__(
        self, module_hooks: ModuleHooks, max_adapters: int, max_rank: int,
        gpu_pool_bytes: int | None, host_pool_bytes: int | None, capacity_wait_s: float = CAPACITY_WAIT_S,
    ) -> None:
        self.module_hooks = module_hooks
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.gpu_pool_bytes = gpu_pool_bytes
        self.lock = threading.RLock()
        self.cache_generate_lock = threading.Lock()  # generate() calls that keep a cache on the model: one at a time
        self.capacity_wait_s = capacity_wait_s
        self.room_freed = threading.Condition(self.lock)  # notified when a lease ends or an adapter is unloaded
        self._collected_leases: deque[list[Adapter]] = deque()  # adapters of leases the garbage collector ended
        self.unwrapped = False  # set by unwrap(): the model gave its hooks up, and with them every use of adapters
        self.host = HostTier(default_host_budget() if host_pool_bytes is None else host_pool_bytes)
        self.pools: dict[torch.device, DevicePool] = {}
        self._by_name: dict[str, Adapter] = {}
        self._by_index: dict[int, Adapter] = {}  # registered, plus unloaded ones still held
        self._resident: OrderedDict[int, Adapter] = OrderedDict()  # least recently used first
        self._free_slots = list(range(max_adapters))
        self._reader: ThreadPoolExecutor | None = None
        # load_adapters calls past their planning, not yet registered or undone: the hooks and pools they made or
        # found stay while they run, whatever another call's failure takes away
        self._loads_in_flight: list[_Undo] = []
        self.counters = dict(hits=0, host_loads=0, disk_loads=0, evictions=0, bytes_to_gpu=0)

    @contextlib.contextmanager
    def changing(self):
        """Hold the lock for a change of the store's tensors, made as plain tensors whatever the caller's mode:
        a pool made or written inside ``torch.inference_mode()`` must stay writable outside it."""
        with self.lock, torch.inference_mode(False), torch.no_grad():
            yield

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickle: no lock, thread or reads in flight; device copies finished."""
        with self.lock:
            self._release_collected_leases()
            for pool in self.pools.values():
                if pool.copy_stream is not None:
                    pool.copy_stream.synchronize()
            state = dict(self.__dict__)
        for unpicklable in ("lock", "cache_generate_lock", "room_freed", "_collected_leases", "_reader",
                            "_loads_in_flight"):  # the copy has no call of this process running on it
            del state[unpicklable]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self.cache_generate_lock = threading.Lock()
        self.room_freed = threading.Condition(self.lock)
        self._collected_leases = deque()
        self._reader = None
        self._loads_in_flight = []
        # The original's leases do not hold the copy's adapters: what they held is free here, and what was unloaded
        # under them is gone.
        for adapter in list(self._by_index.values()):
            adapter.users = 0
            # a registration of this process: the pickled number may be another adapter's here (KV cache keys)
            adapter.registration = next(_REGISTRATIONS)
            if adapter.unloaded:
                self._drop(adapter)

    # ------------------------------------------------------------------------------------------ registration
    @property
    def indices(self) -> dict[str, int]:
        with self.lock:
            return {name: adapter.index for name, adapter in self._by_name.items()}

    def registration(self, name: str) -> int:
        """Which load of the adapter ``name`` is registered now (``Adapter.registration``)."""
        with self.lock:
            return self.lookup(name).registration

    def output_vector_users(self) -> dict[str, list[str]]:
        """Module -> the registered adapters (held ones being unloaded too) with output vectors on it (DoRA, LoRA
        biases): computed from the module's weight and bias when the adapter was loaded."""
        with self.lock:
            users: dict[str, list[str]] = {}
            for adapter in self._by_index.values():
                for module_name, (*_, has_scale, has_shift) in adapter.dims.items():
                    if has_scale or has_shift:
                        users.setdefault(module_name, []).append(adapter.name)
            return users

    def _use_vectors(self) -> None:
        """Hooks apply output vectors where a registered adapter has them, and nowhere else (after a load, a failed
        load and a drop)."""
        self.module_hooks.use_vectors(set(self.output_vector_users()))

    def add(self, adapters: Mapping[str, tuple[AdapterWeights, Any, dict]]) -> dict[str, int]:
        """Register ``{name: (weights, source, source_kwargs)}``, all or none. Returns ``{name: index}``.

        ``source`` is what to read again once the host copy is dropped (a path or Hub id), or the weights
        themselves for adapters given in memory. Checks and planning hold the lock; building the host copies (the
        heavy part) does not, so running forwards go on meanwhile.
        """
        with self.changing():
            self.check_wrapped()
            for name in adapters:
                self._check_new_name(name)
            adapters = {
                name: (self.module_hooks.select(name, weights), source, source_kwargs)
                for name, (weights, source, source_kwargs) in adapters.items()
            }
            targets = self.module_hooks.linear_modules()
            for name, (weights, _, _) in adapters.items():
                self._check_fits(name, weights, targets)
            undo = _Undo()
            self._loads_in_flight.append(undo)
            try:
                planned = self._plan(adapters, targets, undo)
            except BaseException:
                self._undo(undo)
                raise
        host_copies: dict[str, HostCopy] = {}
        try:
            with torch.inference_mode(False), torch.no_grad():
                for name, plan in planned.items():
                    host_copies[name] = self._host_chunks(plan.layouts, plan.factors_by_device)
            with self.changing():
                self.check_wrapped()  # unwrap() may have run meanwhile
                for name in adapters:  # another thread may have taken a name meanwhile
                    self._check_new_name(name)
                assigned = self._register(planned, host_copies, undo)
                self._use_vectors()
                self._loads_in_flight.remove(undo)
                return assigned
        except BaseException:  # any failure or interrupt: undo every change of this call
            with self.lock:
                for adapter in undo.registered:  # registered before the failure: gone again, copies and all
                    del self._by_name[adapter.name]
                    self._drop(adapter)
                for copy in host_copies.values():  # (one dropped with its adapter gives nothing back twice)
                    self.host.release(copy)
                self._undo(undo)
            raise

    def _plan(self, adapters, targets: dict[str, LinearModule], undo: "_Undo") -> dict[str, AdapterPlan]:
        """Each adapter's chunk layout per device; makes the pools and hooks it needs (noted in ``undo``)."""
        rows = {name: row for row, name in enumerate(targets)}  # model order: siblings get consecutive rows
        planned = {}
        for name, (weights, source, source_kwargs) in adapters.items():
            factors_by_device: dict[torch.device, dict[str, ModuleLora]] = {}
            for module_name in sorted(weights.modules):
                pool = self._pool_for(targets[module_name], targets, rows, undo.pools)
                factors_by_device.setdefault(pool.device, {})[module_name] = weights.modules[module_name]
            layouts = {
                device: _sized_for_every_rank(ChunkLayout.plan(factors, self.pools[device].rows), factors, targets)
                for device, factors in factors_by_device.items()
            }
            device_bytes = sum(layout.size * self.pools[d].element_size for d, layout in layouts.items())
            self._check_sizes(name, layouts, device_bytes)
            factor_bytes, unsplit_bytes = _factor_bytes(weights, targets)
            planned[name] = AdapterPlan(
                weights, source, source_kwargs, factors_by_device, layouts, device_bytes, factor_bytes, unsplit_bytes
            )
        for plan in planned.values():  # tables of output vectors (DoRA, LoRA biases) where the adapter has them
            for device, factors in plan.factors_by_device.items():
                for module_name, module in factors.items():
                    if module.output_scale is not None or module.output_shift is not None:
                        self.pools[device].tables.add_vectors(
                            rows[module_name], module.lora_b.shape[0],
                            scale=module.output_scale is not None, shift=module.output_shift is not None,
                        )
        targeted = sorted({m for plan in planned.values() for m in plan.weights.modules})
        undo.modules.update(targeted)
        undo.devices.update(device for plan in planned.values() for device in plan.layouts)
        if targeted:
            tables = {device: pool.tables for device, pool in self.pools.items()}
            undo.hooks = self.module_hooks.attach(targeted, tables, rows)
        return planned

    def _undo(self, undo: "_Undo") -> None:
        """Remove the hooks and pools a failed call made, unless a registered adapter or another call still
        loading uses them."""
        if undo in self._loads_in_flight:  # (identity: _Undo compares by it)
            self._loads_in_flight.remove(undo)
        used_modules = {m for a in self._by_index.values() for layout in a.layouts.values() for m in layout.modules}
        used_devices = {d for a in self._by_index.values() for d in a.layouts}
        for other in self._loads_in_flight:
            used_modules |= other.modules
            used_devices |= other.devices
        self.module_hooks.detach([m for m in undo.hooks if m not in used_modules])
        for device in undo.pools:
            if device not in used_devices:
                del self.pools[device]
        self._use_vectors()

    def _register(self, planned: dict[str, AdapterPlan], host_copies: dict, undo: "_Undo") -> dict[str, int]:
        assigned = {}
        for name, plan in planned.items():
            index = self._free_index()
            adapter = Adapter(
                name=name, index=index, source=plan.source, source_kwargs=plan.source_kwargs,
                dims=_chunk_dims(plan.weights),
                layouts=plan.layouts, device_bytes=plan.device_bytes, factor_bytes=plan.factor_bytes,
                unsplit_bytes=plan.unsplit_bytes, invocation_tokens=plan.weights.config.alora_invocation_tokens,
            )
            self._by_name[name] = self._by_index[index] = adapter
            undo.registered.append(adapter)
            self._keep_copy(adapter, host_copies[name])
            assigned[name] = index
        for name in assigned:  # onto the device right away where there is room without evicting anything
            self._try_place(self._by_name[name], evict=False)
        return assigned

    def remove(self, name: str) -> None:
        """Unregister ``name``; its memory is freed now, or when the last lease holding it ends."""
        if not isinstance(name, str):  # a list would otherwise fail as an unhashable key
            raise ValueError(f"unload_adapter takes one adapter name, got {name!r}")
        with self.changing():
            self.check_wrapped()
            if name not in self._by_name:
                raise KeyError(f"unknown adapter {name!r}; loaded adapters: {sorted(self._by_name)}")
            self._release_collected_leases()
            adapter = self._by_name.pop(name)
            adapter.unloaded = True
            if adapter.users == 0:
                self._drop(adapter)
                self.room_freed.notify_all()

    def _drop(self, adapter: Adapter) -> None:
        if adapter.slot is not None:
            self._evict(adapter, counted=False)
        self.host.drop(adapter.index)
        adapter.prefetched = None
        del self._by_index[adapter.index]
        self._use_vectors()

    # ------------------------------------------------------------------------------------------ residency
    def lookup(self, adapter: str | int | None) -> Adapter | None:
        """The registered adapter given by name or index; None for None or -1 (the base model)."""
        if adapter is None:
            return None
        if isinstance(adapter, str):
            if adapter not in self._by_name:
                raise KeyError(f"unknown adapter {adapter!r}; loaded adapters: {sorted(self._by_name)}")
            return self._by_name[adapter]
        if isinstance(adapter, bool) or not isinstance(adapter, numbers.Integral):
            raise ValueError(f"adapter_ids entries must be names, None or integer indices, got {adapter!r}")
        index = int(adapter)
        if index == -1:
            return None
        found = self._by_index.get(index)
        if found is None or found.unloaded:
            raise KeyError(f"no adapter is loaded at index {index}; loaded adapters: {self.indices}")
        return found

    def acquire(
        self, adapters: Sequence[str | int | None] | str, block: bool = True, timeout: float | None = None,
        registrations: Sequence[int | None] | None = None,
    ) -> AdapterLease:
        """Hold ``adapters`` resident and registered; the lease's ``slots`` has one slot per entry (-1 = base).
        ``registrations``: the loads the caller asks for, one per entry (None: any); an entry registered by
        another load now (unloaded, and loaded again under its name) raises ``KeyError`` before anything is placed.

        Where other leases hold the room these adapters need, wait up to ``timeout`` seconds (default
        ``capacity_wait_s``) for them to end; with ``block=False``, raise ``AdapterCapacityError`` at once instead
        (and ``AdapterNotReady`` for an adapter whose source is still being read).
        """
        adapters = _adapter_list(adapters)
        if registrations is not None and len(registrations) != len(adapters):
            raise ValueError(f"{len(adapters)} adapters but {len(registrations)} registrations")
        wait_s = self.capacity_wait_s if timeout is None else check_wait("timeout", timeout)
        self.check_wrapped()  # before any read (and again under the lock)
        if block:
            self._read_cold(adapters)
        deadline = time.monotonic() + wait_s
        with self.changing():
            while True:
                self.check_wrapped()
                self._release_collected_leases()
                entries = [self.lookup(adapter) for adapter in adapters]  # again after a wait: unloads meanwhile
                for adapter, entry, wanted in zip(adapters, entries, registrations or ()):
                    if wanted is not None and (entry is None or entry.registration != wanted):
                        raise KeyError(f"adapter {adapter!r} was unloaded and loaded again")
                needed = list({id(a): a for a in entries if a is not None}.values())
                self._check_fits_alone(needed)
                try:
                    self._make_resident(needed, block)
                    break
                except AdapterCapacityError as error:
                    if not block:
                        raise
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise AdapterCapacityError(f"waited {wait_s:g} s for room on the device: {error}") from None
                    self.room_freed.wait(min(left, _COLLECTED_LEASE_POLL_S))
            for adapter in needed:
                self._resident.move_to_end(adapter.index)
                self.host.touch(adapter.index)  # its host copy too: it is dropped last once the adapter leaves
                adapter.users += 1
                for device, done in adapter.copies_done.items():
                    torch.cuda.current_stream(device).wait_event(done)
                adapter.copies_done = {}
            return AdapterLease(self, needed, entries)

    def _make_resident(self, needed: list[Adapter], block: bool) -> None:
        """Place the adapters of ``needed`` that are not resident, or raise (``AdapterCapacityError`` where the room
        is held by other leases) having placed and evicted nothing: under tensor parallelism the other ranks never
        make a failed attempt of rank 0's, and their slots would part from its."""
        protected = {a.index for a in needed}
        self._check_room(needed)
        missing = [adapter for adapter in needed if adapter.slot is None]
        if not block:  # (a blocking call read them before it took the lock, in _read_cold)
            for adapter in missing:
                self._copy_at_hand(adapter, block, protected)
        hits = len(needed) - len(missing)
        try:
            self._check_placeable(missing, protected)
        except AdapterCapacityError:
            # The batch's own resident adapters may split the free room so that no extent is long enough, and no
            # wait for others would help: every unheld adapter goes, the batch's own too, and the batch is placed
            # again largest first (first fit would put a moved adapter back where it was).
            moved = [a for a in needed if a.slot is not None and a.users == 0]
            if not moved:
                raise
            for adapter in moved:  # their host copies at hand before anything is evicted
                self._copy_at_hand(adapter, block, protected)
            missing = sorted(moved + missing, key=lambda a: sum(layout.size for layout in a.layouts.values()),
                             reverse=True)
            self._check_placeable(missing, protected, moved, evict_unheld_first=True)
            for adapter in list(self._unheld(protected=())):  # moved ones included
                self._evict(adapter)
        for adapter in missing:
            self._place(adapter, protected)
        self.counters["hits"] += hits  # counted once, by the attempt that succeeds

    def _check_placeable(self, adapters: list[Adapter], protected: set[int], moved: Sequence[Adapter] = (),
                         evict_unheld_first: bool = False) -> None:
        """Raise ``AdapterCapacityError`` unless ``_place`` can place ``adapters`` in turn (after evicting those of
        them in ``moved``, resident, and with ``evict_unheld_first`` every unheld adapter): its placements and
        evictions (least recently used first, outside ``protected``) tried on copies of the pools' allocators. The
        pools' free bytes may suffice while no free extent is long enough (``_check_room`` counts bytes only)."""
        allocators = {device: pool.allocator.copy() for device, pool in self.pools.items()}
        free_slots = len(self._free_slots) + len(moved)
        evicted: set[int] = set()
        for adapter in moved:
            for device, start in adapter.chunk_starts.items():
                allocators[device].free(start, adapter.layouts[device].size)

        def evict_one(device: torch.device | None = None) -> bool:  # as _evict_one
            nonlocal free_slots
            victim = next((a for a in self._unheld(protected, device) if a.index not in evicted), None)
            if victim is None:
                return False
            evicted.add(victim.index)
            for victim_device, start in victim.chunk_starts.items():
                allocators[victim_device].free(start, victim.layouts[victim_device].size)
            free_slots += 1
            return True

        while evict_unheld_first and evict_one():
            pass
        for adapter in adapters:
            if not free_slots and not evict_one():
                raise self._capacity_error(adapter, "no free slot")
            for device, layout in adapter.layouts.items():
                while allocators[device].allocate(layout.size) is None:
                    if not evict_one(device):
                        raise self._capacity_error(adapter, f"no free extent long enough in the pool on {device}")
            free_slots -= 1

    def _copy_at_hand(self, adapter: Adapter, block: bool, keep: Collection[int]) -> None:
        """Make sure placing ``adapter`` needs no read of its source: read it now (``block``), or start reading it
        in the background and raise ``AdapterNotReady`` (``AdapterReadError`` for a background read that failed
        lately: said once; the next call reads the source again)."""
        if adapter.index in self.host or adapter.prefetched is not None:
            return
        if not block:
            failure, adapter.read_failure = adapter.read_failure, None
            if failure is not None and time.monotonic() - failure[1] < READ_FAILURE_TOLD_S:
                error = failure[0]
                raise AdapterReadError(
                    f"adapter {adapter.name!r} could not be read from {adapter.source}: {type(error).__name__}: {error}"
                ) from error
            self._read_in_background(adapter, keep=keep)  # the batch's other copies stay, as a blocking call's do
            raise AdapterNotReady(f"adapter {adapter.name!r} is being read from {adapter.source}")
        self._keep_copy(adapter, self._read_source(adapter, keep))

    def _check_fits_alone(self, needed: list[Adapter]) -> None:
        """Refuse adapters that could not all be resident at once even with nothing else held: no wait helps."""
        if len(needed) > self.max_adapters:
            raise AdapterCapacityError(
                f"this batch uses {len(needed)} different adapters but at most max_adapters="
                f"{self.max_adapters} fit on the device at once"
            )
        for device, pool in self.pools.items():
            size = sum(a.layouts[device].size for a in needed if device in a.layouts)
            if size > pool.allocator.capacity:
                raise AdapterCapacityError(
                    f"this batch's adapters need {size * pool.element_size / 2**20:.2f} MiB on {device} together but "
                    f"the whole pool there is {pool.allocator.capacity * pool.element_size / 2**20:.2f} MiB "
                    "(raise gpu_pool_bytes)"
                )

    def _check_room(self, needed: list[Adapter]) -> None:
        """Refuse, before evicting anything, a batch whose adapters cannot all be resident beside what is held."""
        protected = {a.index for a in needed}
        held = [a for a in self._resident.values() if a.users > 0 and a.index not in protected]
        if len(needed) + len(held) > self.max_adapters:
            raise AdapterCapacityError(
                f"this batch uses {len(needed)} adapters and running calls hold {len(held)} others; "
                f"max_adapters={self.max_adapters} fit on the device at once (held by running calls; retry later)"
            )
        for device, pool in self.pools.items():
            missing = sum(a.layouts[device].size for a in needed if a.slot is None and device in a.layouts)
            evictable = sum(
                a.layouts[device].size for a in self._resident.values()
                if a.users == 0 and a.index not in protected and device in a.layouts
            )
            if missing > pool.allocator.capacity - pool.allocator.used + evictable:
                raise AdapterCapacityError(
                    f"this batch's adapters need {missing * pool.element_size / 2**20:.1f} MiB more on {device}; "
                    f"with what running calls hold there is room for less (pool {self._pool_summary()})"
                )

    def _read_cold(self, adapters: Sequence[str | int | None]) -> None:
        """Read the sources of adapters with no host copy, without holding the lock (other calls go on). The host
        copies of all of ``adapters`` stay (one read past the tier's budget is kept outside it, for its next use):
        placing them must not need a source again, which may be gone by then, with some placed already."""
        with self.lock:
            wanted = {id(a): a for a in map(self.lookup, adapters) if a is not None and a.slot is None}
            cold = [a for a in wanted.values() if a.index not in self.host and a.prefetched is None]
            keep = {a.index for a in wanted.values()}
        for adapter in cold:
            with torch.inference_mode(False), torch.no_grad():
                copy = self._read_source(adapter, keep)
            with self.lock:
                if not adapter.unloaded and adapter.index not in self.host and adapter.prefetched is None:
                    self._keep_copy(adapter, copy)
                else:
                    self.host.release(copy)

    def _release(self, adapters: Iterable[Adapter]) -> None:
        with self.changing():
            self._end_hold(adapters)
            self._release_collected_leases()

    def _end_hold(self, adapters: Iterable[Adapter]) -> None:
        """One lease's hold on ``adapters`` ends (under the lock); calls waiting for room look again."""
        for adapter in adapters:
            adapter.users -= 1
            if adapter.unloaded and adapter.users == 0:
                self._drop(adapter)
        self.room_freed.notify_all()

    def _release_collected(self, adapters: list[Adapter]) -> None:
        """A lease's finalizer: the garbage collector may run it anywhere, even inside a store method of a thread
        that holds the lock, so it only queues the adapters (``deque.append`` is atomic); the next store call that
        looks at what is held ends their hold (``_release_collected_leases``)."""
        self._collected_leases.append(adapters)

    def _release_collected_leases(self) -> None:
        """End the holds of leases the garbage collector ended (under the lock, between whole changes)."""
        while self._collected_leases:
            self._end_hold(self._collected_leases.popleft())

    def prefetch(self, adapters: Iterable[str | int] | str) -> None:
        """Start bringing ``adapters`` onto their devices without waiting (read in the background if needed)."""
        adapters = _adapter_list(adapters)
        with self.changing():
            self.check_wrapped()
            self._release_collected_leases()
            for adapter in [self.lookup(a) for a in adapters]:
                if adapter is None or adapter.slot is not None:
                    continue
                if adapter.index in self.host or adapter.prefetched is not None:
                    self._try_place(adapter, evict=True)
                else:
                    self._read_in_background(adapter, place=True)

    def _try_place(self, adapter: Adapter, evict: bool) -> None:
        """Place ``adapter`` if there is room (evicting for it if ``evict``); else change nothing."""
        if adapter.slot is None:
            try:
                if evict:
                    self._check_placeable([adapter], {adapter.index})
                self._place(adapter, protected={adapter.index}, evict=evict)
            except AdapterCapacityError:
                pass

    def _place(self, adapter: Adapter, protected: set[int], evict: bool = True) -> None:
        """Make ``adapter`` resident, evicting unheld least recently used adapters outside ``protected``."""
        if not self._free_slots and not (evict and self._evict_one(protected)):
            raise self._capacity_error(adapter, "no free slot")
        starts: dict[torch.device, int] = {}
        slot = None
        try:
            for device, layout in adapter.layouts.items():
                pool = self.pools[device]
                start = pool.allocator.allocate(layout.size)
                while start is None:
                    if not (evict and self._evict_one(protected, device)):
                        raise self._capacity_error(adapter, f"no room in the pool on {device}")
                    start = pool.allocator.allocate(layout.size)
                starts[device] = start
            host_copy = self._host_copy(adapter, protected)  # only once there is room: a copy for one use stays
            slot = self._free_slots.pop(0)
            host_copy.in_flight = [done for done in host_copy.in_flight if not done.query()]
            for device, layout in adapter.layouts.items():
                done = self.pools[device].place(slot, layout, starts[device], host_copy.chunks[device])
                if done is not None:
                    adapter.copies_done[device] = done
                    host_copy.in_flight.append(done)
        except BaseException:  # the room and the slot go back (a half-written chunk is no one's)
            for device, start in starts.items():
                self.pools[device].allocator.free(start, adapter.layouts[device].size)
            if slot is not None:
                self._free_slots.append(slot)
                self._free_slots.sort()
            adapter.copies_done = {}
            raise
        for device, layout in adapter.layouts.items():
            self.counters["bytes_to_gpu"] += layout.size * self.pools[device].element_size
        adapter.slot, adapter.chunk_starts = slot, starts
        self._resident[adapter.index] = adapter
        self.counters["host_loads"] += 1

    def _evict_one(self, protected: set[int], device: torch.device | None = None) -> bool:
        """Evict the least recently used resident adapter that nothing holds (on ``device``, if given)."""
        victim = next(self._unheld(protected, device), None)
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _unheld(self, protected: Collection[int], device: torch.device | None = None) -> Iterator[Adapter]:
        """The resident adapters nothing holds, outside ``protected`` (on ``device``, if given), least recently
        used first: the eviction order."""
        return (a for a in self._resident.values()
                if a.users == 0 and a.index not in protected and (device is None or device in a.layouts))

    def _evict(self, adapter: Adapter, counted: bool = True) -> None:
        # The table column keeps pointing here until the slot is reused; nothing maps tokens to a free slot, and
        # the next owner's column is written in full.
        for device, start in adapter.chunk_starts.items():
            self.pools[device].allocator.free(start, adapter.layouts[device].size)
        self._free_slots.append(adapter.slot)
        self._free_slots.sort()
        del self._resident[adapter.index]
        adapter.slot, adapter.chunk_starts, adapter.copies_done = None, {}, {}
        if counted:
            self.counters["evictions"] += 1

    def _capacity_error(self, adapter: Adapter, problem: str) -> AdapterCapacityError:
        held = sum(1 for a in self._resident.values() if a.users > 0)
        return AdapterCapacityError(
            f"cannot put adapter {adapter.name!r} ({adapter.device_bytes / 2**20:.1f} MiB) on the device: {problem} "
            f"({len(self._resident)} resident, {held} held by running calls, max_adapters={self.max_adapters}, "
            f"pool {self._pool_summary()})"
        )

    def _pool_summary(self) -> str:
        return ", ".join(
            f"{device}: {pool.allocator.used * pool.element_size / 2**20:.1f} of "
            f"{pool.allocator.capacity * pool.element_size / 2**20:.1f} MiB used"
            for device, pool in self.pools.items()
        ) or "not made yet"

    # ------------------------------------------------------------------------------------------ host tier
    def _host_copy(self, adapter: Adapter, keep: Collection[int] = ()) -> HostCopy:
        """The adapter's chunks on the host: from the host tier, a finished background read, or its source (not
        dropping the copies of ``keep``)."""
        copy = self.host.get(adapter.index)
        if copy is not None:
            return copy
        if adapter.prefetched is not None:
            copy, adapter.prefetched = adapter.prefetched, None
            return copy
        # A background read may be in flight: reading again here beats waiting for it under the lock it needs.
        copy = self._read_source(adapter, keep)
        self._keep_copy(adapter, copy)
        adapter.prefetched = None  # used right now
        return copy

    def _keep_copy(self, adapter: Adapter, copy: HostCopy) -> None:
        """Keep a fresh host copy in the tier, or (outside the budget) for the adapter's next use only."""
        adapter.read_failure = None  # read since: an earlier failure no longer says anything
        if not self.host.put(adapter.index, copy):
            adapter.prefetched = copy

    def _read_source(self, adapter: Adapter, keep: Collection[int] = ()) -> HostCopy:
        """The adapter's chunks read again from its source into a host copy, dropping least recently used copies
        of the tier, but none of resident adapters or of ``keep``."""
        source = adapter.source
        if isinstance(source, AdapterWeights):  # the caller's tensors, by reference: checked as at their load
            where = f"in the AdapterWeights of {source.source}"
            try:
                weights = dataclasses.replace(source)  # its checks run again (NaN or Inf values)
            except ValueError as error:
                raise ValueError(f"adapter {adapter.name!r} changed {where} since it was loaded: {error}; keep "
                                 "them unchanged while it is loaded, or unload it and load it again") from error
        else:
            where = f"at {source}"
            weights = load_adapter_weights(source, **adapter.source_kwargs)
            with self.lock:
                self.counters["disk_loads"] += 1
        weights = self.module_hooks.select(adapter.name, weights)  # the model's share (tensor parallelism)
        if _chunk_dims(weights) != adapter.dims:
            raise ValueError(
                f"adapter {adapter.name!r} changed {where} since it was loaded (other modules, shapes or "
                "DoRA / bias vectors); unload it and load it again"
            )
        factors_by_device = {
            device: {name: weights.modules[name] for name in layout.modules} for device, layout in adapter.layouts.items()
        }
        for device, factors in factors_by_device.items():  # the pool's dtype may have changed since the load
            for module_name, module in factors.items():
                _check_in_range(adapter.name, module_name, module, self.pools[device].dtype)
        return self._host_chunks(adapter.layouts, factors_by_device, keep)

    def _host_chunks(self, layouts, factors_by_device, keep: Collection[int] = ()) -> HostCopy:
        """A host copy of the given factors in the layouts' chunks (room taken under the lock, filled outside),
        dropping no copy of a resident adapter or of ``keep``."""
        with self.lock:
            sizes = {device: (layout.size, self.pools[device].dtype) for device, layout in layouts.items()}
            copy = self.host.allocate(sizes, keep={*self._resident, *keep})
        try:
            for device, layout in layouts.items():
                layout.fill(copy.chunks[device], factors_by_device[device])
        except BaseException:
            with self.lock:
                self.host.release(copy)
            raise
        return copy

    def _read_in_background(self, adapter: Adapter, place: bool = False, keep: Collection[int] = ()) -> None:
        if adapter.reading is not None:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="punica_hf-reader")

        def read() -> None:
            try:
                copy = self._read_source(adapter, keep)
            except BaseException as error:  # the acquire that asked for it says why at its next try
                if place:  # a prefetch is a hint: nobody waits for it, and the next use reads again
                    logger.warning("prefetching adapter %r failed: %s: %s", adapter.name, type(error).__name__, error)
                with self.lock:
                    adapter.reading, adapter.read_failure = None, None if place else (error, time.monotonic())
                raise
            with self.changing():
                adapter.reading = None
                if adapter.unloaded:
                    self.host.release(copy)
                    return
                self._keep_copy(adapter, copy)
                if place:
                    self._try_place(adapter, evict=True)

        adapter.reading = self._reader.submit(read)

    # ------------------------------------------------------------------------------------------ checks
    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        if name in self._by_name:
            raise ValueError(f"an adapter named {name!r} is already loaded; unload_adapter({name!r}) first")

    def _check_fits(self, name: str, weights: AdapterWeights, targets: dict[str, LinearModule]) -> None:
        for module_name, factors in weights.modules.items():
            self.module_hooks.check_targets(name, [module_name])
            target = targets[module_name]
            in_features, out_features = target.in_features, target.out_features
            if factors.lora_a.shape[1] != in_features or factors.lora_b.shape[0] != out_features:
                raise ValueError(
                    f"adapter {name!r} does not fit the base model: module {module_name} takes lora_A "
                    f"[r, {in_features}] and lora_B [{out_features}, r], the adapter has "
                    f"{list(factors.lora_a.shape)} and {list(factors.lora_b.shape)}"
                )
            if factors.rank > self.max_rank:
                raise ValueError(
                    f"adapter {name!r}: module {module_name} has rank {factors.rank} > max_rank={self.max_rank}"
                )
            _check_in_range(name, module_name, factors, target.dtype)

    def _check_sizes(self, name: str, layouts: dict[torch.device, ChunkLayout], device_bytes: int) -> None:
        for device, layout in layouts.items():
            pool = self.pools[device]
            if layout.size > pool.allocator.capacity:
                raise ValueError(
                    f"adapter {name!r} needs {layout.size * pool.element_size / 2**20:.1f} MiB on {device} but the "
                    f"whole pool there is {pool.allocator.capacity * pool.element_size / 2**20:.1f} MiB "
                    "(raise gpu_pool_bytes)"
                )
        if device_bytes > self.host.budget:
            raise ValueError(
                f"adapter {name!r} needs {device_bytes / 2**20:.1f} MiB of host memory but host_pool_bytes is "
                f"{self.host.budget / 2**20:.1f} MiB"
            )

    # ------------------------------------------------------------------------------------------ pools
    def _pool_for(
        self, target: LinearModule, targets: dict[str, LinearModule], rows: dict[str, int], new_pools: list
    ) -> DevicePool:
        """The pool on ``target``'s device, made (and noted in ``new_pools``) if there is none yet."""
        device = target.device
        if device not in self.pools:
            element_size = torch.empty(0, dtype=target.dtype).element_size()
            pool_bytes = self.gpu_pool_bytes
            if pool_bytes is None:  # room for max_adapters adapters of max_rank on every linear layer, capped
                features = sum(sum(m.sizing_features) for m in targets.values())
                most = self.max_adapters * self.max_rank * features * element_size
                split = any(m.widest_features is not None for m in targets.values())
                pool_bytes = min(most, _default_pool_cap(device, split))
            self.pools[device] = DevicePool(device, target.dtype, pool_bytes // element_size, rows, self.max_adapters)
            new_pools.append(device)
        return self.pools[device]

    def _free_index(self) -> int:
        index = 0
        while index in self._by_index:
            index += 1
        return index

    def apply(self, fn) -> None:
        """Follow the model through ``.to()`` / ``.cuda()`` / ``.half()``: the pools' tensors move with it.

        Element offsets do not depend on the dtype, so a dtype change keeps every table valid; a device change
        re-keys what is kept per device (host copies are cast and copied to the new device when next placed).
        """
        with self.changing():
            moved = {}
            for device, pool in self.pools.items():
                pool.apply(fn)
                moved[device] = pool.device
            if all(old == new for old, new in moved.items()):
                return
            self.pools = {moved[device]: pool for device, pool in self.pools.items()}
            for adapter in self._by_index.values():
                adapter.layouts = {moved[d]: layout for d, layout in adapter.layouts.items()}
                adapter.chunk_starts = {moved[d]: start for d, start in adapter.chunk_starts.items()}
                adapter.copies_done = {}
                if adapter.prefetched is not None:
                    adapter.prefetched.chunks = {moved[d]: c for d, c in adapter.prefetched.chunks.items()}
            self.host.rekey(moved)

    def check_cast(self, fn) -> None:
        """Refuse ``fn`` (a ``.to()`` / ``.half()``, before it moves anything) where the dtype it casts a device pool
        to cannot hold a registered adapter's values there or in its host copy: cast, they would turn into inf. An
        adapter read again from its source later is checked when it is read."""
        with self.lock:
            for device, pool in self.pools.items():
                dtype = fn(pool.tables.pool[:0]).dtype
                if not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(pool.dtype).max:
                    continue
                for adapter in self._by_index.values():
                    for chunk in self._chunks_of(adapter, device):
                        peak = _peak(chunk)
                        if peak > torch.finfo(dtype).max:
                            raise ValueError(
                                f"cannot cast the model's adapters to {dtype}: adapter {adapter.name!r} has values of "
                                f"magnitude up to {peak:.3g}, beyond its range (at most {torch.finfo(dtype).max:.5g}); "
                                f"unload it first"
                            )

    def _chunks_of(self, adapter: Adapter, device: torch.device) -> list[torch.Tensor]:
        """``adapter``'s chunks for ``device``'s pool: the one in the pool (copied in), on the host, prefetched."""
        chunks = []
        if device in adapter.chunk_starts:
            done = adapter.copies_done.get(device)
            if done is not None:
                done.synchronize()
            start = adapter.chunk_starts[device]
            chunks.append(self.pools[device].tables.pool[start : start + adapter.layouts[device].size])
        for copy in (self.host.peek(adapter.index), adapter.prefetched):
            if copy is not None and device in copy.chunks:
                chunks.append(copy.chunks[device])
        return chunks

    def unwrap(self) -> None:
        """The model gives its hooks up for good: from now on the store refuses every call that would use adapters.
        Refused (nothing changes) while a call holds adapters: its later steps would run without them."""
        with self.lock:
            self._release_collected_leases()
            held = sorted({adapter.name for adapter in self._by_index.values() if adapter.users > 0})
            if held:
                raise RuntimeError(
                    f"unwrap() while running calls hold the adapters {held} (a generate() or forward(), or an "
                    "engine's requests): the rest of their steps would run without them; let them finish, or shut "
                    "the engine down, first (nothing was changed)"
                )
            self.unwrapped = True

    def check_wrapped(self) -> None:
        if self.unwrapped:
            raise RuntimeError(
                "this MultiLoraModel was unwrapped: unwrap() removed its LoRA hooks and gave the base model back, so "
                "it serves no adapters any more; wrap the model again with MultiLoraModel(model) to use adapters"
            )

    # ------------------------------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(
                registered=len(self._by_name),
                resident=len(self._resident),
                **self.counters,
                gpu_bytes_used=sum(p.allocator.used * p.element_size for p in self.pools.values()),
                gpu_bytes_total=sum(p.allocator.capacity * p.element_size for p in self.pools.values()),
                host_bytes_used=self.host.used,
                host_bytes_budget=self.host.budget,
                factor_bytes=sum(a.factor_bytes for a in self._by_name.values()),
                factor_bytes_unsplit=sum(a.unsplit_bytes for a in self._by_name.values()),
            )


def _chunk_dims(weights: AdapterWeights) -> dict[str, tuple]:
    """Per module, what its part of a chunk is laid out for: ``(in, out, rank, has output_scale, has output_shift)``."""
    return {
        name: (f.lora_a.shape[1], f.lora_b.shape[0], f.rank, f.output_scale is not None, f.output_shift is not None)
        for name, f in weights.modules.items()
    }


def _factor_bytes(weights: AdapterWeights, targets: dict[str, LinearModule]) -> tuple[int, int]:
    """An adapter's factor bytes ``r * (in + out)`` per module in its modules' LoRA dtypes: as held here, and on the
    whole layers (the same numbers unless tensor parallelism splits them)."""
    held = unsplit = 0
    for module_name, factors in weights.modules.items():
        target = targets[module_name]
        element_size = torch.empty(0, dtype=target.dtype).element_size()
        whole_in, whole_out = target.unsplit_features or (target.in_features, target.out_features)
        held += factors.rank * (target.in_features + target.out_features) * element_size
        unsplit += factors.rank * (whole_in + whole_out) * element_size
    return held, unsplit


def _check_in_range(adapter: str, module: str, factors: ModuleLora, dtype: torch.dtype) -> None:
    """Refuse a module's factors or output vectors with values that ``dtype``, the one its LoRA runs in, cannot
    hold: copied into the pool they would turn into inf (float16 holds at most 65504)."""
    largest = torch.finfo(dtype).max
    for factor_name in ("lora_a", "lora_b", "output_scale", "output_shift"):
        factor = getattr(factors, factor_name)
        if factor is None or factor.numel() == 0 or torch.finfo(factor.dtype).max <= largest:  # every value fits
            continue
        peak = _peak(factor)
        if peak > largest:
            raise ValueError(
                f"adapter {adapter!r}: module {module} has values of magnitude up to {peak:.3g} in its {factor_name}, "
                f"beyond the range of {dtype}, the dtype its LoRA runs in (at most {largest:.5g})"
            )


def _peak(values: torch.Tensor) -> float:
    """The largest magnitude in ``values`` (0 when empty), in one pass without a temporary (abs() would make one)."""
    if values.numel() == 0:
        return 0.0
    low, high = torch.aminmax(values)
    return max(-low.item(), high.item())


def check_wait(name: str, seconds: Any) -> float:
    """``seconds`` to wait for device room, checked: a finite number >= 0 (0: do not wait)."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _adapter_list(adapters: Any) -> list:
    """A call's adapters as a list; a single name is one adapter (not the characters it iterates over)."""
    if isinstance(adapters, str):
        return [adapters]
    if not isinstance(adapters, Iterable):
        raise ValueError(f"expected an adapter name or a list of adapter names or indices, got {adapters!r}")
    return list(adapters)


def _default_pool_cap(device: torch.device, split: bool) -> int:
    """The most a pool takes when ``gpu_pool_bytes`` is not given: a fraction of the GPU's free memory, or of its
    whole memory for a tensor-parallel model (``split``), whose ranks must size their pools alike (their free
    memory differs) to place and evict alike."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int((total if split else free) * GPU_POOL_FRACTION)
    return CPU_POOL_BYTES


def _sized_for_every_rank(layout: ChunkLayout, factors: dict[str, ModuleLora],
                          targets: dict[str, LinearModule]) -> ChunkLayout:
    """``layout`` with its chunk as large as the widest rank's under tensor parallelism (unchanged otherwise): the
    ranks of an uneven split hold chunks of different sizes, and each rank's pool would fill, evict and hand out
    slots at other times than rank 0's (every rank must place an adapter in the same slot)."""
    widest = 0
    for name, module in factors.items():
        in_features, out_features = targets[name].sizing_features
        vectors = (module.output_scale is not None) + (module.output_shift is not None)
        widest += aligned(module.rank * in_features) + aligned(module.rank * out_features)
        widest += vectors * aligned(out_features)
    return dataclasses.replace(layout, size=max(layout.size, widest))
