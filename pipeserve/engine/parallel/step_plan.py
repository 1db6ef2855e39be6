"""The step plan: what rank 0's runner sends every step so ranks 1..T-1 run the same forward pass on
their shards. It is the model's input as the runner staged it (token ids, positions, slot mapping, block
tables, sequence lengths, sampled rows), so the workers need no scheduler, no block table and no
request state of their own.

A plan is one broadcast over the group (gloo or NCCL, device tensors on CUDA) of a fixed-size int64
buffer: the header (the kind, the sizes and the host-side maxima of AttentionMetadata), then every
index tensor flattened into one payload, inline when it fits (decode batches up to a few dozen rows
of long contexts) or else in a second broadcast. A quantized KV cache adds the page -> mean-key row
map (`seq_of_page`), which the pool writes on rank 0 when it hands out a request's first page.
With LoRA adapters the plan carries each row's adapter slot and the prefill chunks' bounds (the
adapters' row index, `AdapterIndex`), and the slots rank 0 wrote since the last step (`SlotLoads`:
which adapter went into which slot, its factors packed in one more broadcast), so that every rank
writes its shard of the same adapters into the same slots before the step runs.
Collective latency, not bytes, is what a plan costs (docs/engine.md has the measurement), hence
one fixed-size broadcast rather than a header and a payload of its size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.staging import Turns

if TYPE_CHECKING:  # the group sends the stop plan when it closes: it imports this module
    from .group import TPGroup

STOP, STEP = 0, 1
HEADER = 15
INLINE = 2048  # payload elements sent inside the header's broadcast (16 KiB)
# Header slots.
(KIND, TOKENS, DECODE, PREFILL, PAGES, SAMPLED,
 MAX_Q, MAX_PREFILL, MAX_DECODE, MAX_SAMPLE, SIZE, MEANS,
 LORA_BOUNDS, LORA_LOADS, LORA_BYTES) = range(HEADER)


def stop_header(device: torch.device) -> torch.Tensor:
    return torch.zeros(HEADER + INLINE, dtype=torch.int64, device=device)  # KIND == STOP


@dataclass
class AdapterIndex:
    """The LoRA adapters' row index of a step (host arrays): what the LoRA layers of every rank read."""

    slots: np.ndarray  # [T] each row's adapter slot (-1: none)
    chunk_bounds: np.ndarray  # [C + 1] the prefill chunks' row bounds; the rows before them are gathered
    sample_rows: np.ndarray | None  # the rows the last layer keeps (None: every row)


@dataclass
class SlotLoads:
    """Adapters rank 0 wrote into LoRA slots since the last step: one descriptor row each (its
    length fixed by the slot table: pipeserve/engine/lora/tensor_parallel.py) and their factors,
    packed, on the group's device."""

    descriptors: np.ndarray  # int64 [L, D]
    data: torch.Tensor  # uint8


# Rank 0: the step's adapter index (None: no row has an adapter) and the slots written since the last
# step (None: none).
LoRAPart = Callable[[], tuple[AdapterIndex | None, SlotLoads | None]]


