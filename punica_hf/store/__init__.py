"""Adapters of one model: registration, a rank-proportional device pool with LRU residency, a host tier.

``store.py`` ties the tiers together; ``pool.py`` is the device tier (flat pools, chunk layout, slot tables);
``host.py`` the host tier. The store touches no module of the base model: the hooks are
``punica_hf.injection``'s, which the store reaches through the ``ModuleHooks`` it is given.
"""

from .store import (
    CAPACITY_WAIT_S,
    AdapterCapacityError,
    AdapterLease,
    AdapterNotReady,
    AdapterPlan,
    AdapterReadError,
    AdapterStore,
    ModuleHooks,
    check_wait,
)

__all__ = [
    "AdapterStore", "AdapterLease", "AdapterPlan", "AdapterCapacityError", "AdapterNotReady", "AdapterReadError",
    "ModuleHooks",
    "CAPACITY_WAIT_S", "check_wait",
]
