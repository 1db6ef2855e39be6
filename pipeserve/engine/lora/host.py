"""Adapters held in host memory: at most max_cpu_loras that no request holds, least recently used
evicted first. An adapter a waiting or running request holds is never evicted (the cache may then
hold more), so admitting a request never reads the disk."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pipeserve.lora import LoRARequest

from .weights import HostAdapter


class HostCache:
    def __init__(self, capacity: int, load: Callable[[LoRARequest], HostAdapter]) -> None:
        self.capacity, self.load = capacity, load
        self.adapters: OrderedDict[int, HostAdapter] = OrderedDict()  # id -> adapter, LRU first
        self.holders: dict[int, int] = {}  # id -> requests holding it
        self.loads = 0  # reads from disk

    def hold(self, request: LoRARequest) -> HostAdapter:
        """The adapter, read from disk on a miss (LoRAError when its directory is bad), held until
        `drop`."""
        key = request.lora_int_id
        adapter = self.adapters.get(key)
        if adapter is None or adapter.request.lora_path != request.lora_path:
            adapter = self.load(request)
            self.loads += 1
            self.adapters[key] = adapter
        self.adapters.move_to_end(key)
        self.holders[key] = self.holders.get(key, 0) + 1
        self._evict()
        return adapter

    def drop(self, request: LoRARequest) -> None:
        key = request.lora_int_id
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
        self._evict()

    def get(self, key: int) -> HostAdapter:
        return self.adapters[key]

    def _evict(self) -> None:
        free = [k for k in self.adapters if k not in self.holders]  # LRU first
        for key in free[: max(0, len(self.adapters) - self.capacity)]:
            del self.adapters[key]
