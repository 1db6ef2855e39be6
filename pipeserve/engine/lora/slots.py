"""The device-resident slot table: for every layer and fused linear kind, the A and B factors of
max_loras adapters, allocated once at start ([S, in, n * R], A stored transposed, and [S, n * R, out]:
a captured CUDA graph would read them at fixed addresses). Loading an adapter into a slot copies its
host tensors in place; the kinds it does not target are zeroed, so a stale adapter never leaks into
a row. `kind_bits` (int32 [S], bit i: KINDS[i] targeted) says the same per slot to the native CPU
step, which skips the kinds a slot's adapter leaves alone. Under tensor parallelism each rank's table
holds its shard of every adapter (shard.py), shaped like its base layers. `table_bytes` is its size
before it exists, for the KV cache's budget (pipeserve/engine/shard.py)."""

from __future__ import annotations

import math

import torch

from pipeserve.model_config import ModelConfig

from .layout import KINDS, SUBS, dense_mlp_layers, fused_shapes
from .shard import LoRAShard
from .weights import HostAdapter

Shape = tuple[int, int, int]
Shapes = dict[tuple[int, str], tuple[Shape, Shape]]


def table_shapes(cfg: ModelConfig, num_slots: int, max_rank: int, shard: LoRAShard | None = None) -> Shapes:
    """(layer, kind) -> the shapes of its A^T and B tables (cfg: the checkpoint's; shard: this rank's
    part, None: the whole)."""
    shapes = fused_shapes(cfg if shard is None else shard.local)
    dense = dense_mlp_layers(cfg)
    out: Shapes = {}
    for layer in range(cfg.num_layers):
        for kind in KINDS:
            if kind in ("gate_up", "down") and not dense[layer]:
                continue
            n = len(SUBS[kind]) * max_rank
            shape = shapes[kind]
            out[(layer, kind)] = (num_slots, shape.d_in, n), (num_slots, n, shape.d_out)
    return out


def table_bytes(cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                shard: LoRAShard | None = None) -> int:
    """What the slot table will take on the device, before it is allocated (the KV budget leaves it out)."""
    shapes = table_shapes(cfg, num_slots, max_rank, shard).values()
    return dtype.itemsize * sum(math.prod(a) + math.prod(b) for a, b in shapes)


class SlotTable:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, shard: LoRAShard | None = None) -> None:
        """cfg: the checkpoint's; shard: this rank's part of each adapter (None: the whole)."""
        self.num_slots, self.max_rank, self.shard = num_slots, max_rank, shard
        self.tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {
            key: (torch.zeros(a, dtype=dtype, device=device), torch.zeros(b, dtype=dtype, device=device))
            for key, (a, b) in table_shapes(cfg, num_slots, max_rank, shard).items()}
        self.kinds: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets
        self.kind_bits = torch.zeros(num_slots, dtype=torch.int32)  # host memory: read by the native step
        self.ids = [0] * num_slots  # the adapter id in each slot (0: none)

    def load(self, slot: int, adapter: HostAdapter) -> None:
        self.load_factors(slot, adapter.request.lora_int_id, adapter.factors)

    def load_factors(self, slot: int, adapter_id: int,
                     factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """An adapter's full factors ((layer, kind) -> A^T, B, as weights.py lays them out) into `slot`
        (this rank's shard of them)."""
        for key, (a, b) in self.tables.items():
            pair = factors.get(key)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
            elif self.shard is None:
                a[slot].copy_(pair[0], non_blocking=True)
                b[slot].copy_(pair[1], non_blocking=True)
            else:
                self.shard.copy(key[0], key[1], (a[slot], b[slot]), pair)
        kinds = frozenset(kind for _, kind in factors)
        self.kinds[slot] = kinds
        self.kind_bits[slot] = sum(1 << KINDS.index(kind) for kind in kinds)
        self.ids[slot] = adapter_id

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tables.values())
