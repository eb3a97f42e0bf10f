"""Adapters of one model: registration, a rank-proportional device pool with LRU residency, a host tier.

``store.py`` ties the tiers together; ``pool.py`` is the device tier (flat pools, chunk layout, slot tables);
``host.py`` the host tier.
"""

from .store import AdapterCapacityError, AdapterLease, AdapterNotReady, AdapterStore

__all__ = ["AdapterStore", "AdapterLease", "AdapterCapacityError", "AdapterNotReady"]
