"""The device-resident slot table: for every layer and fused linear kind, the A and B factors of
max_loras adapters, allocated once at start ([S, in, n * R], A stored transposed, and [S, n * R, out]:
a captured CUDA graph would read them at fixed addresses). Loading an adapter into a slot copies its
host tensors in place; the kinds it does not target are zeroed, so a stale adapter never leaks into
a row. `kind_bits` (int32 [S], bit i: KINDS[i] targeted) says the same per slot to the native CPU
step, which skips the kinds a slot's adapter leaves alone."""

from __future__ import annotations

import torch

from pipeserve.model_config import ModelConfig

from .layout import KINDS, SUBS, dense_mlp_layers, fused_shapes
from .weights import HostAdapter


class SlotTable:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        shapes = fused_shapes(cfg)
        dense = dense_mlp_layers(cfg)
        self.tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(cfg.num_layers):
            for kind in KINDS:
                if kind in ("gate_up", "down") and not dense[layer]:
                    continue
                n = len(SUBS[kind]) * max_rank
                shape = shapes[kind]
                self.tables[(layer, kind)] = (
                    torch.zeros(num_slots, shape.d_in, n, dtype=dtype, device=device),
                    torch.zeros(num_slots, n, shape.d_out, dtype=dtype, device=device),
                )
        self.kinds: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets
        self.kind_bits = torch.zeros(num_slots, dtype=torch.int32)  # host memory: read by the native step
        self.ids = [0] * num_slots  # the adapter id in each slot (0: none)

    def load(self, slot: int, adapter: HostAdapter) -> None:
        for key, (a, b) in self.tables.items():
            factors = adapter.factors.get(key)
            if factors is None:
                a[slot].zero_()
                b[slot].zero_()
            else:
                a[slot].copy_(factors[0], non_blocking=True)
                b[slot].copy_(factors[1], non_blocking=True)
        self.kinds[slot] = adapter.kinds
        self.kind_bits[slot] = sum(1 << KINDS.index(kind) for kind in adapter.kinds)
        self.ids[slot] = adapter.request.lora_int_id

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tables.values())