@dataclass
class Step:
    """A worker's model input for one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    num_sampled: int  # rows whose logits rank 0 gathers (0: only partial prefill chunks)
    adapters: AdapterIndex | None = None
    loads: SlotLoads | None = None


class StepSender:
    """Rank 0's side: the runner calls `send` with the model's input of every step, before its own
    forward pass. seq_of_page: the quantized KV cache's page -> mean-key row map (None otherwise);
    lora: the LoRA adapters' part of each step (None: LoRA is off)."""

    def __init__(self, group: TPGroup, seq_of_page: torch.Tensor | None = None,
                 lora: LoRAPart | None = None) -> None:
        self.group, self.seq_of_page, self.lora = group, seq_of_page, lora
        self.plan = torch.zeros(HEADER + INLINE, dtype=torch.int64, device=group.device)
        # On CUDA the header is written on the host and uploaded without a sync, from two pinned
        # buffers used in turns: rewriting the one just uploaded could race its copy, still in flight
        # when the next step's plan is written (pipeserve/engine/staging.py). On the CPU the plan's
        # header is written in place.
        self.headers: Turns[torch.Tensor] | None = None
        if group.device.type == "cuda":
            pinned = [torch.zeros(HEADER, dtype=torch.int64, device="cpu", pin_memory=True) for _ in range(2)]
            self.headers = Turns(pinned, torch.cuda.Event)

    def send(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        seq_of_page = self.seq_of_page
        parts = [input_ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
                 meta.prefill_block_tables, meta.prefill_cu_q_lens, meta.prefill_seq_lens]
        sampled = -1  # every row
        if meta.sample_rows is not None:
            assert meta.sample_block_tables is not None and meta.sample_seq_lens is not None
            parts += [meta.sample_rows, meta.sample_block_tables, meta.sample_seq_lens]
            sampled = int(meta.sample_rows.shape[0])
        index, loads = self.lora() if self.lora is not None else (None, None)
        bounds = num_loads = num_bytes = 0
        host_parts = []  # uploaded without a sync (pageable host memory is staged at once)
        if index is not None:
            assert index.slots.size == input_ids.shape[0] and (index.sample_rows is None) == (sampled < 0)
            host_parts += [index.slots, index.chunk_bounds]
            bounds = index.chunk_bounds.size
        if loads is not None:
            host_parts.append(loads.descriptors)
            num_loads, num_bytes = loads.descriptors.shape[0], loads.data.numel()
        parts += [torch.from_numpy(a).to(input_ids.device, non_blocking=True) for a in host_parts]
        payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
        host = self.plan[:HEADER] if self.headers is None else self.headers.next()
        host.numpy()[:] = (STEP, input_ids.shape[0], meta.num_decode, meta.num_prefill_seqs,
                     meta.decode_block_tables.shape[1], sampled, meta.prefill_max_q_len,
                     meta.prefill_max_seq_len, meta.decode_max_seq_len, meta.sample_max_seq_len,
                     payload.shape[0], seq_of_page is not None, bounds, num_loads, num_bytes)
        if self.headers is not None:
            self.plan[:HEADER].copy_(host, non_blocking=True)
        inline = payload.shape[0] <= INLINE
        if inline:
            self.plan[HEADER : HEADER + payload.shape[0]] = payload
        self.group.broadcast(self.plan)
        if not inline:
            self.group.broadcast(payload)
        if seq_of_page is not None:
            self.group.broadcast(seq_of_page)
        if loads is not None:
            self.group.broadcast(loads.data)


class StepReceiver:
    """A worker's side: `receive()` blocks until rank 0's next plan; None when told to stop.
    lora_descriptor: the length of a slot load's descriptor (0: LoRA is off)."""

    def __init__(self, group: TPGroup, seq_of_page: torch.Tensor | None, lora_descriptor: int = 0) -> None:
        self.group, self.seq_of_page, self.lora_descriptor = group, seq_of_page, lora_descriptor
        self.plan = torch.zeros(HEADER + INLINE, dtype=torch.int64, device=group.device)
        self.payload = torch.zeros(0, dtype=torch.int64, device=group.device)  # grown, then reused

    def receive(self) -> Step | None:
        self.group.broadcast(self.plan)
        # With LoRA the header and the inline payload reach the host in one copy (on the CPU: no copy):
        # the adapters' index is read there. Without it, the header alone.
        host = self.plan.cpu() if self.lora_descriptor else self.plan[:HEADER].cpu()
        h = host[:HEADER].tolist()
        if h[KIND] == STOP:
            return None
        host_payload = None
        if h[SIZE] <= INLINE:
            payload = self.plan[HEADER : HEADER + h[SIZE]]
            host_payload = host[HEADER : HEADER + h[SIZE]]
        else:
            if self.payload.shape[0] < h[SIZE]:
                self.payload = torch.zeros(h[SIZE], dtype=torch.int64, device=self.group.device)
            payload = self.payload[: h[SIZE]]
            self.group.broadcast(payload)
        if h[MEANS]:
            assert self.seq_of_page is not None, "rank 0's KV cache is quantized, this rank's is not"
            self.group.broadcast(self.seq_of_page)
        data = None
        if h[LORA_LOADS]:
            data = torch.empty(h[LORA_BYTES], dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(data)
        t, nd, bp, pages, sampled = h[TOKENS], h[DECODE], h[PREFILL], h[PAGES], h[SAMPLED]
        sizes = [t, t, t, nd * pages, nd, bp * pages, bp + 1, bp]
        if sampled >= 0:
            sizes += [sampled, sampled * pages, sampled]
        lora = len(sizes)
        if h[LORA_BOUNDS]:
            sizes += [t, h[LORA_BOUNDS]]
        sizes.append(h[LORA_LOADS] * self.lora_descriptor)
        views = list(torch.split(payload, sizes))
        ids, positions, slots, d_tables, d_lens, p_tables, p_cu, p_lens = views[:8]
        i32 = torch.int32
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode=nd,
            decode_block_tables=d_tables.view(nd, pages).to(i32),
            decode_seq_lens=d_lens.to(i32),
            prefill_block_tables=p_tables.view(bp, pages).to(i32),
            prefill_cu_q_lens=p_cu.to(i32),
            prefill_seq_lens=p_lens.to(i32),
            prefill_max_q_len=h[MAX_Q],
            prefill_max_seq_len=h[MAX_PREFILL],
            decode_max_seq_len=h[MAX_DECODE],
            sample_max_seq_len=h[MAX_SAMPLE],
        )
        if sampled >= 0:
            rows, s_tables, s_lens = views[8:11]
            meta.sample_rows = rows
            meta.sample_block_tables = s_tables.view(sampled, pages).to(i32)
            meta.sample_seq_lens = s_lens.to(i32)
        step = Step(ids, positions, meta, t if sampled < 0 else sampled)
        if h[LORA_BOUNDS] or data is not None:
            if host_payload is None:  # a plan too large for the header's broadcast
                host_payload = payload.cpu()
            arrays = [v.numpy() for v in torch.split(host_payload, sizes)]
            if h[LORA_BOUNDS]:
                sample_rows = arrays[8] if sampled >= 0 else None
                step.adapters = AdapterIndex(arrays[lora], arrays[lora + 1], sample_rows)
            if data is not None:
                step.loads = SlotLoads(arrays[-1].reshape(h[LORA_LOADS], self.lora_descriptor), data)
        return step
