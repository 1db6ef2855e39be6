"""Who holds which slot. A request names its adapter when added (`hold`: read into host memory,
validated, or refused); the scheduler admits it only when its adapter is in a slot or one can take
it (`can_run`), and `acquire` swaps it in between steps: into a slot no running request uses, the
least recently used first. Requests of an adapter that finds no slot wait, and the scheduler admits
those behind them meanwhile. Under tensor parallelism (rank 0) the slots written since the last step
are kept for `take_loads`: the next step plan carries them, and every rank writes its shard."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from pipeserve.lora import LoRAError, LoRARequest
from pipeserve.model_config import ModelConfig

from .host import HostCache
from .shard import LoRAShard
from .slots import SlotTable
from .weights import HostAdapter, load_adapter

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, *, cfg: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device,
                 shard: LoRAShard | None = None) -> None:
        """shard: rank 0's part of each adapter under tensor parallelism (None: no other ranks)."""
        self.cfg, self.max_rank, self.dtype = cfg, max_lora_rank, dtype
        self.table = SlotTable(cfg, max_loras, max_lora_rank, dtype, device, shard)
        self.sharded = shard is not None
        self.loads: dict[int, HostAdapter] = {}  # slot -> the adapter written into it since the last step
        self.host = HostCache(max_cpu_loras, self._load)
        self.refs = [0] * max_loras  # running requests per slot
        self.last_used = [0] * max_loras  # the step clock of each slot's last acquire (LRU)
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.names: dict[int, str] = {}  # adapter id -> name (metrics)
        self.clock = 0
        self.swaps = 0  # adapters loaded into a slot
        # Request slot (the runner's row of per-request state) -> its adapter's slot, -1 for none: the
        # step's row index is this array gathered by the rows' request slots.
        self.request_slots = np.full(max_num_seqs, -1, np.int64)
        log.info("LoRA: %d slots of rank %d (%.1f MB on %s%s), %d adapters in host memory", max_loras,
                 max_lora_rank, self.table.nbytes / 1e6, device, ", this rank's shard" if shard else "",
                 max_cpu_loras)

    def _load(self, request: LoRARequest) -> HostAdapter:
        return load_adapter(request, self.cfg, self.max_rank, self.dtype)

    # -- a request's life ---------------------------------------------------------------------------
    def hold(self, request: LoRARequest) -> None:
        """At add: the adapter read (or found) in host memory. LoRAError: the request is refused."""
        self.host.hold(request)
        self.names[request.lora_int_id] = request.lora_name

    def drop(self, request: LoRARequest) -> None:
        """At the request's end."""
        self.host.drop(request)

    def can_run(self, request: LoRARequest | None) -> bool:
        """Whether a request of this adapter may be admitted now: its adapter is in a slot, or a slot
        no running request uses can take it."""
        return request is None or request.lora_int_id in self.slot_of or 0 in self.refs

    def acquire(self, request: LoRARequest | None, request_slot: int) -> None:
        """The admitted request's adapter in a slot (swapped in if need be); can_run was true."""
        if request is None:
            self.request_slots[request_slot] = -1
            return
        key = request.lora_int_id
        slot = self.slot_of.get(key)
        if slot is None:
            free = [s for s in range(self.table.num_slots) if self.refs[s] == 0]
            if not free:
                raise LoRAError("no free LoRA slot (can_run was not asked)")
            slot = min(free, key=lambda s: (self.table.ids[s] != 0, self.last_used[s], s))
            old = self.table.ids[slot]
            if old:
                del self.slot_of[old]
            adapter = self.host.get(key)
            self.table.load(slot, adapter)
            if self.sharded:
                self.loads[slot] = adapter
            self.slot_of[key] = slot
            self.swaps += 1
        self.refs[slot] += 1
        self.clock += 1
        self.last_used[slot] = self.clock
        self.request_slots[request_slot] = slot

    def release(self, request: LoRARequest | None, request_slot: int) -> None:
        """The request left the running set (finished or preempted); its adapter stays in the slot
        until another needs it."""
        if request is not None:
            self.refs[self.slot_of[request.lora_int_id]] -= 1
        self.request_slots[request_slot] = -1

    def take_loads(self) -> list[tuple[int, HostAdapter]]:
        """The (slot, adapter) writes since the last call (the last write of each slot), for the other
        tensor-parallel ranks."""
        loads, self.loads = sorted(self.loads.items()), {}
        return loads

    # -- metrics ----------------------------------------------------------------------------------
    def running(self) -> Counter[str]:
        """Running requests per adapter name."""
        return Counter({self.names[i]: self.refs[s] for i, s in self.slot_of.items() if self.refs[s]})
