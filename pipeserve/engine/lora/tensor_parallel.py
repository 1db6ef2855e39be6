"""LoRA adapters across the ranks of a tensor-parallel engine. Rank 0 schedules and swaps adapters
(manager.py); each step plan (pipeserve/engine/parallel/step_plan.py) carries what the other ranks
need to apply the same adapters to their shards: the step's row -> slot index, and the slots written
since the last step, each as a descriptor (slot, adapter id, which of the table's (layer, kind)
entries it targets) and the adapter's full factors packed in one byte buffer. Every rank cuts its own
shard of them into its slot table (shard.py) before the step runs, so no rank reads the adapter's
directory but rank 0, and a bad directory stays rank 0's request error."""

from __future__ import annotations

import numpy as np
import torch

from pipeserve.engine.executor.buffers import StepBuffers
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.parallel.step_plan import AdapterIndex, SlotLoads
from pipeserve.model_config import ModelConfig

from .layer import attach
from .layout import SUBS
from .rows import LoRAContext, buffer_shapes
from .shard import LoRAShard
from .slots import SlotTable

Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def descriptor_size(table: SlotTable) -> int:
    """A slot load's descriptor: slot, adapter id, then one flag per (layer, kind) entry of the table."""
    return 2 + len(table.tables)


def _full_shapes(table: SlotTable) -> list[tuple[tuple[int, str], tuple[int, int], tuple[int, int]]]:
    """Each entry's key and the shapes of its full A^T and B."""
    assert table.shard is not None
    n = table.max_rank
    return [(key, (table.shard.full[key[1]].d_in, len(SUBS[key[1]]) * n),
             (len(SUBS[key[1]]) * n, table.shard.full[key[1]].d_out)) for key in table.tables]


def pack(table: SlotTable, loads: list[tuple[int, int, Factors]], device: torch.device) -> SlotLoads:
    """The (slot, adapter id, full factors) writes as descriptors and one byte buffer on `device`."""
    descriptors = np.zeros((len(loads), descriptor_size(table)), np.int64)
    tensors = []
    for row, (slot, adapter_id, factors) in zip(descriptors, loads, strict=True):
        row[:2] = slot, adapter_id
        for j, (key, a_shape, b_shape) in enumerate(_full_shapes(table)):
            pair = factors.get(key)
            if pair is not None:
                assert pair[0].shape == a_shape and pair[1].shape == b_shape, key
                row[2 + j] = 1
                tensors += [pair[0].reshape(-1), pair[1].reshape(-1)]
    data = torch.cat(tensors).view(torch.uint8)
    return SlotLoads(descriptors, data.to(device, non_blocking=True))


def unpack(table: SlotTable, loads: SlotLoads, dtype: torch.dtype) -> list[tuple[int, int, Factors]]:
    """pack's writes back: views of the byte buffer, in the table's dtype."""
    values = loads.data.view(dtype)
    out, offset = [], 0
    for row in loads.descriptors:
        factors: Factors = {}
        for j, (key, a_shape, b_shape) in enumerate(_full_shapes(table)):
            if not row[2 + j]:
                continue
            pair = []
            for shape in (a_shape, b_shape):
                size = shape[0] * shape[1]
                pair.append(values[offset : offset + size].view(shape))
                offset += size
            factors[key] = (pair[0], pair[1])
        out.append((int(row[0]), int(row[1]), factors))
    assert offset == values.numel(), "the slot loads' data does not match their descriptors"
    return out


class AdapterSender:
    """Rank 0: the LoRA part of each step plan (step_plan.LoRAPart), read as the plan is sent, after
    the runner indexed the step."""

    def __init__(self, context: LoRAContext, device: torch.device) -> None:
        assert context.manager is not None
        self.context, self.manager, self.device = context, context.manager, device

    def __call__(self) -> tuple[AdapterIndex | None, SlotLoads | None]:
        writes = self.manager.take_loads()
        loads = None
        if writes:
            loads = pack(self.context.table, [(slot, a.request.lora_int_id, a.factors) for slot, a in writes],
                         self.device)
        return self.context.step, loads


class RankAdapters:
    """Ranks 1..T-1: the rank's slot table (its shard of every slot) and the LoRA layers of its model,
    fed by each step plan."""

    def __init__(self, *, model: LlamaForCausalLM, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_num_seqs: int, rank: int, world: int, dtype: torch.dtype, device: torch.device) -> None:
        """cfg: the checkpoint's config (model is this rank's shard)."""
        self.dtype, self.device, self.max_num_seqs = dtype, device, max_num_seqs
        self.table = SlotTable(cfg, max_loras, max_lora_rank, dtype, device, LoRAShard(cfg, rank, world))
        self.context = LoRAContext(self.table)
        attach(model, self.table, self.context, model.backend)
        self.buffers: StepBuffers | None = None  # the index's buffers, grown to the largest step seen
        self.rows = 0

    @property
    def descriptor_size(self) -> int:
        return descriptor_size(self.table)

    def step(self, index: AdapterIndex | None, loads: SlotLoads | None) -> None:
        """Before the rank's forward pass: rank 0's slot writes, then the step's index."""
        if loads is not None:
            for slot, adapter_id, factors in unpack(self.table, loads, self.dtype):
                self.table.load_factors(slot, adapter_id, factors)
        if index is not None and index.slots.size > self.rows:
            # Rank 0 sizes these from its runner's largest step; a rank learns it from the steps.
            self.rows = max(index.slots.size, 2 * self.rows)
            shapes = buffer_shapes(self.rows, self.max_num_seqs, self.table.num_slots)
            self.buffers = StepBuffers(shapes=shapes, device=self.device)
        if self.buffers is not None:
            self.buffers.begin()
        self.context.index(index, self._stage)

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        assert self.buffers is not None  # only a step with an index stages it
        return self.buffers.stage(name, array)
