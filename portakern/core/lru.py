"""One bounded cache for every cache portakern keeps (core layer): compiled programs, jitted
functions, plans. A store beyond the bound drops the least recently used entry."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class LRUCache:
    """A dict-like cache of at most ``maxsize`` entries; ``get`` marks an entry recently used
    and a store beyond the bound evicts the least recently used one (``on_evict`` is then
    called, e.g. to drop what referenced it). Not thread-safe by itself: writers hold the
    owner's lock; a concurrent reader may at worst miss and rebuild."""

    def __init__(self, maxsize: int, on_evict: Any = None) -> None:
        self.maxsize = int(maxsize)
        self._data: OrderedDict = OrderedDict()
        self._on_evict = on_evict
        self.evictions = 0  # entries dropped for the bound
        self.inserts = 0  # stores of a key not present: what was made anew
        # lookup(key): ``get`` without marking the entry recently used, the value or None.
        # The dict's own bound get (``_data`` is never replaced), for the per-call paths
        # (plans, opencl's output templates): ~0.3 µs less than ``get``. An entry found
        # only this way ages as if unused and may be evicted first: then it is made again.
        self.lookup = self._data.get

    def get(self, key: Any, default: Any = None) -> Any:
        data = self._data
        try:
            value = data[key]
        except KeyError:
            return default
        try:
            data.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        data = self._data
        if key not in data:
            self.inserts += 1
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.maxsize:
            data.popitem(last=False)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict()

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Any:
        return iter(list(self._data))

    def keys(self) -> Any:
        return list(self._data.keys())

    def values(self) -> Any:
        return list(self._data.values())

    def items(self) -> Any:
        return list(self._data.items())

    def pop(self, key: Any, *default: Any) -> Any:
        return self._data.pop(key, *default)

    def clear(self) -> None:
        self._data.clear()

    def info(self) -> dict[str, int]:
        """{"size", "maxsize", "inserts", "evictions"}: what ``Backend.cache_info`` reports."""
        return {"size": len(self._data), "maxsize": self.maxsize, "inserts": self.inserts,
                "evictions": self.evictions}
